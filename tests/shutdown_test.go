package tests

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
)

func TestRecoverAfterSIGKILL(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 256
	model := Synth(t, spec)
	d1 := Mount(t, model)
	mp := d1.Mountpoint
	if err := d1.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-d1.Exited()
	// statfs always asks the daemon (stat may answer from cached attributes).
	var sfs syscall.Statfs_t
	if err := syscall.Statfs(mp, &sfs); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("statfs of a killed daemon's mountpoint: %v, want ENOTCONN", err)
	}
	// Mounting again on the dead mountpoint recovers it, and says so.
	d2 := MountAt(t, model, mp)
	if !strings.Contains(d2.Log(), "detached a dead mount") {
		t.Fatalf("the new daemon did not log the recovery:\n%s", d2.Log())
	}
	if _, err := os.ReadFile(mp + "/manifest.json"); err != nil {
		t.Fatalf("the recovered mount does not serve: %v", err)
	}
	// engramfs unmount works on a dead mount too.
	if err := d2.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-d2.Exited()
	if out, err := exec.Command(Binary(t), "unmount", mp).CombinedOutput(); err != nil {
		t.Fatalf("engramfs unmount of a dead mount: %v\n%s", err, out)
	}
	if Mounted(mp) {
		t.Fatalf("%s still mounted after engramfs unmount", mp)
	}
}

// asNobody runs a shell command as uid/gid 65534.
func asNobody(script string) (string, error) {
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestControlFileIsOwnerOnly(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 256
	model := Synth(t, spec)
	// A mountpoint other users can reach (t.TempDir is 0700).
	mp := sharedDir(t) + "/mnt"
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}

	t.Run("default: other users cannot use the mount", func(t *testing.T) {
		d := MountAt(t, model, mp)
		if out, err := asNobody("cat " + mp + "/manifest.json"); err == nil || !strings.Contains(out, "ermission denied") {
			t.Fatalf("another user read the mount without --allow-other: %v %s", err, out)
		}
		d.Stop(t)
	})
	t.Run("allow-other: others read tables but cannot hint", func(t *testing.T) {
		MountAt(t, model, mp, "--allow-other")
		if out, err := asNobody("head -c 100 " + mp + "/layers/0/weight.safetensors >/dev/null"); err != nil {
			t.Fatalf("another user could not read a table with --allow-other: %v %s", err, out)
		}
		if out, err := asNobody("echo 'decode 0 1' > " + mp + "/.engramfs/control"); err == nil || !strings.Contains(out, "ermission denied") {
			t.Fatalf("another user wrote the control file: %v %s", err, out)
		}
		if out, err := asNobody("echo x > " + mp + "/layers/0/weight.safetensors"); err == nil {
			t.Fatalf("another user wrote a table: %s", out)
		}
		// The owner still can.
		if err := os.WriteFile(mp+"/.engramfs/control", []byte("decode 0 1\n"), 0); err != nil {
			t.Fatalf("the owner could not hint: %v", err)
		}
	})
}

func TestStatsCountGoroutinesBackToBaseline(t *testing.T) {
	// Goroutines started for a burst of hints and faults go away again.
	spec := backing.DefaultSynth()
	spec.Rows = 2000
	d := Mount(t, Synth(t, spec))
	time.Sleep(200 * time.Millisecond)
	base := d.Stats(t).Goroutines
	runLoadReaders(t, d, 4, 2*time.Second)
	waitGoroutines(t, d, base)
}

// waitGoroutines waits until the daemon's goroutine count is back to base.
// go-fuse keeps up to 16 request readers (its maxMaxReaders) blocked on
// /dev/fuse once load has started them, and a few transient ones: more than
// that is a leak.
func waitGoroutines(t *testing.T, d *Daemon, base int) {
	t.Helper()
	const slack = 16 + 4
	var n int
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if n = d.Stats(t).Goroutines; n <= base+slack {
			return
		}
	}
	t.Fatalf("daemon goroutines %d, baseline %d: a leak", n, base)
}

package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// helperLinks makes mount.fuse.engramfs and umount.fuse.engramfs symlinks to
// the engramfs binary in dir, as an install does in /sbin.
// helperTestbed makes a temporary directory, a small model and an empty
// mountpoint in it that is unmounted (and its daemon stopped) when t ends.
func helperTestbed(t *testing.T) (dir, model, mp string) {
	t.Helper()
	dir = t.TempDir()
	model = Synth(t, geometries()["4096B"])
	mp = filepath.Join(dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	cleanupMount(t, mp)
	return dir, model, mp
}

func helperLinks(t *testing.T, dir string) (mountHelper, umountHelper string) {
	t.Helper()
	mountHelper, umountHelper = filepath.Join(dir, "mount.fuse.engramfs"), filepath.Join(dir, "umount.fuse.engramfs")
	for _, p := range []string{mountHelper, umountHelper} {
		if err := os.Symlink(Binary(t), p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(p) })
	}
	return mountHelper, umountHelper
}

// daemonPid is the pid of the daemon serving mp (from its stats).
func daemonPid(t *testing.T, mp string) int {
	t.Helper()
	return mountAt(mp).Stats(t).Pid
}

func processGone(pid int) bool { return !procfs.Alive(pid) }

// cleanupMount detaches mp and kills its daemon if a test left them.
func cleanupMount(t *testing.T, mp string) {
	t.Cleanup(func() {
		if !Mounted(mp) {
			return
		}
		if s, err := stats.ReadFile(mp); err == nil && s.Pid > 0 {
			_ = syscall.Kill(s.Pid, syscall.SIGTERM)
		}
		time.Sleep(time.Second)
		_ = syscall.Unmount(mp, syscall.MNT_DETACH)
	})
}

// umountAndWait unmounts through the umount helper and checks the daemon
// is gone with the mount.
func umountAndWait(t *testing.T, umount func() ([]byte, error), mp string, pid int) {
	t.Helper()
	if out, err := umount(); err != nil {
		t.Fatalf("unmount: %v\n%s", err, out)
	}
	if Mounted(mp) {
		t.Fatalf("%s still mounted after the umount helper returned", mp)
	}
	// The helper waits for the daemon; allow a moment for init to reap it.
	for deadline := time.Now().Add(5 * time.Second); !processGone(pid); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("daemon %d still running after the umount helper returned", pid)
		}
	}
}

func TestMountHelperAsMountRunsIt(t *testing.T) {
	RequireFUSE(t)
	dir, model, mp := helperTestbed(t)
	mountHelper, umountHelper := helperLinks(t, dir)
	logFile := filepath.Join(dir, "daemon.log")

	// Exactly as mount(8) runs a helper: SPEC DIR [-sfnv] -o OPTIONS, with
	// the generic options it passes along.
	start := time.Now()
	out, err := exec.Command(mountHelper, model, mp, "-n", "-o", "rw,nosuid,nodev,cache_size=8M,queue_depth=16,log_file="+logFile).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", mountHelper, err, out)
	}
	t.Logf("the helper returned in %v", time.Since(start))
	// It returns once the mount answers.
	if _, err := os.ReadFile(filepath.Join(mp, "manifest.json")); err != nil || !Mounted(mp) {
		t.Fatalf("the helper returned but the mount does not answer: %v", err)
	}
	st := mountAt(mp).Stats(t)
	if st.CacheCapacityBytes != 8<<20 {
		t.Fatalf("cache_size=8M gave a %d-byte tier", st.CacheCapacityBytes)
	}
	log, _ := os.ReadFile(logFile)
	if !strings.Contains(string(log), "--cache-size=8M") || !strings.Contains(string(log), "--queue-depth=16") || !strings.Contains(string(log), "mounted") {
		t.Fatalf("the daemon's log does not show the translated flags and the mount:\n%s", log)
	}
	// The daemon is detached from the helper: its own session.
	pid := st.Pid
	if sid, _ := unix.Getsid(pid); sid != pid {
		t.Fatalf("daemon %d runs in session %d, want its own", pid, sid)
	}
	// Pin something, so the daemon's own mappings make the mount busy:
	// the umount helper must still unmount, and the daemon must exit.
	decodeStep(t, openControl(t, mountAt(mp)), 0, []uint64{1, 2, 3})
	umountAndWait(t, func() ([]byte, error) { return exec.Command(umountHelper, mp).CombinedOutput() }, mp, pid)
}

func TestMountHelperRefusesWithAClearError(t *testing.T) {
	RequireFUSE(t)
	dir, model, mp := helperTestbed(t)
	mountHelper, _ := helperLinks(t, dir)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{model, mp, "-o", "cache_size=8M,turbo=1,log_file=" + filepath.Join(dir, "l.log")}, `unknown option "turbo=1"`},
		{[]string{model, mp, "-o", "cache_size=lots,log_file=" + filepath.Join(dir, "l.log")}, `--cache-size "lots"`},
		{[]string{filepath.Join(dir, "no-model"), mp, "-o", "log_file=" + filepath.Join(dir, "l.log")}, "the daemon exited"},
	} {
		out, err := exec.Command(mountHelper, c.args...).CombinedOutput()
		if err == nil {
			t.Fatalf("%q: the helper succeeded:\n%s", c.args, out)
		}
		if !strings.Contains(string(out), c.want) {
			t.Fatalf("%q: the error does not say %q:\n%s", c.args, c.want, out)
		}
		if Mounted(mp) {
			t.Fatalf("%q: mounted anyway", c.args)
		}
	}
	// -f (fake): says what it would run, runs nothing.
	out, err := exec.Command(mountHelper, "-f", model, mp, "-o", "cache_size=8M,log_file="+filepath.Join(dir, "l.log")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--cache-size=8M") || Mounted(mp) {
		t.Fatalf("-f: %v, mounted %v\n%s", err, Mounted(mp), out)
	}
}

// TestMountTypeFuseEngramfs goes through util-linux mount(8) and umount(8),
// with the helpers where they look for them (/sbin), and through an fstab
// line (mount --fstab). uhelper=engramfs makes mount(8) record the mount in
// /run/mount/utab; only then does umount(8) run umount.fuse.engramfs
// (without it, util-linux 2.38 looks for umount.fuse), which a mount with
// pinned pages needs: the daemon's own mappings make a plain umount EBUSY.
func TestMountTypeFuseEngramfs(t *testing.T) {
	RequireFUSE(t)
	mountBin, err := exec.LookPath("mount")
	if err != nil {
		t.Skip("no mount(8)")
	}
	out, _ := exec.Command(mountBin, "--version").CombinedOutput()
	if !strings.Contains(string(out), "util-linux") {
		t.Skipf("mount(8) is not util-linux's: %s", out)
	}
	for _, name := range []string{"mount.fuse.engramfs", "umount.fuse.engramfs"} {
		p := filepath.Join("/sbin", name)
		if _, err := os.Lstat(p); err == nil {
			t.Skipf("%s exists already; not replacing an installed helper", p)
		}
		if err := os.Symlink(Binary(t), p); err != nil {
			t.Skipf("cannot place %s: %v", p, err)
		}
		t.Cleanup(func() { os.Remove(p) })
	}
	dir, model, mp := helperTestbed(t)
	logFile := filepath.Join(dir, "daemon.log")

	check := func(how string, cacheBytes int64) int {
		t.Helper()
		if _, err := os.ReadFile(filepath.Join(mp, "manifest.json")); err != nil {
			t.Fatalf("%s: the mount does not answer: %v", how, err)
		}
		st := mountAt(mp).Stats(t)
		if st.CacheCapacityBytes != cacheBytes {
			t.Fatalf("%s: a %d-byte tier, want %d", how, st.CacheCapacityBytes, cacheBytes)
		}
		return st.Pid
	}
	umount := func() ([]byte, error) { return exec.Command("umount", mp).CombinedOutput() }

	out, err = exec.Command(mountBin, "-t", "fuse.engramfs", model, mp, "-o", "cache_size=8M,queue_depth=32,uhelper=engramfs,log_file="+logFile).CombinedOutput()
	if err != nil {
		t.Fatalf("mount -t fuse.engramfs: %v\n%s", err, out)
	}
	pid := check("mount -t fuse.engramfs", 8<<20)
	decodeStep(t, openControl(t, mountAt(mp)), 0, []uint64{1, 2, 3}) // pinned pages: the mount is busy
	umountAndWait(t, umount, mp, pid)

	// An fstab line, as documented in docs/operations.md.
	fstab := filepath.Join(dir, "fstab")
	line := fmt.Sprintf("%s %s fuse.engramfs defaults,_netdev,nofail,uhelper=engramfs,cache_size=4M,queue_depth=32,log_file=%s 0 0\n", model, mp, logFile)
	if err := os.WriteFile(fstab, []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = exec.Command(mountBin, "--fstab", fstab, mp).CombinedOutput()
	if err != nil {
		t.Fatalf("mount --fstab %s %s: %v\n%s", fstab, mp, err, out)
	}
	pid = check("fstab", 4<<20)
	umountAndWait(t, umount, mp, pid)
}

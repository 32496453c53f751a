// Package tests holds the end-to-end tests of engramfs: real FUSE mounts
// served by the engramfs binary in its own process, read by the test process
// (and by Python) through read(2) and mmap, checked against the shard bytes.
//
// This file is the harness the tests share. Mount tests need root and
// /dev/fuse; where FUSE is unavailable they skip, unless
// ENGRAMFS_REQUIRE_FUSE=1 (as in CI), which turns the skip into a failure.
package tests

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// RequireFUSEEnv names the variable that makes a missing FUSE a failure.
const RequireFUSEEnv = "ENGRAMFS_REQUIRE_FUSE"

// RequireFUSE skips t when this machine cannot mount FUSE directly (not root,
// or no /dev/fuse), or fails it when ENGRAMFS_REQUIRE_FUSE=1.
func RequireFUSE(t testing.TB) {
	t.Helper()
	why := ""
	if os.Geteuid() != 0 {
		why = "mount tests need root (engramfs mounts FUSE directly, without fusermount)"
	} else if f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0); err != nil {
		why = fmt.Sprintf("mount tests need /dev/fuse: %v", err)
	} else {
		f.Close()
	}
	if why == "" {
		return
	}
	if os.Getenv(RequireFUSEEnv) == "1" {
		t.Fatalf("%s, and %s=1 requires them", why, RequireFUSEEnv)
	}
	t.Skip(why)
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// Binary builds cmd/engramfs once per test run (with -race when the tests
// run with it, so the daemon is checked too) and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "engramfs-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "engramfs")
		args := []string{"build", "-o", binPath}
		if raceEnabled {
			args = append(args, "-race")
		}
		args = append(args, "github.com/engramfs/engramfs/cmd/engramfs")
		cmd := exec.Command(goTool(), args...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

func goTool() string {
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err == nil {
		return p
	}
	return "go"
}

// Synth writes a synthetic model into a temporary directory.
func Synth(t testing.TB, spec backing.SynthSpec) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Daemon is an `engramfs mount` process.
type Daemon struct {
	Cmd        *exec.Cmd
	ModelDir   string
	Mountpoint string
	log        *syncBuffer
	exited     chan struct{}
	exitErr    error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Mount starts `engramfs mount [args] modelDir MOUNTPOINT` on a fresh
// mountpoint and waits for the "mounted" line. The daemon is stopped (and the
// mount checked gone) when the test ends.
func Mount(t testing.TB, modelDir string, args ...string) *Daemon {
	t.Helper()
	RequireFUSE(t)
	mp := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	return MountAt(t, modelDir, mp, args...)
}

// MountAt is Mount on a given mountpoint.
func MountAt(t testing.TB, modelDir, mp string, args ...string) *Daemon {
	t.Helper()
	return mountAt(t, nil, modelDir, mp, args...)
}

// MountWrapped is Mount with the daemon started through wrapper, a command
// that ends by exec'ing the daemon's command line, which is appended to it
// (so the daemon keeps the wrapper's pid): e.g. capsh dropping a
// capability, or a shell setting a ulimit.
func MountWrapped(t testing.TB, wrapper []string, modelDir string, args ...string) *Daemon {
	t.Helper()
	RequireFUSE(t)
	mp := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	return mountAt(t, wrapper, modelDir, mp, args...)
}

func mountAt(t testing.TB, wrapper []string, modelDir, mp string, args ...string) *Daemon {
	t.Helper()
	d := &Daemon{ModelDir: modelDir, Mountpoint: mp, log: &syncBuffer{}, exited: make(chan struct{})}
	full := append([]string{Binary(t), "mount"}, args...)
	full = append(full, modelDir, mp)
	full = append(append([]string(nil), wrapper...), full...)
	d.Cmd = exec.Command(full[0], full[1:]...)
	d.Cmd.Stdout = d.log
	d.Cmd.Stderr = d.log
	if err := d.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.exitErr = d.Cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() { d.Stop(t) })
	deadline := time.After(60 * time.Second)
	for !strings.Contains(d.log.String(), "\tmounted\t") && !strings.Contains(d.log.String(), `"msg":"mounted"`) {
		select {
		case <-d.exited:
			t.Fatalf("engramfs mount exited before mounting: %v\n%s", d.exitErr, d.log.String())
		case <-deadline:
			t.Fatalf("engramfs mount did not mount within 60 s:\n%s", d.log.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return d
}

// Log is what the daemon printed so far.
func (d *Daemon) Log() string { return d.log.String() }

// Signal sends sig to the daemon.
func (d *Daemon) Signal(sig os.Signal) error { return d.Cmd.Process.Signal(sig) }

// Exited is closed when the daemon process has exited.
func (d *Daemon) Exited() <-chan struct{} { return d.exited }

// ExitErr is the daemon's exit status, once Exited is closed.
func (d *Daemon) ExitErr() error { <-d.exited; return d.exitErr }

// Stop sends SIGTERM, waits for the daemon to exit 0, and checks that the
// mount is gone. Calling it again is a no-op.
func (d *Daemon) Stop(t testing.TB) {
	t.Helper()
	select {
	case <-d.exited:
	default:
		_ = d.Cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-time.After(30 * time.Second):
			_ = d.Cmd.Process.Kill()
			<-d.exited
			_ = syscall.Unmount(d.Mountpoint, syscall.MNT_DETACH)
			t.Errorf("engramfs did not exit within 30 s of SIGTERM; killed it\n%s", d.Log())
			return
		}
		if d.exitErr != nil {
			t.Errorf("engramfs exited with %v after SIGTERM\n%s", d.exitErr, d.Log())
		}
	}
	if Mounted(d.Mountpoint) {
		_ = syscall.Unmount(d.Mountpoint, syscall.MNT_DETACH)
		t.Errorf("%s is still mounted after the daemon exited", d.Mountpoint)
	}
}

// Mounted reports whether mp is a mountpoint in this mount namespace.
func Mounted(mp string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && fields[4] == mp {
			return true
		}
	}
	return false
}

// Stats reads .engramfs/stats.
func (d *Daemon) Stats(t testing.TB) stats.Snapshot {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(d.Mountpoint, ".engramfs", "stats"))
	if err != nil {
		t.Fatalf("read stats: %v", err)
	}
	var s stats.Snapshot
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("stats are not JSON: %v\n%s", err, b)
	}
	return s
}

// ShardTable returns the bytes of a table tensor read straight from its
// shard: what every byte of the mount must equal.
func ShardTable(t testing.TB, modelDir, name string) []byte {
	t.Helper()
	m, err := backing.Load(modelDir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range m.Tables {
		if tb.Name != name {
			continue
		}
		f, err := os.Open(tb.Shard.Path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b := make([]byte, tb.DataLen)
		if _, err := io.ReadFull(io.NewSectionReader(f, tb.DataStart, tb.DataLen), b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	t.Fatalf("no table %q in %s", name, modelDir)
	return nil
}

// Model loads modelDir with the default pattern.
func Model(t testing.TB, modelDir string) *backing.Model {
	t.Helper()
	m, err := backing.Load(modelDir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// sink keeps Touch's loads from being optimised away.
var sink byte

// Touch reads one byte of a mapping: a page fault when the page is cold.
//
//go:noinline
func Touch(m []byte, off int) byte {
	sink += m[off]
	return m[off]
}

// CPU is the CPU time a process's live threads have used, from each
// thread's schedstat (nanoseconds, where /proc/PID/stat counts 10 ms ticks).
func CPU(t testing.TB, pid int) time.Duration {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	var ns int64
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, task.Name()))
		if err != nil {
			continue // the thread exited meanwhile
		}
		f := strings.Fields(string(b))
		if len(f) < 1 {
			continue
		}
		v, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			t.Fatalf("schedstat %q: %v", b, err)
		}
		ns += v
	}
	return time.Duration(ns)
}

// Package testenv holds what the tests of several packages share about
// their environment: whether this machine can mount FUSE, the engramfs
// binaries built for the run, and directories of the run's own. It is for
// tests only; nothing the daemon or the bench runs imports it.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
)

// RequireFUSEEnv names the variable that makes a missing FUSE a failure.
const RequireFUSEEnv = "ENGRAMFS_REQUIRE_FUSE"

// RequireFUSE skips t when this machine cannot mount FUSE directly (not
// root, or no /dev/fuse), or fails it when ENGRAMFS_REQUIRE_FUSE=1 (as in
// CI).
func RequireFUSE(t testing.TB) {
	t.Helper()
	err := daemonproc.CanMount()
	if err == nil {
		return
	}
	if os.Getenv(RequireFUSEEnv) == "1" {
		t.Fatalf("mount tests: %v, and %s=1 requires them", err, RequireFUSEEnv)
	}
	t.Skipf("mount tests: %v", err)
}

var (
	buildMu  sync.Mutex
	binDir   string              // GUARDED_BY(buildMu)
	built    = map[string]bool{} // GUARDED_BY(buildMu)
	buildErr = map[string]error{}
)

// binPrefix starts the name of a run's binary directory, followed by the
// pid of the test binary that made it.
const binPrefix = "engramfs-bin-"

// Run runs a package's tests and then removes the binaries built for them
// (27-52 MB a run, with -race): the TestMain of every package whose tests
// call Binary, Command or Refusing is
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Run(m)) }
func Run(m *testing.M) int {
	code := m.Run()
	RemoveBinaries()
	return code
}

// RemoveBinaries removes the binaries built for this run (a TestMain that
// does more than Run calls it after m.Run).
func RemoveBinaries() {
	buildMu.Lock()
	defer buildMu.Unlock()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
		binDir = ""
		clear(built)
		clear(buildErr)
	}
}

// sweepBinaries removes the binary directories of test runs that died
// before their TestMain could (killed, timed out): those whose pid is gone.
func sweepBinaries() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), binPrefix+"*-*"))
	for _, dir := range dirs {
		var pid int
		if _, err := fmt.Sscanf(strings.TrimPrefix(filepath.Base(dir), binPrefix), "%d-", &pid); err != nil || pid <= 0 {
			continue
		}
		if unix.Kill(pid, 0) == unix.ESRCH {
			_ = os.RemoveAll(dir)
		}
	}
}

// Binary builds cmd/engramfs once per test run and returns its path.
func Binary(t testing.TB) string { return Command(t, "engramfs") }

// Command builds cmd/NAME once per test run (with -race when the tests run
// with it, so the binary is checked too) and returns its path. Every
// command lands in the same directory, so engramfs finds engramfs-bench
// beside it.
func Command(t testing.TB, name string) string {
	t.Helper()
	return build(t, name, "github.com/engramfs/engramfs/cmd/"+name)
}

// Refusing is a daemonproc wrapper that runs the daemon with the system
// calls of spec refused by a seccomp filter, as a sandbox's profile would
// refuse them: "io_uring_enter" (EPERM), or a list with errnos,
// "io_uring_setup=ENOSYS,io_uring_enter" (see internal/testenv/seccompexec).
func Refusing(t testing.TB, spec string) []string {
	t.Helper()
	return []string{build(t, "seccompexec", "github.com/engramfs/engramfs/internal/testenv/seccompexec"), spec}
}

// build builds the main package pkg once per test run as binDir/name
// (removed by Run).
func build(t testing.TB, name, pkg string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if binDir == "" {
		sweepBinaries()
		dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", binPrefix, os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		binDir = dir
	}
	path := filepath.Join(binDir, name)
	if !built[name] {
		built[name] = true
		args := []string{"build", "-o", path}
		if RaceEnabled {
			args = append(args, "-race")
		}
		args = append(args, pkg)
		if out, err := exec.Command(GoTool(), args...).CombinedOutput(); err != nil {
			buildErr[name] = fmt.Errorf("go build %s: %v\n%s", name, err, out)
		}
	}
	if err := buildErr[name]; err != nil {
		t.Fatal(err)
	}
	return path
}

// GoTool is the go command of the toolchain running the tests.
func GoTool() string {
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err == nil {
		return p
	}
	return "go"
}

// PrivateTempDir is a temporary directory of t's own to make mountpoints
// in: what is mounted below it is this test's alone, so counting the mounts
// under it (procfs.MountsUnder) does not count another concurrent run's
// (which a search of the whole mount table for a name pattern would). Once
// t and its other cleanups are done, whatever is still mounted below it is
// detached and reported as an error, before the directory is removed.
func PrivateTempDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() {
		left, err := procfs.MountsUnder(dir)
		if err != nil {
			t.Errorf("mount table: %v", err)
		}
		for _, mp := range left {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
			t.Errorf("left mounted: %s (detached it)", mp)
		}
	})
	return dir
}

// MapFile maps the whole file at path read-only and shared, unmapped when t
// ends.
func MapFile(t testing.TB, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

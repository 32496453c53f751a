package ioengine

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/testenv"
	"github.com/engramfs/engramfs/internal/testenv/seccomp"
)

// childEnv names the test a child process of this test binary runs: tests
// that refuse system calls do it in a process of their own, since a
// seccomp filter cannot be taken off again.
const childEnv = "ENGRAMFS_IOENGINE_CHILD"

// inChild reports whether this process is t's child. If it is not, it runs
// t again in a child (through wrapper, when set) and fails t unless the
// child passes.
func inChild(t *testing.T, wrapper []string) bool {
	t.Helper()
	if os.Getenv(childEnv) == t.Name() {
		return true
	}
	args := append(append([]string(nil), wrapper...), os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name())
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil || !strings.Contains(out.String(), "--- PASS: "+t.Name()) {
			t.Fatalf("child %v: %v\n%s", args, err, out.String())
		}
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("child %v did not finish within 2 minutes (a hang):\n%s", args, out.String())
	}
	t.Logf("child:\n%s", out.String())
	return false
}

// Where io_uring_setup works but io_uring_enter is refused (a seccomp
// profile), auto picks pread and says why, and io_uring fails: a ring
// that cannot be entered never completes a read.
func TestAutoFallsBackWhenEnterRefused(t *testing.T) {
	if !inChild(t, testenv.Refusing(t, "io_uring_enter")) {
		return
	}
	e, reason, err := New("auto", 8)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.Name() != "pread" || !strings.Contains(reason, "io_uring_enter") || !strings.Contains(reason, unix.EPERM.Error()) {
		t.Fatalf("auto with io_uring_enter refused: %s, reason %q; want pread, and a reason naming io_uring_enter and EPERM", e.Name(), reason)
	}
	if _, _, err := New("io_uring", 8); err == nil || !strings.Contains(err.Error(), "io_uring_enter") {
		t.Fatalf("io_uring with io_uring_enter refused: %v; want an error naming io_uring_enter", err)
	}
	// The fallback reads.
	f := newTestFile(t, 1<<20)
	fd := open(t, f.path, false)
	reqs := []*Req{{Fd: fd, Off: 4096, Buf: make([]byte, 4096)}}
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	e.Submit(reqs...)
	wait(t, &wg)
	checkRead(t, f, reqs[0], res[0], 4096)
}

// io_uring_enter refused once the engine runs (every thread's filter
// changed under it): the reaper stops at the first refusal instead of
// retrying forever. The read still in flight fails with the reason, a read
// submitted then fails at once, and Close returns.
func TestUringEnterRefusedWhileRunning(t *testing.T) {
	if !inChild(t, nil) {
		return
	}
	e := newEngine(t, "io_uring", 4).(*uringEngine)
	var pipes [2][2]int
	for i := range pipes {
		if err := unix.Pipe2(pipes[i][:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
	}
	reqs := []*Req{{Fd: pipes[0][0], Buf: make([]byte, 1)}, {Fd: pipes[1][0], Buf: make([]byte, 1)}}
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	e.Submit(reqs...)
	waitUntil(t, "both pipe reads in flight, the reaper asleep", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return !e.reaperAwake && !e.woken && e.inFlightLocked() == 2 && e.r.unsubmitted() == 0
	})
	prog, err := seccomp.Filter("io_uring_enter")
	if err != nil {
		t.Fatal(err)
	}
	if err := seccomp.RefuseAll(prog); err != nil {
		t.Fatal(err)
	}
	// The reaper sleeps in an io_uring_enter begun before the filter: the
	// first read's completion ends it, and its next enter is refused.
	if _, err := unix.Write(pipes[0][1], []byte{1}); err != nil {
		t.Fatal(err)
	}
	wait(t, &wg)
	if res[0].err != nil || res[0].n != 1 {
		t.Errorf("the read that completed before the refusal: %d bytes, %v", res[0].n, res[0].err)
	}
	if !errors.Is(res[1].err, unix.EPERM) || !strings.Contains(res[1].err.Error(), "io_uring_enter") {
		t.Errorf("the read in flight when io_uring_enter was refused: %v; want an error naming io_uring_enter and EPERM", res[1].err)
	}
	var late error
	e.Submit(&Req{Fd: pipes[1][0], Buf: make([]byte, 1), Done: func(_ int, err error) { late = err }})
	if !errors.Is(late, unix.EPERM) {
		t.Errorf("a read submitted after the refusal: %v; want the refusal at once", late)
	}
	closed := make(chan struct{})
	go func() { e.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatal("Close did not return within a minute of the refusal")
	}
}

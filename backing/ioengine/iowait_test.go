package ioengine

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/ioring"
)

// The io_uring engine's suite again, with the reaper idling in poll(2) as
// it does on kernels without IORING_ENTER_NO_IOWAIT (6.5-6.14).
func TestSuiteUringIdlePoll(t *testing.T) {
	withIdlePoll(t)
	testSuite(t, "io_uring")
}

// withIdlePoll makes the engines t starts idle in poll(2).
func withIdlePoll(t *testing.T) {
	forceIdlePoll = true
	t.Cleanup(func() { forceIdlePoll = false })
}

// An idle engine must not sleep as iowait. A reaper asleep in
// io_uring_enter beside its pending eventfd poll counted as a CPU in iowait
// for as long as the daemon ran, with no read anywhere: vmstat's "b" at 1
// and "wa" at a whole CPU, the node's I/O pressure near 100%. Whether a
// given thread sleeps as iowait is not readable here (no schedstats, and
// per-task delay accounting records nothing on these VMs), and the
// system's count of such sleepers (procs_blocked) moves with every other
// test's I/O, so this checks the two ways out of it: where the kernel takes
// IORING_ENTER_NO_IOWAIT, an idle wait passes it and a wait for reads does
// not; elsewhere, an idle reaper leaves no request in its ring.
func TestIdleEngineIsNotIOWait(t *testing.T) {
	// readOnce reads a page and waits for it: the reaper arms its eventfd
	// poll while the read is in flight and goes idle after it.
	readOnce := func(t *testing.T, e Engine) {
		f := newTestFile(t, 1<<16)
		fd := open(t, f.path, false)
		var wg sync.WaitGroup
		r := &Req{Fd: fd, Off: 4096, Buf: make([]byte, 4096)}
		res := track([]*Req{r}, &wg)
		e.Submit(r)
		wait(t, &wg)
		checkRead(t, f, r, res[0], 4096)
		time.Sleep(50 * time.Millisecond) // the reaper is asleep again
	}

	t.Run("NoIOWait", func(t *testing.T) {
		var mu sync.Mutex
		var waits [][2]uint32 // toSubmit, flags of each waiting enter
		enterHook = func(toSubmit, flags uint32) {
			if flags&ioringEnterGetEvents != 0 {
				mu.Lock()
				waits = append(waits, [2]uint32{toSubmit, flags})
				mu.Unlock()
			}
		}
		t.Cleanup(func() { enterHook = nil })
		e := newEngine(t, "io_uring", 8)
		defer e.Close()
		if e.(*uringEngine).r.NoIOWait() == 0 {
			t.Skip("this kernel has no IORING_ENTER_NO_IOWAIT (before 6.15): the IdlePoll case is its way")
		}
		readOnce(t, e)
		mu.Lock()
		defer mu.Unlock()
		// The engine's first wait holds only its poll, the next one the
		// read: one wait, at least, must count as iowait.
		var readWait, last bool
		for _, w := range waits {
			last = w[1]&ioring.EnterNoIOWait != 0
			readWait = readWait || !last
		}
		if !readWait {
			t.Errorf("every wait passed IORING_ENTER_NO_IOWAIT, the one for the read too (a wait for a read is iowait): %v", waits)
		}
		if !last {
			t.Errorf("the idle reaper's wait (flags %#x) lacks IORING_ENTER_NO_IOWAIT: it sleeps as iowait", waits[len(waits)-1][1])
		}
	})

	t.Run("IdlePoll", func(t *testing.T) {
		withIdlePoll(t)
		e := newEngine(t, "io_uring", 8)
		defer e.Close()
		for round := range 3 {
			readOnce(t, e)
			if pending := ringPolls(t, e.(*uringEngine).r.FD); pending != "" {
				t.Fatalf("round %d: the idle reaper left requests in its ring (it sleeps in io_uring_enter as iowait): %s", round, pending)
			}
		}
	})
}

// ringPolls returns the poll requests pending in ring fd, as its fdinfo
// lists them under PollList ("" when none).
func ringPolls(t *testing.T, fd int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		t.Fatal(err)
	}
	_, list, ok := strings.Cut(string(b), "PollList:\n")
	if !ok {
		t.Skipf("this kernel's io_uring fdinfo lists no pending polls:\n%s", b)
	}
	var pending []string
	for _, l := range strings.Split(list, "\n") {
		if !strings.HasPrefix(l, " ") && !strings.HasPrefix(l, "\t") {
			break // the next section
		}
		pending = append(pending, strings.TrimSpace(l))
	}
	return strings.Join(pending, "; ")
}

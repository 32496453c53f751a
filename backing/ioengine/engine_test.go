package ioengine

import (
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParseKind(t *testing.T) {
	for _, k := range Kinds {
		if got, err := ParseKind(" " + strings.ToUpper(k) + " "); err != nil || got != k {
			t.Errorf("ParseKind(%q) = %q, %v", k, got, err)
		}
	}
	for _, bad := range []string{"", "uring", "aio"} {
		_, err := ParseKind(bad)
		if err == nil || !strings.Contains(err.Error(), "auto, io_uring, pread") {
			t.Errorf("ParseKind(%q): err = %v, want one naming the kinds", bad, err)
		}
		if _, _, err := New(bad, 4); err == nil {
			t.Errorf("New(%q) accepted", bad)
		}
	}
	if _, _, err := New("pread", 0); err == nil {
		t.Error("New with depth 0 accepted")
	}
}

// TestAuto: where io_uring_setup works, auto must pick it and give no
// fallback reason; where it does not, pread with the reason.
func TestAuto(t *testing.T) {
	e, reason, err := New("auto", 8)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	u, uerr := newUring(8)
	if uerr == nil {
		u.Close()
		if e.Name() != "io_uring" || reason != "" {
			t.Fatalf("auto: %s, reason %q; io_uring works here", e.Name(), reason)
		}
		return
	}
	if e.Name() != "pread" || reason == "" {
		t.Fatalf("auto: %s, reason %q; io_uring fails here with %v", e.Name(), reason, uerr)
	}
}

func TestSetupErrorSaysWhy(t *testing.T) {
	for errno, want := range map[syscall.Errno]string{
		syscall.ENOSYS: "seccomp",
		syscall.EPERM:  "io_uring_disabled",
	} {
		if err := setupError(errno); !strings.Contains(err.Error(), want) {
			t.Errorf("setupError(%v) = %v, want it to mention %q", errno, err, want)
		}
	}
}

// TestUringBatches is the reason the engine exists: many reads per
// io_uring_enter and per reaper wake-up, not one each.
func TestUringBatches(t *testing.T) {
	f := newTestFile(t, 8<<20)
	fd := open(t, f.path, false)
	e := newEngine(t, "io_uring", 64)
	defer e.Close()
	const n = 4000
	reqs := make([]*Req, n)
	for i := range reqs {
		reqs[i] = &Req{Fd: fd, Off: int64(i%2048) * 4096, Buf: make([]byte, 4096)}
	}
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	for i := 0; i < n; i += 500 {
		e.Submit(reqs[i : i+500]...)
	}
	wait(t, &wg)
	for i, r := range reqs {
		checkRead(t, f, r, res[i], 4096)
	}
	s := e.(*uringEngine).Stats()
	t.Logf("%+v: %.3f enters/read, %.3f wake-ups/read", s, float64(s.Enters)/n, float64(s.Wakeups)/n)
	if s.Reads != n || s.Ops != n {
		t.Errorf("stats %+v: want %d reads and ops", s, n)
	}
	if s.Enters > n/4 || s.Wakeups > n/4 {
		t.Errorf("stats %+v: want under one enter and one wake-up per 4 reads", s)
	}
}

// TestUringSubmitsOnlyFromTheReaper: every io_uring_enter that submits runs
// on one thread, the reaper's. A read's completion is task work on the
// thread that submitted it, and a thread that then blocks uninterruptibly
// (on a page of our own mount whose FUSE READ waits for that read) never
// runs it: that hung the daemon. Reads are submitted here from many
// goroutines, pinned to their own threads, and from Done callbacks.
func TestUringSubmitsOnlyFromTheReaper(t *testing.T) {
	var mu sync.Mutex
	tids := map[int]int{}
	enterHook = func(toSubmit, _ uint32) {
		if toSubmit > 0 {
			mu.Lock()
			tids[unix.Gettid()]++
			mu.Unlock()
		}
	}
	t.Cleanup(func() { enterHook = nil })
	f := newTestFile(t, 8<<20)
	fd := open(t, f.path, false)
	e := newEngine(t, "io_uring", 16)
	const perG, goroutines = 200, 8
	var wg sync.WaitGroup
	var submitters sync.WaitGroup
	for g := range goroutines {
		submitters.Add(1)
		go func() {
			defer submitters.Done()
			runtime.LockOSThread() // a thread of its own: its enters would show
			defer runtime.UnlockOSThread()
			for i := range perG {
				wg.Add(1)
				again := i%4 == 0
				var r *Req
				r = &Req{Fd: fd, Off: int64((g*perG+i)%2048) * 4096, Buf: make([]byte, 4096), Done: func(int, error) {
					if again { // a Done that submits, as the loader's retries do
						again = false
						e.Submit(r)
						return
					}
					wg.Done()
				}}
				e.Submit(r)
				if i%16 == 0 {
					time.Sleep(100 * time.Microsecond) // let the reaper fall asleep
				}
			}
		}()
	}
	submitters.Wait()
	wait(t, &wg)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(tids) != 1 {
		t.Fatalf("io_uring_enter with SQEs on %d threads (%v), want the reaper's only", len(tids), tids)
	}
}

// TestUringRefillsBeforeCallbacks: when reads complete and more are
// waiting, the freed slots are filled before the completions' Done
// callbacks run. A virtio disk often answers a whole queue with one
// interrupt, and the callbacks of a burst take long enough that the disk
// would sit idle behind them. The first Done sees reads of the second half
// written to the ring already; with the refill after the callbacks, it
// would see only the first half's.
func TestUringRefillsBeforeCallbacks(t *testing.T) {
	f := newTestFile(t, 8<<20)
	fd := open(t, f.path, false)
	const depth = 4
	e := newEngine(t, "io_uring", depth)
	defer e.Close()
	u := e.(*uringEngine)
	var first sync.Once
	var opsAtFirstDone uint64
	var wg sync.WaitGroup
	reqs := make([]*Req, 2*depth)
	for i := range reqs {
		wg.Add(1)
		reqs[i] = &Req{Fd: fd, Off: int64(i) * 4096, Buf: make([]byte, 4096), Done: func(int, error) {
			first.Do(func() { opsAtFirstDone = u.ops.Load() })
			wg.Done()
		}}
	}
	e.Submit(reqs...)
	wait(t, &wg)
	if opsAtFirstDone <= depth {
		t.Errorf("when the first Done ran, %d reads had been written to the ring, want more than the %d of the first fill: the freed slots were not refilled before the callbacks", opsAtFirstDone, depth)
	}
}

// TestUringSubmitRacingClose: a Submit that found the reaper asleep writes
// the eventfd after it let go of the engine's lock. A Close meanwhile
// (the reaper woken by a completion, so it does not need that write) must
// not close the eventfd under it: its number would name the next file
// opened, and the late write would put 8 bytes into that file. The
// interleaving is forced with wakeHook, and the descriptor is reused on
// purpose.
func TestUringSubmitRacingClose(t *testing.T) {
	e := newEngine(t, "io_uring", 2).(*uringEngine)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	// A read in flight that completes when the test says so: its
	// completion is what wakes the reaper after Close.
	var inFlight sync.WaitGroup
	inFlight.Add(1)
	e.Submit(&Req{Fd: p[0], Buf: make([]byte, 1), Done: func(int, error) { inFlight.Done() }})
	waitUntil(t, "the reaper asleep with the pipe read in flight", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return !e.reaperAwake && !e.woken && e.inFlightLocked() == 1
	})

	reached, release := make(chan struct{}), make(chan struct{})
	wakeHook = func() { close(reached); <-release }
	t.Cleanup(func() { wakeHook = nil })
	submitted := make(chan struct{})
	go func() {
		defer close(submitted)
		e.Submit(&Req{Fd: p[0], Buf: make([]byte, 1), Done: func(int, error) {}})
	}()
	<-reached // decided to wake the reaper, not written yet
	wakeHook = nil
	closed := make(chan struct{})
	go func() { e.Close(); close(closed) }()
	waitUntil(t, "Close to fail the queue", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.closed
	})
	if _, err := unix.Write(p[1], []byte{1}); err != nil {
		t.Fatal(err)
	}
	wait(t, &inFlight)
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatal("Close did not return within a minute of the last read's completion")
	}
	// Open eventfds until one gets the engine's eventfd's number, or a
	// higher one (then that number is still taken).
	efd := e.efd
	var reused int = -1
	var opened []int
	for range 1024 {
		fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		opened = append(opened, fd)
		if fd == efd {
			reused = fd
		}
		if fd >= efd {
			break
		}
	}
	close(release)
	<-submitted
	if reused >= 0 {
		var buf [8]byte
		if n, err := unix.Read(reused, buf[:]); err == nil {
			t.Errorf("Submit wrote %d bytes (%v) to descriptor %d after Close had closed the eventfd and the number named another file", n, buf, reused)
		}
	}
	for _, fd := range opened {
		unix.Close(fd)
	}
	if reused < 0 {
		if _, err := unix.FcntlInt(uintptr(efd), unix.F_GETFD, 0); err != unix.EBADF {
			t.Errorf("the eventfd is still open (%v) once the last Submit wrote it: leaked", err)
		}
	}
}

// waitUntil polls cond every millisecond for at most a minute (never a
// timing assertion: the machine is shared).
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited a minute for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

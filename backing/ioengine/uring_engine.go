package ioengine

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// wakeUserData marks the completion of the eventfd poll that wakes the
// reaper; slot indexes never reach it.
const wakeUserData = ^uint64(0)

// slot is one read in flight; user_data is its index. Holding req here keeps
// Buf reachable while the kernel writes into it.
type slot struct {
	req  *Req
	done int // bytes already read (short reads continue after them)
}

// finished is a completion whose Done is still to be called, outside mu.
type finished struct {
	req *Req
	n   int
	err error
}

// uringEngine submits every read from one thread, the reaper's. A read's
// completion is posted by task work that the kernel queues on the thread
// that submitted the read; a thread in an uninterruptible sleep runs no task
// work. An earlier version let any thread submit, and beside a benchmark the
// daemon hung: a thread had submitted a read, then (running another
// goroutine) blocked reading a page of our own mount, whose FUSE READ
// waited for that very read (folio_wait_bit_common in the pin worker's
// pread, the FUSE handler in Loader.Load, the reaper asleep with nothing to
// reap, 10 minutes). The reaper's thread is locked to it and only ever
// sleeps in io_uring_enter, which task work does wake. Other threads queue
// requests and, when the reaper sleeps, wake it through an eventfd that it
// polls in the ring.
type uringEngine struct {
	r   *ring
	efd int // eventfd: a write wakes the reaper (its poll completes)

	mu    sync.Mutex
	queue waiting  // GUARDED_BY(mu): reqs waiting for a slot
	slots []slot   // GUARDED_BY(mu)
	free  []uint32 // GUARDED_BY(mu): unused slot indexes
	// reaperAwake is true while the reaper is between a wake-up and its next
	// io_uring_enter: it fills the ring from the queue before it sleeps, so
	// a Submit then only queues (a Done that calls Submit costs no system
	// call). woken: an eventfd write is on its way to a sleeping reaper.
	reaperAwake bool // GUARDED_BY(mu)
	woken       bool // GUARDED_BY(mu)
	closed      bool // GUARDED_BY(mu)
	// wakers counts the callers that decided, under mu, to write the
	// eventfd and have not written it yet; the eventfd is closed only once
	// the reaper is gone (reaperGone) and no writer is left. Closed earlier,
	// its number could name another file by the time a late writer wrote,
	// and 8 bytes would land in that file.
	wakers     int  // GUARDED_BY(mu)
	reaperGone bool // GUARDED_BY(mu)
	// idlePoll: the reaper idles in poll(2), not in io_uring_enter (see
	// sleepIdleLocked): the kernel lacks ioring.EnterNoIOWait.
	idlePoll bool
	// failed is set when io_uring_enter fails for good: every read then
	// fails with it, and the reaper is gone.
	failed error // GUARDED_BY(mu)

	reaperDone chan struct{}

	reads, ops, enters, wakeups atomic.Uint64
}

var _ Engine = (*uringEngine)(nil)

func newUring(queueDepth int) (*uringEngine, error) {
	depth := min(queueDepth, ioringMaxEntries-1)
	// One SQE more than the depth, for the eventfd poll (one at a time: it
	// is re-armed only after it completed): with at most depth reads in
	// flight (each holds at most one SQE) the SQ ring can never be full, and
	// the CQ ring (twice the SQ ring) never overflows.
	r, err := newRing(uint32(depth + 1))
	if err != nil {
		return nil, err
	}
	if err := r.probe(); err != nil {
		r.close()
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		r.close()
		return nil, err
	}
	depth = min(depth, int(r.SQEntries)-1)
	e := &uringEngine{
		r:          r,
		efd:        efd,
		slots:      make([]slot, depth),
		free:       make([]uint32, depth),
		reaperDone: make(chan struct{}),
		idlePoll:   r.NoIOWait() == 0 || forceIdlePoll,
	}
	for i := range e.free {
		e.free[i] = uint32(depth - 1 - i)
	}
	go e.reaper()
	return e, nil
}

// forceIdlePoll, set only by tests (before an engine starts), makes the
// reaper idle in poll(2) where the kernel has ioring.EnterNoIOWait too.
var forceIdlePoll bool

func (e *uringEngine) Name() string { return "io_uring" }

func (e *uringEngine) Stats() Stats {
	return Stats{Reads: e.reads.Load(), Ops: e.ops.Load(), Enters: e.enters.Load(), Wakeups: e.wakeups.Load()}
}

func (e *uringEngine) Submit(reqs ...*Req) {
	checkReqs(reqs)
	e.mu.Lock()
	if e.closed || e.failed != nil {
		err := e.failed
		e.mu.Unlock()
		if err == nil {
			err = ErrClosed
		}
		failAll(reqs, err)
		return
	}
	e.queue.push(reqs...)
	wake := e.wakeLocked()
	e.mu.Unlock()
	if wake {
		if wakeHook != nil {
			wakeHook()
		}
		e.wake()
	}
}

// wakeHook, if set (by tests), runs in Submit after it decided to wake the
// reaper and before it writes the eventfd.
var wakeHook func()

// wakeLocked reports whether the caller must wake the reaper: it sleeps and
// no wake-up is on its way.
// A caller told true must call wake once it has let go of mu.
func (e *uringEngine) wakeLocked() bool {
	if e.reaperAwake || e.woken {
		return false
	}
	e.woken = true
	e.wakers++
	return true
}

// wake writes the eventfd the reaper polls, then closes it if the engine
// was closed meanwhile and this was the last writer.
func (e *uringEngine) wake() {
	e.signal()
	e.mu.Lock()
	e.wakers--
	last := e.wakers == 0 && e.reaperGone
	e.mu.Unlock()
	if last {
		_ = unix.Close(e.efd)
	}
}

// signal writes the eventfd the reaper polls.
func (e *uringEngine) signal() {
	one := [8]byte{1}
	for {
		_, err := unix.Write(e.efd, one[:])
		if err != unix.EINTR {
			// EAGAIN: the counter is full, so the poll has fired already.
			return
		}
	}
}

// fillLocked moves queued reqs into free slots and writes their SQEs.
func (e *uringEngine) fillLocked() {
	for e.queue.len() > 0 && len(e.free) > 0 {
		idx := e.free[len(e.free)-1]
		e.free = e.free[:len(e.free)-1]
		e.slots[idx] = slot{req: e.queue.pop()}
		e.pushLocked(idx)
	}
}

// pushLocked writes the SQE for what slot idx still has to read.
func (e *uringEngine) pushLocked(idx uint32) {
	s := &e.slots[idx]
	buf := s.req.Buf[s.done:]
	if len(buf) > maxOpLen {
		buf = buf[:maxOpLen]
	}
	e.r.pushRead(s.req.Fd, s.req.Off+int64(s.done), buf, uint64(idx))
	e.ops.Add(1)
}

func (e *uringEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		<-e.reaperDone
		return nil
	}
	e.closed = true
	queued := e.queue.drain()
	wake := e.wakeLocked()
	e.mu.Unlock()
	failAll(queued, ErrClosed)
	if wake {
		e.wake()
	}
	// The reaper returns once the reads in flight are answered.
	<-e.reaperDone
	e.r.close()
	e.mu.Lock()
	e.reaperGone = true
	last := e.wakers == 0
	e.mu.Unlock()
	if last {
		_ = unix.Close(e.efd)
	} // else the last Submit still to write it closes it
	return nil
}

// fail stops the engine for good after io_uring_enter failed with err:
// every read queued or in flight fails with it, and so does every later
// Submit. A read in flight may still be in the kernel's hands, which may
// yet write into its buffer: its request is kept (stranded) so that the
// buffer is never freed and reused under such a write.
func (e *uringEngine) fail(err error) {
	err = fmt.Errorf("ioengine: the io_uring engine stopped: %w", err)
	e.mu.Lock()
	e.failed = err
	reqs := e.queue.drain()
	var inFlight []*Req
	for i := range e.slots {
		if r := e.slots[i].req; r != nil {
			inFlight = append(inFlight, r)
		}
	}
	e.mu.Unlock()
	strand(inFlight)
	failAll(append(inFlight, reqs...), err)
}

// stranded holds the requests of failed engines that the kernel may still
// write into, for the life of the process: at most a queue depth each, and
// an engine fails once.
var stranded struct {
	sync.Mutex
	reqs [][]*Req
}

func strand(reqs []*Req) {
	stranded.Lock()
	stranded.reqs = append(stranded.reqs, reqs)
	stranded.Unlock()
}

// sleepIdleLocked sleeps in poll(2) on the eventfd until a Submit or Close
// writes it; mu is held on entry and released on return. It is the idle
// wait on kernels without ioring.EnterNoIOWait (6.5-6.14): there a reaper
// asleep in io_uring_enter beside its pending eventfd poll counts as a CPU
// in iowait for as long as the daemon idles. No read is in flight and no
// poll is armed, so no task work can be waiting for this thread.
func (e *uringEngine) sleepIdleLocked() {
	e.reaperAwake = false
	e.mu.Unlock()
	fds := []unix.PollFd{{Fd: int32(e.efd), Events: unix.POLLIN}}
	for {
		if _, err := unix.Poll(fds, -1); err != unix.EINTR {
			break
		}
	}
	e.mu.Lock()
	var buf [8]byte
	_, _ = unix.Read(e.efd, buf[:])
	e.woken, e.reaperAwake = false, true
	e.mu.Unlock()
}

// inFlightLocked is how many slots hold a read.
func (e *uringEngine) inFlightLocked() int { return len(e.slots) - len(e.free) }

func (e *uringEngine) reaper() {
	defer close(e.reaperDone)
	// Every submission, and so the completion work of every read, happens
	// on this thread (see uringEngine), which does nothing else.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	var cqes []cqe
	var done []finished
	armed := false // the eventfd poll is in the ring
	for {
		e.mu.Lock()
		if e.closed && e.inFlightLocked() == 0 {
			e.mu.Unlock()
			return
		}
		e.fillLocked()
		// Idle: no read in flight, only the eventfd poll would be. Such a
		// wait is not iowait (ioring.NoIOWait); a wait with reads in
		// flight is.
		flags := uint32(ioringEnterGetEvents)
		if idle := e.inFlightLocked() == 0; idle && e.idlePoll {
			if !armed {
				e.sleepIdleLocked() // unlocks
				continue
			}
			// The poll armed while reads were in flight is pending:
			// complete it (an eventfd write of our own) and reap it below,
			// so that the ring holds nothing when we sleep.
			e.signal()
		} else if idle {
			flags |= e.r.NoIOWait()
		}
		if !armed {
			e.r.pushPollIn(e.efd, wakeUserData)
			armed = true
		}
		n := e.r.unsubmitted()
		e.reaperAwake = false
		e.mu.Unlock()

		_, err := e.r.enter(n, 1, flags)
		e.enters.Add(1)
		switch err {
		case nil, unix.EINTR:
		case unix.EAGAIN, unix.EBUSY:
			// Kernel out of request memory, or CQ overflow (impossible with
			// the ring sizes above): back off a little and retry; the SQEs
			// stay in the ring for the next enter.
			time.Sleep(50 * time.Microsecond)
		default:
			// EPERM from a seccomp filter, EBADF, EFAULT, EINVAL: nothing
			// a retry changes. Retried every millisecond (as this loop once
			// did), no read ever completed, a barrier never returned and
			// Close waited forever.
			e.fail(enterError(err))
			return
		}
		// Whatever completed is in the CQ ring whatever enter returned.

		cqes = e.r.reap(cqes[:0])
		if len(cqes) == 0 {
			continue
		}
		e.wakeups.Add(1)

		e.mu.Lock()
		e.reaperAwake = true
		for _, c := range cqes {
			if c.UserData == wakeUserData {
				// Drain the counter, then re-arm the poll at the top of
				// the loop; Submits from now on see the reaper awake.
				var buf [8]byte
				_, _ = unix.Read(e.efd, buf[:])
				armed, e.woken = false, false
				continue
			}
			idx := uint32(c.UserData)
			s := &e.slots[idx]
			switch {
			case c.Res == -int32(unix.EINTR) || c.Res == -int32(unix.EAGAIN):
				e.pushLocked(idx)
				continue
			case c.Res < 0:
				done = append(done, finished{s.req, s.done, readError(s.req, s.done, syscall.Errno(-c.Res))})
			case c.Res == 0 && s.done < len(s.req.Buf):
				done = append(done, finished{s.req, s.done, nil}) // EOF
			default:
				s.done += int(c.Res)
				if s.done < len(s.req.Buf) {
					e.pushLocked(idx) // short read: continue after it
					continue
				}
				done = append(done, finished{s.req, s.done, nil})
			}
			*s = slot{}
			e.free = append(e.free, idx)
		}
		// Refill the freed slots before the callbacks run: completions
		// come in bursts (a virtio disk often answers a whole queue with
		// one interrupt), and the callbacks of a burst of 64 take a few
		// hundred µs, during which the device would otherwise sit idle
		// although reads are waiting.
		refill := uint32(0)
		if e.queue.len() > 0 && len(e.free) > 0 {
			e.fillLocked()
			refill = e.r.unsubmitted()
		}
		e.mu.Unlock()
		if refill > 0 {
			if _, err := e.r.enter(refill, 0, 0); err == nil {
				e.enters.Add(1)
			}
			// On an error the SQEs stay in the ring: the next enter
			// submits them.
		}

		// Done runs without mu: it may call Submit.
		epoch := Observe()
		for i := range done {
			e.reads.Add(1)
			done[i].req.Epoch = epoch
			done[i].req.Done(done[i].n, done[i].err)
			done[i] = finished{}
		}
		done = done[:0]
	}
}

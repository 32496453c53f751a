package ioengine

import (
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// wakeUserData marks the NOP that Close submits to wake the reaper; slot
// indexes never reach it.
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

type uringEngine struct {
	r *ring

	mu    sync.Mutex
	queue fifo     // GUARDED_BY(mu): reqs waiting for a slot
	slots []slot   // GUARDED_BY(mu)
	free  []uint32 // GUARDED_BY(mu): unused slot indexes
	// reaperAwake is true while the reaper is between a wake-up and its next
	// io_uring_enter. Submitters then only write SQEs: the reaper submits
	// them in the enter it sleeps in, so a Done that calls Submit (and any
	// submitter racing with a wake-up) costs no system call of its own.
	reaperAwake bool           // GUARDED_BY(mu)
	closed      bool           // GUARDED_BY(mu)
	entering    sync.WaitGroup // submitters inside io_uring_enter; Close waits for them before closing the fd

	reaperDone chan struct{}

	reads, ops, enters, wakeups atomic.Uint64
}

var _ Engine = (*uringEngine)(nil)

func newUring(queueDepth int) (*uringEngine, error) {
	depth := min(queueDepth, ioringMaxEntries-1)
	// One SQE more than the depth for Close's NOP: with at most depth reads
	// in flight (each holds at most one SQE) the SQ ring can never be full,
	// and the CQ ring (twice the SQ ring) never overflows.
	r, err := newRing(uint32(depth + 1))
	if err != nil {
		return nil, err
	}
	depth = min(depth, int(r.sqEntries)-1)
	e := &uringEngine{
		r:          r,
		slots:      make([]slot, depth),
		free:       make([]uint32, depth),
		reaperDone: make(chan struct{}),
	}
	for i := range e.free {
		e.free[i] = uint32(depth - 1 - i)
	}
	go e.reaper()
	return e, nil
}

func (e *uringEngine) Name() string { return "io_uring" }

func (e *uringEngine) Stats() Stats {
	return Stats{Reads: e.reads.Load(), Ops: e.ops.Load(), Enters: e.enters.Load(), Wakeups: e.wakeups.Load()}
}

func (e *uringEngine) Submit(reqs ...*Req) {
	checkReqs(reqs)
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		failAll(reqs, ErrClosed)
		return
	}
	e.queue.push(reqs...)
	e.fillLocked()
	n := e.r.unsubmitted()
	if n == 0 || e.reaperAwake {
		e.mu.Unlock()
		return
	}
	e.entering.Add(1)
	e.mu.Unlock()
	e.submit(n)
	e.entering.Done()
}

// submit pushes written SQEs to the kernel without waiting. The kernel may
// take fewer than n if the reaper's enter took some first; that is fine.
func (e *uringEngine) submit(n uint32) {
	for {
		_, err := e.r.enter(n, 0, 0)
		e.enters.Add(1)
		switch err {
		case nil:
			return
		case unix.EINTR:
			continue
		case unix.EAGAIN, unix.EBUSY:
			// Out of kernel request memory or CQ overflow: the SQEs stay in
			// the ring. Retry; the reaper also submits what is left.
			time.Sleep(50 * time.Microsecond)
			continue
		default:
			// Only a closed or invalid ring fd gets here, which Close rules
			// out; the SQEs remain for the reaper.
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
	// The NOP completes at once and wakes a reaper that may be sleeping with
	// nothing in flight.
	e.r.pushNop(wakeUserData)
	n := e.r.unsubmitted()
	e.entering.Add(1)
	e.mu.Unlock()
	failAll(queued, ErrClosed)
	e.submit(n)
	e.entering.Done()
	<-e.reaperDone
	e.entering.Wait()
	e.r.close()
	return nil
}

// inFlightLocked is how many slots hold a read.
func (e *uringEngine) inFlightLocked() int { return len(e.slots) - len(e.free) }

func (e *uringEngine) reaper() {
	defer close(e.reaperDone)
	// Completion work for a read runs on the thread that submitted it. The
	// reaper submits most reads (refills and resubmissions from Done), so
	// keeping it on one thread makes that thread the one already waiting in
	// io_uring_enter: one wake-up per batch instead of waking the submitting
	// thread, which then wakes the reaper.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	var cqes []cqe
	var done []finished
	nopSeen := false
	for {
		e.mu.Lock()
		if e.closed && nopSeen && e.inFlightLocked() == 0 {
			e.mu.Unlock()
			return
		}
		n := e.r.unsubmitted()
		e.reaperAwake = false
		e.mu.Unlock()

		_, err := e.r.enter(n, 1, ioringEnterGetEvents)
		e.enters.Add(1)
		switch err {
		case nil, unix.EINTR:
		case unix.EAGAIN, unix.EBUSY:
			// Kernel out of request memory, or CQ overflow (impossible with
			// the ring sizes above): back off a little and retry.
			time.Sleep(50 * time.Microsecond)
		default:
			// Not expected from a live ring; do not spin on it.
			time.Sleep(time.Millisecond)
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
			if c.userData == wakeUserData {
				nopSeen = true
				continue
			}
			idx := uint32(c.userData)
			s := &e.slots[idx]
			switch {
			case c.res == -int32(unix.EINTR) || c.res == -int32(unix.EAGAIN):
				e.pushLocked(idx)
				continue
			case c.res < 0:
				done = append(done, finished{s.req, s.done, readError(s.req, s.done, syscall.Errno(-c.res))})
			case c.res == 0 && s.done < len(s.req.Buf):
				done = append(done, finished{s.req, s.done, nil}) // EOF
			default:
				s.done += int(c.res)
				if s.done < len(s.req.Buf) {
					e.pushLocked(idx) // short read: continue after it
					continue
				}
				done = append(done, finished{s.req, s.done, nil})
			}
			*s = slot{}
			e.free = append(e.free, idx)
		}
		e.fillLocked()
		e.mu.Unlock()

		// Done runs without mu: it may call Submit.
		for i := range done {
			e.reads.Add(1)
			done[i].req.Done(done[i].n, done[i].err)
			done[i] = finished{}
		}
		done = done[:0]
	}
}

package ioengine

import (
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// preadEngine is the fallback: queueDepth workers, each doing one blocking
// pread at a time. A blocked pread pins an OS thread, so the worker count
// is the bound on threads, not just on I/O in flight.
type preadEngine struct {
	mu     sync.Mutex
	wake   *sync.Cond
	queue  waiting // GUARDED_BY(mu)
	closed bool    // GUARDED_BY(mu)
	idle   int     // GUARDED_BY(mu): workers waiting on wake, so Submit signals no more than it needs
	wg     sync.WaitGroup

	reads, ops, wakeups atomic.Uint64
}

var _ Engine = (*preadEngine)(nil)

func newPread(queueDepth int) *preadEngine {
	e := &preadEngine{}
	e.wake = sync.NewCond(&e.mu)
	e.wg.Add(queueDepth)
	for range queueDepth {
		go e.worker()
	}
	return e
}

func (e *preadEngine) Name() string { return "pread" }

func (e *preadEngine) Stats() Stats {
	return Stats{Reads: e.reads.Load(), Ops: e.ops.Load(), Wakeups: e.wakeups.Load()}
}

func (e *preadEngine) Submit(reqs ...*Req) {
	checkReqs(reqs)
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		failAll(reqs, ErrClosed)
		return
	}
	e.queue.push(reqs...)
	for range min(len(reqs), e.idle) {
		e.wake.Signal()
	}
	e.mu.Unlock()
}

func (e *preadEngine) Close() error {
	e.mu.Lock()
	e.closed = true
	queued := e.queue.drain()
	e.wake.Broadcast()
	e.mu.Unlock()
	failAll(queued, ErrClosed)
	e.wg.Wait()
	return nil
}

func (e *preadEngine) worker() {
	defer e.wg.Done()
	e.mu.Lock()
	for {
		for e.queue.len() == 0 && !e.closed {
			e.idle++
			e.wake.Wait()
			e.idle--
			e.wakeups.Add(1)
		}
		if e.queue.len() == 0 {
			e.mu.Unlock()
			return
		}
		r := e.queue.pop()
		e.mu.Unlock()
		n, err := e.readFull(r)
		e.reads.Add(1)
		r.Epoch = Observe()
		r.Done(n, err)
		e.mu.Lock()
	}
}

// readFull reads until Buf is full, EOF or an error, as the io_uring engine
// does: a short read is continued, not returned.
func (e *preadEngine) readFull(r *Req) (int, error) {
	done := 0
	for done < len(r.Buf) {
		buf := r.Buf[done:]
		if len(buf) > maxOpLen {
			buf = buf[:maxOpLen]
		}
		n, err := unix.Pread(r.Fd, buf, r.Off+int64(done))
		e.ops.Add(1)
		switch {
		case err == unix.EINTR || err == unix.EAGAIN:
			continue
		case err != nil:
			return done, readError(r, done, err)
		case n == 0:
			return done, nil // EOF
		}
		done += n
	}
	return done, nil
}

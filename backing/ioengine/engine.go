package ioengine

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
)

// Req is one read: len(Buf) bytes at Off of Fd.
type Req struct {
	Fd  int
	Off int64
	Buf []byte // the caller aligns Buf, Off and len(Buf) for O_DIRECT fds
	// Done is called exactly once, from any goroutine (often the engine's
	// reaper): it must not block. n is the bytes read: n == len(Buf) on
	// success; n < len(Buf) with err == nil means EOF was reached. Done may
	// call Submit. On a closed engine Done runs inside Submit, before Submit
	// returns: do not hold a lock in Submit's caller that Done takes.
	Done func(n int, err error)
	// Demand: a reader waits for it (a fault, a decode hint). Queued demand
	// reads take free slots before queued reads that are not.
	Demand bool
	// Epoch is set by the engine before it calls Done: an Observe taken
	// once the read had completed (Epoch).
	Epoch uint64
}

// epochs counts the completions engines observed (one per reaped batch
// of the io_uring engine).
var epochs atomic.Uint64

// Observe is a new completion epoch: every read whose completion was seen
// before the call is of this epoch or an earlier one.
func Observe() uint64 { return epochs.Add(1) }

// Epoch is the latest epoch: every read of it or of an earlier one had
// completed when it was taken. A check that starts after Epoch returned
// comes after all of those reads (backing's shard identity check runs once
// for a whole batch of completions this way).
func Epoch() uint64 { return epochs.Load() }

// ErrClosed completes requests submitted to, or still queued in, a closed engine.
var ErrClosed = errors.New("ioengine: engine closed")

// Engine runs reads with a bounded number in flight.
type Engine interface {
	// Submit queues reqs. It never waits for I/O; reqs beyond the queue
	// depth wait inside the engine, demand reads first, each class in
	// order of submission.
	Submit(reqs ...*Req)
	// Name is "io_uring" or "pread".
	Name() string
	// Close completes queued reqs with ErrClosed, waits for those in flight,
	// and releases the ring/workers.
	Close() error
}

// Stats counts what a read cost in system calls and wake-ups: the numbers
// that set the CPU cost per read on these VMs. Both engines implement
// Stats() Stats; it is not part of Engine so that wrappers need not.
type Stats struct {
	Reads   uint64 // requests completed (any outcome)
	Ops     uint64 // reads issued to the kernel: preads or READ SQEs (short reads and retries add)
	Enters  uint64 // io_uring_enter calls (io_uring only)
	Wakeups uint64 // reaper wake-ups with at least one completion (io_uring), worker wake-ups (pread)
}

// Kinds are the values New accepts for kind.
var Kinds = []string{"auto", "io_uring", "pread"}

// ParseKind returns kind if New accepts it (case and spaces ignored), or an
// error naming the accepted values.
func ParseKind(kind string) (string, error) {
	k := strings.ToLower(strings.TrimSpace(kind))
	for _, ok := range Kinds {
		if k == ok {
			return k, nil
		}
	}
	return "", fmt.Errorf("ioengine: unknown engine %q (want one of %s)", kind, strings.Join(Kinds, ", "))
}

// New returns an engine with at most queueDepth reads in flight.
// kind: "auto" (io_uring where a ring sets up and a NOP goes through
// io_uring_enter, else pread), "io_uring" (error if unavailable), "pread". For "auto", the returned fallbackReason
// says why io_uring was not used ("" when it was).
func New(kind string, queueDepth int) (e Engine, fallbackReason string, err error) {
	k, err := ParseKind(kind)
	if err != nil {
		return nil, "", err
	}
	if queueDepth < 1 {
		return nil, "", fmt.Errorf("ioengine: queue depth %d: must be at least 1", queueDepth)
	}
	switch k {
	case "pread":
		return newPread(queueDepth), "", nil
	case "io_uring":
		u, err := newUring(queueDepth)
		if err != nil {
			return nil, "", err
		}
		return u, "", nil
	default:
		u, err := newUring(queueDepth)
		if err != nil {
			return newPread(queueDepth), err.Error(), nil
		}
		return u, "", nil
	}
}

// maxOpLen caps one read system call or SQE (len is 32 bits in an SQE; Linux
// reads at most 0x7ffff000 bytes at a time anyway); the short-read path
// continues a longer Buf. Tests lower it to drive that path with real reads.
var maxOpLen = 1 << 30

// waiting is the queue of requests waiting for a free slot: demand reads
// first (a prefill hint's thousands of queued reads must not hold up a fault
// or a decode step), each class first in, first out. Not safe for concurrent
// use; each engine guards it with its mutex.
type waiting struct{ demand, bulk fifo }

func (w *waiting) len() int { return w.demand.len() + w.bulk.len() }

func (w *waiting) push(reqs ...*Req) {
	for _, r := range reqs {
		if r.Demand {
			w.demand.push(r)
		} else {
			w.bulk.push(r)
		}
	}
}

func (w *waiting) pop() *Req {
	if w.demand.len() > 0 {
		return w.demand.pop()
	}
	return w.bulk.pop()
}

// drain removes and returns everything queued.
func (w *waiting) drain() []*Req { return append(w.demand.drain(), w.bulk.drain()...) }

// fifo is one class of waiting requests.
type fifo struct {
	q    []*Req
	head int
}

func (f *fifo) len() int { return len(f.q) - f.head }

func (f *fifo) push(reqs ...*Req) { f.q = append(f.q, reqs...) }

func (f *fifo) pop() *Req {
	r := f.q[f.head]
	f.q[f.head] = nil
	f.head++
	if f.head == len(f.q) {
		f.q, f.head = f.q[:0], 0
	} else if f.head > 1024 && f.head > len(f.q)/2 {
		// Reclaim the consumed front so a long-lived queue does not grow forever.
		n := copy(f.q, f.q[f.head:])
		clear(f.q[n:])
		f.q, f.head = f.q[:n], 0
	}
	return r
}

// drain removes and returns everything queued.
func (f *fifo) drain() []*Req {
	out := append([]*Req(nil), f.q[f.head:]...)
	clear(f.q)
	f.q, f.head = f.q[:0], 0
	return out
}

func checkReqs(reqs []*Req) {
	for _, r := range reqs {
		if r == nil || r.Done == nil {
			panic("ioengine: Submit of a nil Req or a Req without Done")
		}
	}
}

func failAll(reqs []*Req, err error) {
	for _, r := range reqs {
		r.Epoch = Observe()
		r.Done(0, err)
	}
}

// readError gives an I/O error the read it failed; errors.Is(err,
// syscall.EBADF) and the like still work.
func readError(r *Req, done int, err error) error {
	return fmt.Errorf("ioengine: read fd %d, %d bytes at %d: %w", r.Fd, len(r.Buf)-done, r.Off+int64(done), err)
}

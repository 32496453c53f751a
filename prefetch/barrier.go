package prefetch

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/engramfs/engramfs/cache"
)

// Barrier is one stream of hints (one control-file handle, or one warm-up
// batch): its submissions are numbered, and Wait returns once every
// submission accepted before the call has settled, with the counts since
// the previous Wait. Submissions accepted after Wait started do not hold it
// up, so a writer that keeps hinting on the same handle cannot starve a
// barrier.
//
// Its fields belong to the Prefetcher it was first submitted to and are
// guarded by that Prefetcher's mutex.
type Barrier struct {
	p atomic.Pointer[Prefetcher] // nil until the first submission

	seq      uint64        // submissions begun
	accepted uint64        // submissions whose admission finished: what a barrier covers
	open     []pending     // submissions with pages pending, oldest first
	status   Status        // since the previous Wait
	wake     chan struct{} // closed (and replaced) when open's head advances; nil: nobody waits

	decodeQ runFIFO // this handle's decode work
	inRing  bool    // decodeQ is in the core's round robin
	// room, when not nil, is closed (and cleared) once decodeQ holds fewer
	// than roomBelow pages, or the handle's work is dropped: a write
	// waiting in WaitDecodeRoom goes on.
	room      chan struct{}
	roomBelow int
	released  bool // Release dropped its queued work: nothing more waits

	// The prefill pages pushed for this handle since its last barrier: the
	// first of them, and how many. Once the first is evicted before the
	// barrier returns, the handle is throttled: the rest of its prefill
	// work drops instead of evicting what it pushed (push.go, throttle).
	pushedFirst cache.PageKey
	pushedSince uint64
	throttled   bool
}

// NewBarrier returns a barrier with nothing pending.
func NewBarrier() *Barrier { return &Barrier{} }

// ErrPagesFailed is what Wait returns when pages failed since the last Wait.
var ErrPagesFailed = errors.New("hinted pages failed")

// ErrStopped is why pages still queued fail when the prefetcher closes.
var ErrStopped = errors.New("the prefetcher stopped (the mount is going down)")

// Wait blocks until every submission accepted before it has settled and
// returns ErrPagesFailed (wrapped) if pages failed since the previous Wait.
// Dropped prefill pages are not failures: prefill is best effort.
func (b *Barrier) Wait(ctx context.Context) error {
	st, err := b.Status(ctx)
	if err != nil {
		return err
	}
	if st.Failed > 0 {
		return fmt.Errorf("%d of %d pages (%s): %w", st.Failed, st.Pages, st.Error, ErrPagesFailed)
	}
	return nil
}

// Status is Wait that returns the counts since the previous barrier (and
// starts new ones), or ctx's error if ctx ends first (the counts are kept
// for the next barrier then).
func (b *Barrier) Status(ctx context.Context) (Status, error) {
	p := b.p.Load()
	if p == nil {
		return Status{}, nil
	}
	p.mu.Lock()
	target := b.accepted
	for !b.settledThrough(target) {
		if b.wake == nil {
			b.wake = make(chan struct{})
		}
		wake := b.wake
		p.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return Status{}, ctx.Err()
		}
		p.mu.Lock()
	}
	st := b.status
	b.status = Status{}
	b.pushedSince, b.throttled = 0, false
	p.mu.Unlock()
	return st, nil
}

// Idle reports whether nothing is pending and nothing was counted since the
// previous barrier: a read barrier then has nothing to say.
func (b *Barrier) Idle() bool {
	p := b.p.Load()
	if p == nil {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(b.open) == 0 && b.status == Status{}
}

// DecodeBacklog is the number of pages of decode work this handle has
// queued and not yet handed to the loader.
func (b *Barrier) DecodeBacklog() int {
	p := b.p.Load()
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return b.decodeQ.pages
}

// WaitDecodeRoom blocks while this handle has limit or more pages of decode
// work queued and not yet handed to the loader, until the workers take
// enough of it, the prefetcher closes, or ctx ends (its error is returned
// then). It is how a decode frame larger than the backlog's bound is taken
// part by part: fs calls it before each write that continues such a frame,
// so a handle holds at most the bound plus one write's pages.
func (b *Barrier) WaitDecodeRoom(ctx context.Context, limit int) error {
	p := b.p.Load()
	if p == nil {
		return nil
	}
	p.mu.Lock()
	for b.decodeQ.pages >= limit && !p.closed && !b.released {
		if b.room == nil {
			b.room = make(chan struct{})
		}
		b.roomBelow = limit
		room := b.room
		p.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			return ctx.Err()
		}
		p.mu.Lock()
	}
	p.mu.Unlock()
	return nil
}

// noteRoom wakes a write waiting for room in the decode backlog once there
// is some (or the backlog was dropped).
//
// REQUIRES(p.mu)
func (b *Barrier) noteRoom() {
	if b.room != nil && (b.decodeQ.pages < b.roomBelow || b.released) {
		close(b.room)
		b.room = nil
	}
}

// Release drops the work only b still waits for: its handle is closed (the
// process that hinted may have been killed), so nobody will read these
// pages for it. Pages queued for b alone are dropped, counted in
// prefetch_pages_released (and dropped from the layer's hint accounting);
// pages other handles wait for too stay queued for them; pages in flight
// finish. Later submissions on b are not expected (fs stops using the
// handle), and b's status is not kept.
//
// It walks b's decode queue and the prefill queue (up to --prefetch-queue
// pages) from a copy, admitSlice pages per hold of p.mu: one walk under the
// lock cost ~170 ms for a full default queue (BenchmarkReleaseFullPrefillQueue,
// busy VM), in front of every fault and the fetch loop. A run is only "these
// pages were queued at generation id", so a copy that outlives its pages
// (claimed, settled, queued again) touches none of them (releasePage).
func (p *Prefetcher) Release(b *Barrier) {
	if b.p.Load() != p {
		return
	}
	p.mu.Lock()
	b.released = true
	b.noteRoom()
	runs := append(slices.Clone(b.decodeQ.runs[b.decodeQ.head:]), p.c.prefill.runs[p.c.prefill.head:]...)
	p.mu.Unlock()
	var released uint64
	for i := 0; i < len(runs); {
		p.mu.Lock()
		for budget := uint64(admitSlice); budget > 0 && i < len(runs); {
			r := &runs[i]
			k := min(r.n, budget)
			for pg := r.first; pg < r.first+k; pg++ {
				if p.c.releasePage(b, *r, pg) {
					released++
				}
			}
			r.first, r.n, budget = r.first+k, r.n-k, budget-k
			if r.n == 0 {
				i++
			}
		}
		p.mu.Unlock()
	}
	if released > 0 {
		p.st.PrefetchPagesReleased.Add(released)
	}
}

// releasePage takes b's link off page pg of run r if r still queues it,
// and drops the page when nobody else waits for it (reporting true).
//
// REQUIRES(p.mu)
func (c *core) releasePage(b *Barrier, r run, pg uint64) bool {
	s := c.pages.get(r.table, pg)
	if s == nil || s.gen > r.id || s.stage != stQueued || !s.dropLink(b) || s.first.b != nil {
		return false // not r's page any more, not b's, or others wait for it
	}
	c.forget(r.table, pg, s)
	if c.onDrop != nil {
		c.onDrop(r.table, pg, 1)
	}
	return true
}

// dropLink takes b off the handles waiting for the page; false if b was
// not one of them.
func (s *pageState) dropLink(b *Barrier) bool {
	if s.first.b == b {
		s.first = link{}
		if len(s.more) > 0 {
			s.first, s.more = s.more[0], s.more[1:]
		}
		return true
	}
	for i, l := range s.more {
		if l.b == b {
			s.more = append(s.more[:i], s.more[i+1:]...)
			return true
		}
	}
	return false
}

// pending is the count of pages one submission still waits for.
type pending struct{ seq, pages uint64 }

// settledThrough reports whether every submission up to seq has settled.
//
// REQUIRES(p.mu)
func (b *Barrier) settledThrough(seq uint64) bool { return len(b.open) == 0 || b.open[0].seq > seq }

// wait counts one more page pending for submission seq, the newest.
//
// REQUIRES(p.mu)
func (b *Barrier) wait(seq uint64) {
	if n := len(b.open); n > 0 && b.open[n-1].seq == seq {
		b.open[n-1].pages++
		return
	}
	b.open = append(b.open, pending{seq: seq, pages: 1})
}

// settle counts one page of submission seq as settled with o; why is the
// reason of a failure.
//
// REQUIRES(p.mu)
func (b *Barrier) settle(seq uint64, o Outcome, why error) {
	switch o {
	case Resident:
		b.status.Resident++
	case Failed:
		b.fail(1, why)
	case Dropped:
		b.status.Dropped++
	}
	i, _ := slices.BinarySearchFunc(b.open, seq, func(e pending, seq uint64) int { return compareU64(e.seq, seq) })
	b.open[i].pages--
	b.advance()
}

// fail counts n pages failed for why. The status names the first reason
// since the previous barrier: the pages of one bad read or store fail
// together with one cause, and a status line has room for one.
//
// REQUIRES(p.mu)
func (b *Barrier) fail(n uint64, why error) {
	b.status.Failed += n
	if b.status.Error == "" {
		if why == nil {
			why = errors.New("reason unknown")
		}
		b.status.Error = "pages failed: " + why.Error()
	}
}

// advance drops the settled submissions at the head and wakes the waiters
// when it moved. A submission whose pages settle out of order stays until
// those before it settle: a barrier waits for a prefix of the stream.
//
// REQUIRES(p.mu)
func (b *Barrier) advance() {
	i := 0
	for i < len(b.open) && b.open[i].pages == 0 {
		i++
	}
	if i == 0 {
		return
	}
	b.open = b.open[i:]
	if len(b.open) == 0 {
		b.open = nil // let a long stream's slice go
	}
	if b.wake != nil {
		close(b.wake)
		b.wake = nil
	}
}

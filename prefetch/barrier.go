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

// Wait blocks until every submission accepted before it has settled and
// returns ErrPagesFailed (wrapped) if pages failed since the previous Wait.
// Dropped prefill pages are not failures: prefill is best effort.
func (b *Barrier) Wait(ctx context.Context) error {
	st, err := b.Status(ctx)
	if err != nil {
		return err
	}
	if st.Failed > 0 {
		return fmt.Errorf("%d of %d pages: %w", st.Failed, st.Pages, ErrPagesFailed)
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

// settle counts one page of submission seq as settled with o.
//
// REQUIRES(p.mu)
func (b *Barrier) settle(seq uint64, o Outcome) {
	switch o {
	case Resident:
		b.status.Resident++
	case Failed:
		b.status.Failed++
	case Dropped:
		b.status.Dropped++
	}
	i, _ := slices.BinarySearchFunc(b.open, seq, func(e pending, seq uint64) int { return compareU64(e.seq, seq) })
	b.open[i].pages--
	b.advance()
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

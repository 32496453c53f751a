package prefetch

import (
	"context"
	"sync"
)

// Barrier tracks the pages one control handle asked for: Wait returns once
// every page accepted so far is resident, or failed. It is what fsync on the
// control file waits for.
type Barrier struct {
	mu      sync.Mutex
	pending int           // GUARDED_BY(mu): pages not yet stored, failed or dropped
	err     error         // GUARDED_BY(mu): first failure since the last Wait
	idle    chan struct{} // GUARDED_BY(mu): closed while pending == 0
}

// NewBarrier returns an idle barrier.
func NewBarrier() *Barrier {
	b := &Barrier{idle: make(chan struct{})}
	close(b.idle)
	return b
}

func (b *Barrier) add(n int) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	if b.pending == 0 {
		b.idle = make(chan struct{})
	}
	b.pending += n
	b.mu.Unlock()
}

func (b *Barrier) done(err error) {
	b.mu.Lock()
	if err != nil && b.err == nil {
		b.err = err
	}
	b.pending--
	if b.pending == 0 {
		close(b.idle)
	}
	b.mu.Unlock()
}

// Wait blocks until no page is pending, then returns the first failure since
// the previous Wait (and forgets it: a failure is reported once, as with
// fsync on a regular file), or ctx's error if ctx ends first.
func (b *Barrier) Wait(ctx context.Context) error {
	b.mu.Lock()
	idle := b.idle
	b.mu.Unlock()
	select {
	case <-idle:
	case <-ctx.Done():
		return ctx.Err()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	err := b.err
	b.err = nil
	return err
}

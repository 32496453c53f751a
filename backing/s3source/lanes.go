package s3source

import (
	"context"
	"sync"
	"sync/atomic"
)

// slots bounds the GETs in flight (hedges included) and hands a freed slot
// to a waiting demand GET (a reader blocked on a fault) before any waiting
// prefetch GET: two lanes, each FIFO. Prefetch work can fill every slot,
// but a fault never queues behind it.
type slots struct {
	n       int
	mu      sync.Mutex
	free    int                // GUARDED_BY(mu)
	waiters [2][]chan struct{} // GUARDED_BY(mu): [laneDemand], [lanePrefetch]

	// crowds counts the times the GETs in flight grew past
	// latencyQuietMax: a GET that sees it change was not alone.
	crowds atomic.Uint64

	// preempt cancels the fill GET that holds a slot (nil: none): the
	// first GET to wait for a slot calls it, and gets that slot.
	preempt func() // GUARDED_BY(mu)
}

const (
	laneDemand   = 0
	lanePrefetch = 1
)

func newSlots(n int) *slots { return &slots{n: n, free: n} }

func lane(demand bool) int {
	if demand {
		return laneDemand
	}
	return lanePrefetch
}

// acquire waits for a slot in the given lane, or for ctx. It returns the
// GETs in flight once it holds the slot, its own included.
func (s *slots) acquire(ctx context.Context, demand bool) (int, error) {
	s.mu.Lock()
	if s.free > 0 {
		s.free--
		inFlight := s.n - s.free
		s.countCrowd(inFlight)
		s.mu.Unlock()
		return inFlight, nil
	}
	l := lane(demand)
	ch := make(chan struct{}, 1)
	s.waiters[l] = append(s.waiters[l], ch)
	preempt := s.preempt
	s.preempt = nil
	s.mu.Unlock()
	if preempt != nil {
		preempt() // the fill GET stops and releases its slot to a waiter
	}
	select {
	case <-ch:
		return s.n, nil // handed over by a release: every slot is taken
	case <-ctx.Done():
		s.mu.Lock()
		for i, w := range s.waiters[l] {
			if w == ch {
				s.waiters[l] = append(s.waiters[l][:i], s.waiters[l][i+1:]...)
				s.mu.Unlock()
				return 0, ctx.Err()
			}
		}
		s.mu.Unlock()
		// The slot was handed over meanwhile: give it on.
		<-ch
		s.release()
		return 0, ctx.Err()
	}
}

// tryAcquire takes a slot if one is free and nobody waits for one: a hedge
// never waits, and never takes a slot from a queued GET. It returns the
// GETs in flight once it holds the slot, its own included.
func (s *slots) tryAcquire() (int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 {
		s.free--
		s.countCrowd(s.n - s.free)
		return s.n - s.free, true
	}
	return 0, false
}

// tryAcquireFill takes a slot for the fill lane if one is free (nobody
// waits for one); cancel stops its GET, and is called as soon as any GET
// has to wait for a slot. releaseFill gives the slot back.
func (s *slots) tryAcquireFill(cancel func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free == 0 || s.preempt != nil {
		return false
	}
	s.free--
	s.countCrowd(s.n - s.free)
	s.preempt = cancel
	return true
}

func (s *slots) releaseFill() {
	s.mu.Lock()
	s.preempt = nil
	s.mu.Unlock()
	s.release()
}

// countCrowd counts a crowd when a slot just taken makes inFlight GETs in
// flight. In flight grows one slot at a time (a slot handed over by a
// release keeps it at n), so every crowd passes latencyQuietMax+1.
func (s *slots) countCrowd(inFlight int) {
	if inFlight == latencyQuietMax+1 {
		s.crowds.Add(1)
	}
}

// release frees a slot, handing it to the oldest demand waiter, else the
// oldest prefetch waiter.
func (s *slots) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for l := range s.waiters {
		if q := s.waiters[l]; len(q) > 0 {
			q[0] <- struct{}{}
			q[0] = nil
			s.waiters[l] = q[1:]
			return
		}
	}
	s.free++
}

// waiting is the number of GETs waiting in each lane (tests).
func (s *slots) waiting() (demand, prefetch int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiters[laneDemand]), len(s.waiters[lanePrefetch])
}

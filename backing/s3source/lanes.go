package s3source

import (
	"context"
	"sync"
)

// slots bounds the GETs in flight (hedges included) and hands a freed slot
// to a waiting demand GET (a reader blocked on a fault) before any waiting
// prefetch GET: two lanes, each FIFO. Prefetch work can fill every slot,
// but a fault never queues behind it.
type slots struct {
	mu      sync.Mutex
	free    int                // GUARDED_BY(mu)
	waiters [2][]chan struct{} // GUARDED_BY(mu): [laneDemand], [lanePrefetch]
}

const (
	laneDemand   = 0
	lanePrefetch = 1
)

func newSlots(n int) *slots { return &slots{free: n} }

func lane(demand bool) int {
	if demand {
		return laneDemand
	}
	return lanePrefetch
}

// acquire waits for a slot in the given lane, or for ctx.
func (s *slots) acquire(ctx context.Context, demand bool) error {
	s.mu.Lock()
	if s.free > 0 {
		s.free--
		s.mu.Unlock()
		return nil
	}
	l := lane(demand)
	ch := make(chan struct{}, 1)
	s.waiters[l] = append(s.waiters[l], ch)
	s.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for i, w := range s.waiters[l] {
			if w == ch {
				s.waiters[l] = append(s.waiters[l][:i], s.waiters[l][i+1:]...)
				s.mu.Unlock()
				return ctx.Err()
			}
		}
		s.mu.Unlock()
		// The slot was handed over meanwhile: give it on.
		<-ch
		s.release()
		return ctx.Err()
	}
}

// tryAcquire takes a slot if one is free and nobody waits for one: a hedge
// never waits, and never takes a slot from a queued GET.
func (s *slots) tryAcquire() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.free > 0 {
		s.free--
		return true
	}
	return false
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

package s3source

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// latency tracks the time to first byte of recent GETs and says how long a
// demand GET may go without one before it is hedged: the p95 of the last
// latencyWindow GETs, never under the floor. A store's tail (a GET that
// waits on a busy disk or a slow partition) is far longer than its median;
// a second GET after the p95 usually answers first.
type latency struct {
	floor time.Duration

	mu      sync.Mutex
	samples [latencyWindow]time.Duration // GUARDED_BY(mu); a ring
	n       int                          // GUARDED_BY(mu): samples taken, ever

	p95 atomic.Int64 // nanoseconds; 0 until latencyWarmup samples
}

const (
	latencyWindow = 512
	latencyWarmup = 32 // no hedging before this many samples
	latencyEvery  = 32 // recompute the p95 after this many samples
)

func (l *latency) add(d time.Duration) {
	l.mu.Lock()
	l.samples[l.n%latencyWindow] = d
	l.n++
	var window []time.Duration
	if l.n >= latencyWarmup && l.n%latencyEvery == 0 {
		window = slices.Clone(l.samples[:min(l.n, latencyWindow)])
	}
	l.mu.Unlock()
	if window != nil {
		slices.Sort(window)
		l.p95.Store(int64(window[len(window)*95/100]))
	}
}

// delay is how long to wait for a first byte before hedging; 0: do not
// hedge (too few samples yet).
func (l *latency) delay() time.Duration {
	p := time.Duration(l.p95.Load())
	if p == 0 {
		return 0
	}
	return max(p, l.floor)
}

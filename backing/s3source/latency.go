package s3source

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// latency tracks the time to first byte of recent demand GETs and says how
// long a demand GET may go without one before it is hedged: the p97 of the
// recent GETs of its class, never under the floor. A store's tail (a GET
// that waits on a busy disk or a slow partition) is far longer than its
// median; a second GET after the p97 usually answers first. Not the p95:
// that hedges 5% of GETs, all the budget (hedgeBudget), and when the
// estimate lags a slower store the budget runs dry just as the slow GETs
// come (measured: a 201 ms miss unhedged after 13 hedges in 213 GETs); at
// the p97 a tight store's delay is a few hundred µs longer and 2% of the
// budget is left for them.
//
// The estimate is kept apart for GETs that start alone (a single fault,
// latencyQuiet or fewer GETs in flight) and GETs that start in a crowd (a
// decode step's hinted pages, up to Concurrency at once), because the store
// answers a crowd later: in the bench's object-store run the busy decode
// phase's GETs took ~40-70 ms to a first byte where a lone fault's took
// 21-22 ms, and one window for both hedged the lone faults after ~67 ms (a
// cold miss p99 of 89.7 ms against a p95 of 23.3 ms). Prefetch GETs are
// never hedged and not counted. A sample counts while it is younger than
// latencyAge, and the newest latencyWarmup of a class always count, so an
// old phase ages out but a class that is rarely used keeps an estimate.
type latency struct {
	floor time.Duration

	mu    sync.Mutex
	class [latencyClasses]latencyRing // GUARDED_BY(mu)

	hedgeAt [latencyClasses]atomic.Int64 // nanoseconds: the p97; 0 until latencyWarmup samples of the class
}

// latencyRing is the last latencyWindow samples of one class.
type latencyRing struct {
	d  [latencyWindow]time.Duration
	at [latencyWindow]time.Time
	n  int // samples taken, ever
}

// Classes of GETs by the GETs in flight when they started.
const (
	latencyQuiet   = 0 // latencyQuietMax or fewer GETs in flight, this one included
	latencyBusy    = 1
	latencyClasses = 2
)

const (
	latencyQuietMax = 4
	latencyWindow   = 512
	latencyWarmup   = 16               // no estimate before this many samples of a class
	latencyEvery    = 8                // recompute a class's p97 after this many of its samples
	latencyAge      = 20 * time.Second // older samples count only among a class's newest latencyWarmup
)

// latencyClass is the class of a GET that started with inFlight GETs in
// flight, itself included.
func latencyClass(inFlight int) int {
	if inFlight <= latencyQuietMax {
		return latencyQuiet
	}
	return latencyBusy
}

// add records a first byte after d of a GET of class c, at now.
func (l *latency) add(c int, d time.Duration, now time.Time) {
	l.mu.Lock()
	r := &l.class[c]
	r.d[r.n%latencyWindow] = d
	r.at[r.n%latencyWindow] = now
	r.n++
	var window []time.Duration
	if r.n >= latencyWarmup && r.n%latencyEvery == 0 {
		window = r.recent(now)
	}
	l.mu.Unlock()
	if window != nil {
		slices.Sort(window)
		// The p97, but never the largest sample: of a few dozen, the
		// largest is often the one slow GET in a hundred (200 ms where
		// the rest take 22), and the second largest rarely.
		l.hedgeAt[c].Store(int64(window[min(len(window)*97/100, len(window)-2)]))
	}
}

// recent returns the samples younger than latencyAge, or the newest
// latencyWarmup when fewer are.
func (r *latencyRing) recent(now time.Time) []time.Duration {
	k := min(r.n, latencyWindow)
	window := make([]time.Duration, 0, k)
	for i := 1; i <= k; i++ { // newest first
		j := (r.n - i) % latencyWindow
		if i > latencyWarmup && now.Sub(r.at[j]) > latencyAge {
			break
		}
		window = append(window, r.d[j])
	}
	return window
}

// delay is how long a GET of class c waits for a first byte before it is
// hedged: its class's p97 (the other class's while its own has too few
// samples), at least the floor; 0: do not hedge (too few samples yet).
func (l *latency) delay(c int) time.Duration {
	p := time.Duration(l.hedgeAt[c].Load())
	if p == 0 {
		p = time.Duration(l.hedgeAt[1-c].Load())
	}
	if p == 0 {
		return 0
	}
	return max(p, l.floor)
}

// hedgeBudget keeps hedges within percent of the demand GETs that may be
// hedged: each such GET earns percent hundredths of a hedge, a hedge spends
// a whole one, and at most hedgeBurst hedges are saved up, so credit earned
// by an hour of calm cannot pay for a storm of hedges (each a GET more on a
// store that is slow already).
type hedgeBudget struct {
	credit atomic.Int64  // hundredths of a hedge
	gets   atomic.Uint64 // demand GETs that earned credit, ever
}

const hedgeBurst = 8

// earn credits one demand GET at percent.
func (b *hedgeBudget) earn(percent uint64) {
	b.gets.Add(1)
	for {
		c := b.credit.Load()
		n := min(c+int64(percent), hedgeBurst*100)
		if n == c || b.credit.CompareAndSwap(c, n) {
			return
		}
	}
}

// spend takes one hedge's credit, if there is enough.
func (b *hedgeBudget) spend() bool {
	for {
		c := b.credit.Load()
		if c < 100 {
			return false
		}
		if b.credit.CompareAndSwap(c, c-100) {
			return true
		}
	}
}

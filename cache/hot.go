package cache

import (
	"cmp"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/internal/stats"
)

// HotCache keeps the decode-hot pages of the table files pinned in the page
// cache: the Tier decides, a Pinner executes, on one worker goroutine.
//
// Callers may be FUSE Read handlers, and mlock of a cold page faults through
// our own Read handler (~36 µs), so Admit only runs the policy and queues
// the work; every mlock/munlock happens on the worker, which holds no lock
// that callers need while it makes a system call.
//
// Budget: the pages actually pinned never exceed the capacity, even between
// two calls (while a run is being pinned, up to MaxTransientPages of its
// fault-around neighbours are locked too, until the pinner trims them). The policy's decisions and the queue are kept in one order (mu),
// the worker applies each batch unpins first, and it pins only pages still
// in the tier; so what it has locked is always a subset of the tier as it was
// when the batch was taken, which the tier keeps within budget.
type HotCache struct {
	tier      *Tier
	pinner    *Pinner // nil: the tier runs unpinned
	st        *stats.Counters
	log       *zap.Logger
	maxQueued int // pins waiting for the worker before Admit drops new ones

	mu       sync.Mutex
	cond     *sync.Cond // on mu: a batch was applied, or Close
	changes  Changes    // GUARDED_BY(mu); scratch for Tier.Access
	queue    []pinOp    // GUARDED_BY(mu); in policy order
	spare    []pinOp    // GUARDED_BY(mu); the other buffer of queue
	queued   int        // GUARDED_BY(mu); pins in queue
	enqueued uint64     // GUARDED_BY(mu); batches handed to the worker, for Flush
	applied  uint64     // GUARDED_BY(mu); of which applied
	closed   bool       // GUARDED_BY(mu)

	kick chan struct{} // capacity 1: there is work
	stop chan struct{}
	done chan struct{}

	pinnedMu sync.RWMutex
	pinned   map[PageKey]struct{} // GUARDED_BY(pinnedMu); written by the worker only: pages locked now

	dropped atomic.Uint64 // pins dropped because the queue was full

	// Owned by the worker goroutine.
	last         map[PageKey]bool
	unpins, pins []PageKey
	failLog      rateLimit
}

type pinOp struct {
	k   PageKey
	pin bool // else unpin
}

const (
	// defaultMaxQueued bounds the pins waiting for the worker: 16,384 pages
	// (64 MiB) is about half a second of cold pins at ~36 µs each.
	defaultMaxQueued = 16384
	// admitChunk bounds how long one Admit holds mu (a 40K-row prefill chunk
	// would otherwise hold it for milliseconds in front of FUSE readers).
	admitChunk = 256
)

// NewHotCache pins up to capacityBytes of pages through p (which it owns from
// now on: Close closes it). A nil p, or one whose mlock is refused, runs the
// policy unpinned. A capacity under one page disables the cache.
//
// Without CAP_IPC_LOCK the capacity is clamped to RLIMIT_MEMLOCK.
func NewHotCache(capacityBytes int64, p *Pinner, st *stats.Counters, log *zap.Logger) *HotCache {
	if st == nil {
		st = &stats.Counters{}
	}
	if log == nil {
		log = zap.NewNop()
	}
	if p != nil && p.Available() && capacityBytes >= PageSize {
		if limit := p.memlockPages(); limit >= 0 && capacityBytes/PageSize > limit {
			// Better a smaller pinned tier than mlock failing half way.
			log.Warn("hot tier capacity clamped to RLIMIT_MEMLOCK (no CAP_IPC_LOCK); raise it (ulimit -l) for more",
				zap.Int64("capacity_bytes", capacityBytes), zap.Int64("clamped_bytes", limit*PageSize))
			capacityBytes = limit * PageSize
		}
	}
	h := &HotCache{
		tier:      NewTier(capacityBytes),
		pinner:    p,
		st:        st,
		log:       log,
		maxQueued: defaultMaxQueued,
		kick:      make(chan struct{}, 1),
		stop:      make(chan struct{}),
		done:      make(chan struct{}),
		pinned:    map[PageKey]struct{}{},
		last:      map[PageKey]bool{},
		failLog:   rateLimit{every: time.Second},
	}
	h.cond = sync.NewCond(&h.mu)
	st.CacheCapacityBytes.Store(int64(h.tier.Capacity()) * PageSize)
	st.CacheUsedBytes.Store(0)
	st.CachePinned.Store(p != nil && p.Available() && h.tier.Capacity() > 0)
	go h.work()
	return h
}

// Admit runs the policy on keys and queues the resulting pin and unpin work.
// It never waits for I/O: it takes short locks only. When the queue is full,
// the pins that do not fit are dropped and their pages removed from the tier
// again (for every signal: the tier never claims a page that will not be
// pinned, so Pinned and hit counts stay honest). Unpins are never dropped.
// LOCKS_EXCLUDED(h.mu)
func (h *HotCache) Admit(keys []PageKey, sig Signal) {
	for len(keys) > 0 {
		n := min(len(keys), admitChunk)
		h.admit(keys[:n], sig)
		keys = keys[n:]
	}
}

func (h *HotCache) admit(keys []PageKey, sig Signal) {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return
	}
	c := &h.changes
	c.Reset()
	h.tier.Access(keys, sig, c)
	pins, unpins := c.Pin, c.Unpin
	if h.pinner == nil || !h.pinner.Available() {
		pins = nil // nothing to lock: the tier runs unpinned
	}
	if h.pinner == nil {
		unpins = nil // nothing was ever locked
	}
	room := max(0, h.maxQueued-h.queued)
	dropped := 0
	if len(pins) > room {
		for _, k := range pins[room:] {
			h.tier.Remove(k)
		}
		dropped = len(pins) - room
		pins = pins[:room]
	}
	// Within one Changes, unpins come first (see Changes).
	for _, k := range unpins {
		h.queue = append(h.queue, pinOp{k: k})
	}
	for _, k := range pins {
		h.queue = append(h.queue, pinOp{k: k, pin: true})
	}
	h.queued += len(pins)
	if len(unpins)+len(pins) > 0 {
		h.enqueued++
		select {
		case h.kick <- struct{}{}:
		default:
		}
	}
	hits, misses, evictions := c.Hits, c.Misses, len(c.Unpin)
	h.mu.Unlock()

	h.st.CacheHits.Add(uint64(hits))
	h.st.CacheMisses.Add(uint64(misses))
	h.st.CacheEvictions.Add(uint64(evictions))
	if dropped > 0 {
		h.dropped.Add(uint64(dropped))
	}
}

// Pinned reports whether page k is locked in the page cache now (not merely
// admitted and waiting for the worker). LOCKS_EXCLUDED(h.pinnedMu)
func (h *HotCache) Pinned(k PageKey) bool {
	h.pinnedMu.RLock()
	_, ok := h.pinned[k]
	h.pinnedMu.RUnlock()
	return ok
}

// Flush waits until all work queued so far has been applied (or the cache
// is closed). LOCKS_EXCLUDED(h.mu)
func (h *HotCache) Flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	target := h.enqueued
	for h.applied < target && !h.closed {
		h.cond.Wait()
	}
}

// Keys lists the pages in the tier, hottest first within each shard (the
// state to save for a warm restart).
func (h *HotCache) Keys() []PageKey { return h.tier.Keys() }

// Close stops the worker (dropping work not yet applied), then unpins and
// unmaps everything (Pinner.Close). Call it before unmounting.
// LOCKS_EXCLUDED(h.mu)
func (h *HotCache) Close() error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	h.queue, h.queued = nil, 0
	h.cond.Broadcast()
	h.mu.Unlock()
	close(h.stop)
	<-h.done
	var err error
	if h.pinner != nil {
		err = h.pinner.Close()
	}
	h.pinnedMu.Lock()
	clear(h.pinned)
	h.pinnedMu.Unlock()
	h.st.CacheUsedBytes.Store(0)
	return err
}

// work is the worker goroutine: the only place that locks or unlocks pages.
func (h *HotCache) work() {
	defer close(h.done)
	for {
		select {
		case <-h.stop:
			return
		case <-h.kick:
		}
		for h.applyQueued() {
		}
	}
}

// applyQueued takes the queue and applies it; false when it was empty or the
// cache is closing. LOCKS_EXCLUDED(h.mu)
func (h *HotCache) applyQueued() bool {
	h.mu.Lock()
	batch, seq := h.queue, h.enqueued
	h.queue, h.queued, h.spare = h.spare[:0], 0, nil
	h.mu.Unlock()
	if len(batch) > 0 {
		h.apply(batch)
	}
	h.mu.Lock()
	h.applied, h.spare = seq, batch[:0]
	h.cond.Broadcast()
	h.mu.Unlock()
	return len(batch) > 0 && !h.stopping()
}

// apply executes one batch: for each page only its last operation counts (a
// page admitted and evicted again while queued costs nothing), unpins
// before pins, adjacent pages in one system call. It stops early, between
// system calls, when the cache is closing.
func (h *HotCache) apply(batch []pinOp) {
	clear(h.last)
	for _, op := range batch {
		h.last[op.k] = op.pin
	}
	h.unpins, h.pins = h.unpins[:0], h.pins[:0]
	h.pinnedMu.RLock()
	for k, pin := range h.last {
		_, locked := h.pinned[k]
		switch {
		case !pin && locked:
			h.unpins = append(h.unpins, k)
		case pin && !locked:
			h.pins = append(h.pins, k)
		}
	}
	h.pinnedMu.RUnlock()

	sortKeys(h.unpins)
	forRuns(h.unpins, func(run []PageKey) bool {
		if err := h.pinner.UnpinRun(run[0].Table, run[0].Page, uint64(len(run))); err != nil {
			h.logFailure("unpin failed; the page may stay locked", err)
		}
		h.setPinned(run, false)
		return true
	})

	// Pin only what the tier still holds: a page may have been removed (its
	// pin failed earlier) or evicted since it was queued; an eviction is then
	// in a later batch.
	live := h.pins[:0]
	for _, k := range h.pins {
		if h.tier.Contains(k) {
			live = append(live, k)
		}
	}
	sortKeys(live)
	forRuns(live, func(run []PageKey) bool {
		if h.stopping() {
			return false
		}
		err := h.pinner.PinRun(run[0].Table, run[0].Page, uint64(len(run)))
		switch {
		case err == nil:
			h.setPinned(run, true)
		case errors.Is(err, ErrPinUnavailable):
			h.st.CachePinned.Store(false) // the pinner has logged it, once
			return false
		default:
			// Find the page that failed; pin the others.
			for _, k := range run {
				if len(run) > 1 {
					if err = h.pinner.Pin(k); err == nil {
						h.setPinned([]PageKey{k}, true)
						continue
					}
				}
				h.tier.Remove(k)
				h.logFailure("pin failed; page removed from the hot tier", err)
			}
		}
		return true
	})
}

func (h *HotCache) stopping() bool {
	select {
	case <-h.stop:
		return true
	default:
		return false
	}
}

// setPinned records pages as locked or not. LOCKS_EXCLUDED(h.pinnedMu)
func (h *HotCache) setPinned(run []PageKey, locked bool) {
	h.pinnedMu.Lock()
	for _, k := range run {
		if locked {
			h.pinned[k] = struct{}{}
		} else {
			delete(h.pinned, k)
		}
	}
	n := len(h.pinned)
	h.pinnedMu.Unlock()
	h.st.CacheUsedBytes.Store(int64(n) * PageSize)
}

func (h *HotCache) logFailure(msg string, err error) {
	if suppressed, ok := h.failLog.allow(time.Now()); ok {
		h.log.Error(msg, zap.Error(err), zap.Int("suppressed", suppressed))
	}
}

func sortKeys(ks []PageKey) {
	slices.SortFunc(ks, func(a, b PageKey) int {
		return cmp.Or(cmp.Compare(a.Table, b.Table), cmp.Compare(a.Page, b.Page))
	})
}

// maxPinRun caps the pages of one mlock: cold pages fault through FUSE one
// by one (~36 µs each), and Close waits for the system call in progress.
const maxPinRun = 256

// forRuns calls f on each maximal run (at most maxPinRun) of adjacent pages
// of one table in sorted ks, until f returns false.
func forRuns(ks []PageKey, f func(run []PageKey) bool) {
	for i := 0; i < len(ks); {
		j := i + 1
		for j < len(ks) && j-i < maxPinRun && ks[j].Table == ks[i].Table && ks[j].Page == ks[j-1].Page+1 {
			j++
		}
		if !f(ks[i:j]) {
			return
		}
		i = j
	}
}

// rateLimit lets one log line through per interval and counts the rest.
type rateLimit struct {
	every      time.Duration
	last       time.Time
	suppressed int
}

func (r *rateLimit) allow(now time.Time) (suppressed int, ok bool) {
	if now.Sub(r.last) < r.every {
		r.suppressed++
		return 0, false
	}
	suppressed, r.suppressed, r.last = r.suppressed, 0, now
	return suppressed, true
}

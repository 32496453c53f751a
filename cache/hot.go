package cache

import (
	"errors"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/internal/stats"
)

// HotCache keeps the decode-hot pages of the table files pinned in the page
// cache: the Tier decides, a Pinner executes, on one worker goroutine.
//
// Callers may be FUSE Read handlers, and mlock of a cold page faults through
// our own Read handler (~36 µs), so Admit only runs the policy and queues
// the pages whose state changed; every mlock/munlock happens on the worker,
// which holds no lock that callers need while it makes a system call.
//
// The worker reconciles: for each queued page it compares the tier's
// membership now with the pinner's record of what is locked (the one record
// of "pinned"), unpins first, then pins. It decides a run of pins under mu,
// with the queue empty (every eviction so far applied), so what is locked
// never exceeds the tier as it was at that moment, which the tier keeps
// within budget; while a run is being populated, up to MaxTransientPages of
// its fault-around neighbours are locked too, until the pinner trims them.
type HotCache struct {
	tier      *Tier
	pinner    *Pinner // nil: the tier runs unpinned
	st        *stats.Counters
	log       *zap.Logger
	maxQueued int // queued pages beyond which Admit drops new pins (counted)

	mu       sync.Mutex
	cond     *sync.Cond // on mu: a batch was applied, or Close
	changes  Changes    // GUARDED_BY(mu); scratch for Tier.Access
	own      []PageKey  // GUARDED_BY(mu); scratch: faulted keys minus the pinner's own faults
	queue    []PageKey  // GUARDED_BY(mu); pages whose tier membership changed
	spare    []PageKey  // GUARDED_BY(mu); the other buffer of queue
	enqueued uint64     // GUARDED_BY(mu); batches handed to the worker, for Flush
	applied  uint64     // GUARDED_BY(mu); of which applied
	closed   bool       // GUARDED_BY(mu)
	flushing int        // GUARDED_BY(mu); Flush calls waiting: the worker does not gather
	hinted   bool       // GUARDED_BY(mu); the queue holds changes a hint (not a fault) made: gather briefly
	queuedAt time.Time  // GUARDED_BY(mu); when the queue's oldest page was queued (the batch's delay runs from it)
	// How long the worker gathers a batch: pinDelay when the queue holds a
	// hint's changes, faultPinDelay when only faults'. Tests change them.
	pinDelay, faultPinDelay time.Duration
	// gatherWaits, when set (tests, before the first Admit), hears the
	// worker start waiting for a batch to fill, with the pages queued.
	gatherWaits func(queued int)
	// demand, when set (SetDemand), says whether demand work is pending:
	// nil when none is, else a channel closed once none is. pinYield is
	// the most a batch waits for it; tests change it.
	demand   func() <-chan struct{} // GUARDED_BY(mu)
	pinYield time.Duration          // GUARDED_BY(mu)

	kick chan struct{} // capacity 1: there is work
	stop chan struct{}
	done chan struct{}

	// Owned by the worker goroutine.
	pending      []PageKey // taken from the queue, not reconciled yet
	unpins, pins []PageKey
	later        []PageKey // pins queued while a batch was pinned: the next round's
	failLog      rateLimit

	dropLog rateLimit // Admit's, any goroutine
}

const (
	// minMaxQueued is the least the queue holds before Admit drops pins: a
	// 40K-row prefill chunk's pages and their evictions. The bound is at
	// least twice the capacity, so that admitting a working set that fits
	// (one entry per admission and one per eviction) never drops a pin.
	minMaxQueued = 1 << 17
	// admitChunk bounds how long one Admit holds mu (a 40K-row prefill chunk
	// would otherwise hold it for milliseconds in front of FUSE readers).
	admitChunk = 256
)

// NewHotCache pins up to capacityBytes of pages through p (which it owns from
// now on: Close closes it). A nil p, or one whose mlock is refused, runs the
// policy unpinned: nothing is reported pinned and cache_mode says
// "unpinned". A capacity under one page disables the cache.
func NewHotCache(capacityBytes int64, p *Pinner, st *stats.Counters, log *zap.Logger) *HotCache {
	if st == nil {
		st = &stats.Counters{}
	}
	if log == nil {
		log = zap.NewNop()
	}
	h := &HotCache{
		tier:          NewTier(capacityBytes),
		pinner:        p,
		st:            st,
		log:           log,
		kick:          make(chan struct{}, 1),
		stop:          make(chan struct{}),
		done:          make(chan struct{}),
		failLog:       rateLimit{every: time.Second},
		dropLog:       rateLimit{every: time.Second},
		pinDelay:      pinDelay,
		faultPinDelay: faultPinDelay,
		pinYield:      pinYield,
	}
	h.maxQueued = max(minMaxQueued, 2*h.tier.Capacity())
	h.cond = sync.NewCond(&h.mu)
	st.CacheCapacityBytes.Store(int64(h.tier.Capacity()) * PageSize)
	st.CacheUsedBytes.Store(0)
	st.CachePinned.Store(h.pinning())
	go h.work()
	return h
}

// pinning reports whether pages get locked: a pinner that may lock, and a
// tier to decide what.
func (h *HotCache) pinning() bool {
	return h.pinner != nil && h.pinner.Available() && h.tier.Capacity() > 0
}

// Admit runs the policy on keys and queues the resulting pin and unpin work.
// It never waits for I/O: it takes short locks only. A demand fault that the
// pinner itself caused (populating a cold page it is pinning) is no access
// and is ignored. When the queue is full, the pins that do not fit are
// dropped, counted in cache_pin_dropped, and their pages removed from the
// tier again (the tier never claims a page that will not be pinned, so
// Pinned and hit counts stay honest). Unpins are never dropped.
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
	if sig == SignalFault && h.pinner != nil && h.pinner.popOn.Load() {
		h.own = h.own[:0]
		for _, k := range keys {
			if !h.pinner.Populating(k) {
				h.own = append(h.own, k)
			}
		}
		keys = h.own
	}
	c := &h.changes
	c.Reset()
	h.tier.Access(keys, sig, c)
	dropped, evictions := 0, 0
	if h.pinning() {
		pins := c.Pin
		if room := max(0, h.maxQueued-len(h.queue)-len(c.Unpin)); len(pins) > room {
			for _, k := range pins[room:] {
				h.tier.Remove(k)
			}
			dropped = len(pins) - room
			pins = pins[:room]
		}
		wasEmpty, wasHinted := len(h.queue) == 0, h.hinted
		h.queue = append(h.queue, c.Unpin...)
		h.queue = append(h.queue, pins...)
		if len(c.Unpin)+len(pins) > 0 {
			h.enqueued++
			if wasEmpty {
				h.queuedAt = time.Now()
			}
			if sig != SignalFault {
				h.hinted = true
			}
			// The worker gathers a batch (see gather): it hears of
			// the first page of one, of a full one, and of a hint's
			// first pages (which shorten the delay).
			if wasEmpty || len(h.queue) >= pinBatch || sig != SignalFault && !wasHinted {
				h.wake()
			}
		}
	} else {
		evictions = len(c.Unpin) // nothing locked: an eviction is the policy's alone
	}
	hits, misses := c.Hits, c.Misses
	h.mu.Unlock()

	h.st.CacheHits.Add(uint64(hits))
	h.st.CacheMisses.Add(uint64(misses))
	if evictions > 0 {
		h.st.CacheEvictions.Add(uint64(evictions))
	}
	if dropped > 0 {
		h.st.CachePinDropped.Add(uint64(dropped))
		if suppressed, ok := h.dropLog.allowShared(time.Now()); ok {
			h.log.Warn("hot tier pin queue full: pins dropped (cache_pin_dropped)", zap.Int("dropped", dropped), zap.Int("suppressed", suppressed))
		}
	}
}

// Pinned reports whether page k is locked in the page cache now (not merely
// admitted and waiting for the worker, and never when pinning is off).
func (h *HotCache) Pinned(k PageKey) bool {
	return h.pinner != nil && h.pinner.Pinned(k)
}

// ResidentRun reports, in bit 0 of vec[i], whether page first+i of table is
// in the page cache, for i < n; false when it cannot tell (Pinner.ResidentRun).
func (h *HotCache) ResidentRun(table uint32, first, n uint64, vec []byte) bool {
	if h.pinner == nil {
		return false
	}
	ok, skipped := h.pinner.residentRun(table, first, n, vec)
	h.st.PrefetchResidencyLookups.Add(1)
	if skipped {
		h.st.PrefetchResidencySkipped.Add(1)
	}
	return ok
}

// LookupPerRun reports whether runs runs of pages over span pages cost
// less in a ResidentRun a run than in one over the span (Pinner.PerRun).
func (h *HotCache) LookupPerRun(runs, span uint64) bool {
	return h.pinner != nil && h.pinner.PerRun(runs, span)
}

// OwnFault reports whether a FUSE read of page k is the hot tier's own
// populate of a page it is pinning (not a reader's demand): callers that
// count demand faults (late prefetches, refaults) should skip it.
func (h *HotCache) OwnFault(k PageKey) bool {
	return h.pinner != nil && h.pinner.Populating(k)
}

// Flush waits until all work queued so far has been applied (or the cache
// is closed). LOCKS_EXCLUDED(h.mu)
func (h *HotCache) Flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	target := h.enqueued
	if h.applied < target {
		h.flushing++
		defer func() { h.flushing-- }()
		h.wake() // no gathering: someone waits
	}
	for h.applied < target && !h.closed {
		h.cond.Wait()
	}
}

// wake tells the worker there is work (or a waiter).
func (h *HotCache) wake() {
	select {
	case h.kick <- struct{}{}:
	default:
	}
}

// Keys lists the pages in the tier, hottest first within each stripe (the
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
	h.queue = nil
	h.cond.Broadcast()
	h.mu.Unlock()
	close(h.stop)
	<-h.done
	var err error
	if h.pinner != nil {
		err = h.pinner.Close()
	}
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
		// Pages queued while a batch was being applied gather too:
		// taking them at once pinned a lone page per round, and left a
		// batch split across two rounds short of full, waiting out its
		// whole delay (TestHotCacheGathersPins' flake in CI).
		for h.gather() && h.yieldToDemand() && h.applyQueued() {
		}
	}
}

// Pinning a page costs the worker a wake-up and a few system calls; a
// fault that admits its page, one at a time, paid that per page, doubling
// its context switches (measured: 4.96 a fault with the tier against 2.12
// without, and 36% fewer faults a second). So the worker gathers: after the
// first page of a batch it waits for pinBatch pages, unless Flush waits, at
// most pinDelay when a hint admitted pages, else faultPinDelay (measured,
// single-threaded faults with the tier on: 3.6 context switches a fault
// gathering 2 ms, 2.6 gathering 20 ms, 2.5 with the tier off). The pages
// are in the page cache meanwhile (they were just faulted or stored); only
// their locking waits. A gathered batch then waits for pending demand work
// (yieldToDemand).
const (
	pinBatch      = 64
	pinDelay      = 2 * time.Millisecond
	faultPinDelay = 20 * time.Millisecond
	// pinYield: see yieldToDemand.
	pinYield = 4 * time.Millisecond
)

// SetDemand gives the worker a way to keep out of demand work's way:
// busy returns nil when no demand work is pending, else a channel closed
// once none is (the prefetcher's decode work: Prefetcher.DecodeBusy). It is
// called without the tier's lock held.
func (h *HotCache) SetDemand(busy func() <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.demand = busy
}

// yieldToDemand holds a gathered batch back while demand work is pending,
// at most pinYield, and not while a Flush waits; false when the cache
// stops. Pinning a page costs the worker a read through the mount, a
// populate (a minor fault, 20-40 µs on these VMs), an mlock and the charge
// lookups: pinning a decode step's new pages while that step's reads were
// being stored took the step's CPU on two cores. The pages are resident
// meanwhile (a hint's residency lookup finds them cached); only their
// locking waits.
//
// The bound decides it (serving loop, `engramfs bench --serve
// --serve-requests 6`, engramfs+hints against v3 on the shards, decode p50,
// interleaved runs, 2026-12-05): with 4 ms, big ×1 1.28-1.43× v3 against
// 1.80-2.13× without (three pairs; hints + barrier 2.49-2.66 ms against
// 3.57-3.86), flash ×1 1.57-1.65 against 1.81-2.00, flash ×4 1.19-1.48
// against 1.22-1.56 with prefill 0.71-0.92 against 0.83-0.89, big ×4 0.64
// against 0.60 (prefill 0.61 against 0.50). With 20 ms, several ranks
// keep decode work pending nearly all the time and the pins fell behind:
// flash ×4 prefill 2.55× v3 against 0.83 and decode 1.92 against 1.47.
func (h *HotCache) yieldToDemand() bool {
	h.mu.Lock()
	busy, yield := h.demand, h.pinYield
	h.mu.Unlock()
	if busy == nil {
		return true
	}
	deadline := time.Now().Add(yield)
	for {
		ch := busy()
		h.mu.Lock()
		flushing := h.flushing > 0
		h.mu.Unlock()
		wait := time.Until(deadline)
		if ch == nil || flushing || wait <= 0 {
			return true
		}
		t := time.NewTimer(wait)
		select {
		case <-ch:
		case <-h.kick: // perhaps a Flush: look again
		case <-t.C:
		case <-h.stop:
			t.Stop()
			return false
		}
		t.Stop()
	}
}

// gather waits until the queue holds pinBatch pages, Flush waits, or the
// delay since the queue's oldest page was queued has passed; false when the
// cache stops. A wake-up is only a reason to look again: one left over from
// a page the worker has already taken must not end a new batch early.
func (h *HotCache) gather() bool {
	var t *time.Timer
	for {
		h.mu.Lock()
		ready := len(h.queue) >= pinBatch || h.flushing > 0 || len(h.queue) == 0
		delay := h.faultPinDelay
		if h.hinted {
			delay = h.pinDelay
		}
		wait := time.Until(h.queuedAt.Add(delay))
		queued := len(h.queue)
		h.mu.Unlock()
		if ready || wait <= 0 {
			return true
		}
		if h.gatherWaits != nil {
			h.gatherWaits(queued)
		}
		if t == nil {
			t = time.NewTimer(wait)
			defer t.Stop()
		} else {
			t.Reset(wait)
		}
		select {
		case <-h.kick: // a full batch, a Flush, or a hint's pages: look again
		case <-t.C:
		case <-h.stop:
			return false
		}
	}
}

// take moves the queue to h.pending; it returns the batch number of the
// last batch taken. EXCLUSIVE_LOCKS_REQUIRED(h.mu)
func (h *HotCache) take() uint64 {
	h.hinted = false
	h.pending = append(h.pending, h.queue...)
	h.queue, h.spare = h.spare[:0], h.queue[:0]
	return h.enqueued
}

// applyQueued takes the queue and reconciles it; false when there was
// nothing to do or the cache is closing. LOCKS_EXCLUDED(h.mu)
func (h *HotCache) applyQueued() bool {
	h.mu.Lock()
	seq := h.take()
	h.mu.Unlock()
	if len(h.pending) == 0 {
		h.markApplied(seq)
		return false
	}
	for len(h.pending) > 0 && !h.stopping() {
		seq = h.reconcile(seq)
	}
	h.markApplied(seq)
	return !h.stopping()
}

func (h *HotCache) markApplied(seq uint64) {
	h.mu.Lock()
	h.applied = max(h.applied, seq)
	h.cond.Broadcast()
	h.mu.Unlock()
}

// reconcile applies h.pending: unpins the pages locked but out of the tier,
// then pins the pages in the tier but not locked, run by run. Before each run
// it applies whatever was queued meanwhile: its unpins (evictions) at once,
// its pins after this batch's (they are reconciled again in the next round).
// A run is pinned only when, under mu, the queue is empty and every page of
// it is in the tier. Each queued key is looked at a bounded number of times,
// however often the queue refills while a batch is pinned (it used to be
// re-sorted and re-checked at every refill: 8% of the daemon's CPU in
// Tier.Contains under a hinted decode). It returns the batch number of what
// it took.
func (h *HotCache) reconcile(seq uint64) uint64 {
	h.unpins, h.pins = h.classify(h.pending, h.unpins[:0], h.pins[:0])
	h.pending = h.pending[:0]
	h.unpin(h.unpins)

	for i := 0; i < len(h.pins); {
		j := runEnd(h.pins, i)
		if h.stopping() {
			return seq
		}
		h.mu.Lock()
		for len(h.queue) > 0 {
			// Evictions may be waiting: apply them before locking more.
			seq = h.take()
			h.mu.Unlock()
			h.unpins, h.later = h.classify(h.pending, h.unpins[:0], h.later)
			h.pending = h.pending[:0]
			h.unpin(h.unpins)
			h.mu.Lock()
		}
		live := h.pins[i:i]
		for _, k := range h.pins[i:j] {
			if h.tier.Contains(k) && !h.pinner.Pinned(k) {
				live = append(live, k)
			}
		}
		h.mu.Unlock()
		forRuns(live, h.pinRun)
		i = j
	}
	h.pending = append(h.pending, h.later...)
	h.later = h.later[:0]
	return seq
}

// classify sorts keys (in place, dropping duplicates) and appends those
// locked but out of the tier to unpins, those in the tier but not locked to
// pins. The tier is read under mu, so between two Access calls: within one,
// a page can be evicted and admitted again (Changes then names it in
// neither list), and a worker that saw it out at that moment dropped its pin
// for good (TestHotCacheScanResistance's flake: "in the tier, not pinned").
// In chunks, so that Admit never waits long. LOCKS_EXCLUDED(h.mu)
func (h *HotCache) classify(keys, unpins, pins []PageKey) ([]PageKey, []PageKey) {
	slices.SortFunc(keys, comparePageKeys)
	keys = slices.Compact(keys)
	for c := 0; c < len(keys); c += admitChunk {
		h.mu.Lock()
		for _, k := range keys[c:min(c+admitChunk, len(keys))] {
			in, locked := h.tier.Contains(k), h.pinner.Pinned(k)
			switch {
			case !in && locked:
				unpins = append(unpins, k)
			case in && !locked:
				pins = append(pins, k)
			}
		}
		h.mu.Unlock()
	}
	return unpins, pins
}

// unpin unlocks the sorted keys, run by run. Worker only.
func (h *HotCache) unpin(keys []PageKey) {
	forRuns(keys, func(run []PageKey) bool {
		if err := h.pinner.UnpinRun(run[0].Table, run[0].Page, uint64(len(run))); err != nil {
			h.logFailure("unpin failed; the pages stay locked", err)
		} else {
			h.st.CacheEvictions.Add(uint64(len(run)))
		}
		return true
	})
	h.publishUsed()
}

// pinRun pins one run of adjacent pages of the tier. Worker only.
func (h *HotCache) pinRun(run []PageKey) bool {
	err := h.pinner.PinRun(run[0].Table, run[0].Page, uint64(len(run)))
	switch {
	case err == nil:
	case errors.Is(err, ErrPinUnavailable):
		// The pinner has logged it, once, and released every page.
		h.st.CachePinned.Store(false)
		h.publishUsed()
		return false
	default:
		// Find the page that failed; pin the others.
		for _, k := range run {
			if len(run) > 1 {
				if err = h.pinner.Pin(k); err == nil {
					continue
				}
			}
			h.tier.Remove(k)
			if errors.Is(err, ErrChargedElsewhere) {
				h.st.CachePinForeign.Add(1) // a reader's to reclaim: no failure
				continue
			}
			h.logFailure("pin failed; page removed from the hot tier", err)
		}
	}
	h.publishUsed()
	return true
}

func (h *HotCache) stopping() bool {
	select {
	case <-h.stop:
		return true
	default:
		return false
	}
}

// publishUsed sets cache_used_bytes from the pinner's count of locked pages.
func (h *HotCache) publishUsed() {
	h.st.CacheUsedBytes.Store(h.pinner.PinnedPages() * PageSize)
	h.st.CachePagesRecharged.Store(h.pinner.Recharged())
}

func (h *HotCache) logFailure(msg string, err error) {
	if suppressed, ok := h.failLog.allow(time.Now()); ok {
		h.log.Error(msg, zap.Error(err), zap.Int("suppressed", suppressed))
	}
}

// maxPinRun caps the pages of one mlock: cold pages fault through FUSE one
// by one (~36 µs each), and Close waits for the system call in progress.
const maxPinRun = 256

// forRuns calls f on each maximal run (at most maxPinRun) of adjacent pages
// of one table in sorted ks, until f returns false.
func forRuns(ks []PageKey, f func(run []PageKey) bool) {
	for i := 0; i < len(ks); {
		j := runEnd(ks, i)
		if !f(ks[i:j]) {
			return
		}
		i = j
	}
}

// runEnd is the end of the run of sorted ks that starts at i.
func runEnd(ks []PageKey, i int) int {
	j := i + 1
	for j < len(ks) && j-i < maxPinRun && ks[j].Table == ks[i].Table && ks[j].Page == ks[j-1].Page+1 {
		j++
	}
	return j
}

// rateLimit lets one log line through per interval and counts the rest.
// allow is for one goroutine; allowShared may be called from any.
type rateLimit struct {
	mu         sync.Mutex
	every      time.Duration
	last       time.Time
	suppressed int
}

func (r *rateLimit) allowShared(now time.Time) (suppressed int, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.allow(now)
}

func (r *rateLimit) allow(now time.Time) (suppressed int, ok bool) {
	if now.Sub(r.last) < r.every {
		r.suppressed++
		return 0, false
	}
	suppressed, r.suppressed, r.last = r.suppressed, 0, now
	return suppressed, true
}

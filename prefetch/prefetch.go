// Package prefetch turns hints into resident pages: it queues the pages of
// hinted rows (each handle's decode work round robin, before any prefill
// work), hands them to the shared page loader in batches, a bounded number
// of pages in flight, and pushes them into the kernel page cache through a
// Pusher, so the gather that follows never leaves memory. It knows nothing
// of FUSE: fs implements Pusher.
//
// The scheduling decisions live in sched.go (a core with no goroutines and
// no I/O); fetch.go hands claimed work to the loader, push.go stores and
// settles it. Every page settles exactly once, as resident, pinned, dropped
// (prefill only) or failed, and every handle waiting for it hears which.
package prefetch

import (
	bits64 "math/bits"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// Pusher stores data into the page cache of table's file at byte offset off.
// off is page-aligned and data is whole pages, except that the last page of
// the file may be short. Store must not be called from a FUSE Read handler
// (docs/design.md, "Kernel facts and what the code does about them": the
// folio being read is locked, the store would wait forever);
// the prefetcher only calls it from its own pusher goroutines. A store that
// fails (fs.ErrNotServing before the mount is up) settles its pages as
// failed.
type Pusher interface {
	Store(table uint32, off int64, data []byte) error
}

// Confirmer is implemented by Pushers that can make sure a page is in the
// page cache: a page whose fetch a fault cancelled settles as resident only
// once Confirm returns nil (reading it through the page cache waits for the
// fault's reply, or faults it in again). Without one, such a page settles
// as resident when the fault is reported.
type Confirmer interface {
	Confirm(table uint32, off int64) error
}

// PageFetcher is the shared read-through loader (cache.Loader). Pages
// fetched with FetchHeld are handed to faults without a new read until
// Release: the prefetcher releases every run it fetched once it has settled.
type PageFetcher interface {
	FetchHeld(runs []cache.Run, origin cache.Origin, done cache.FetchDone)
	Release(runs ...cache.Run)
}

// HotTier is the pinned hot tier, when there is one (cache.HotCache).
type HotTier interface {
	Pinned(k cache.PageKey) bool
	Admit(keys []cache.PageKey, sig cache.Signal)
	// OwnFault: a FUSE read of k is the tier's own populate of a page it is
	// pinning, not a reader's demand.
	OwnFault(k cache.PageKey) bool
	// ResidentRun sets bit 0 of vec[i] when page first+i of table is in
	// the page cache, for i < n; false when it cannot tell.
	ResidentRun(table uint32, first, n uint64, vec []byte) bool
	// LookupPerRun: runs runs of pages over span pages are looked up for
	// less a run at a time than in one ResidentRun over the span.
	LookupPerRun(runs, span uint64) bool
}

// Config sizes the prefetcher.
type Config struct {
	// InflightPages bounds the pages handed to the loader and not yet
	// answered (and, 8 times over, those together with the pages read
	// and waiting for a pusher): about twice the backing queue depth
	// keeps the disk busy,
	// and a decode hint that arrives behind a prefill flood waits for at
	// most that much work, not for the queue. Decode work may have this
	// many pages in flight whatever prefill work holds (so up to twice it
	// in all): a decode step never waits for prefill reads to free slots.
	InflightPages int
	// Pushers store fetched pages. A store costs ~2-4 µs a page in a
	// batch and more alone (a writev each), and a decode step waits for
	// its last one: with two, one per core of these machines, the serving
	// loop's decode p50 (1 rank) was 4.8-5.2 ms against 5.5-5.8 ms with
	// one on big and 6.2-6.4 against 6.4-7.1 on flash (three runs each,
	// interleaved, 2026-12-05); with 4 ranks no different beyond noise.
	Pushers int
	// PrefillQueuePages bounds the queued prefill pages, all handles
	// together; past it the oldest prefill work is dropped (counted, and
	// reported to the handles that asked for it). Prefill is best effort.
	PrefillQueuePages int
	// DecodeQueuePages bounds one handle's queued decode pages. Decode work
	// is never dropped: past the bound the handle's next decode frame is
	// refused with EAGAIN and a decode frame already begun waits for room
	// (fs checks DecodeBacklog and WaitDecodeRoom).
	DecodeQueuePages int
}

// Defaults of Config's queue bounds (the daemon's --prefetch-queue and
// --decode-queue).
const (
	DefaultPrefillQueuePages = 1 << 18 // 1 GiB of pages, all handles together
	DefaultDecodeQueuePages  = 1 << 16 // 256 MiB of pages, per handle
)

// DefaultConfig is the configuration for a backing queue depth.
func DefaultConfig(queueDepth int) Config {
	return Config{InflightPages: max(2*queueDepth, 16), Pushers: 2,
		PrefillQueuePages: DefaultPrefillQueuePages, DecodeQueuePages: DefaultDecodeQueuePages}
}

// Prefetcher schedules, fetches and pushes hinted pages.
type Prefetcher struct {
	cfg       Config
	model     *backing.Model
	loader    PageFetcher
	pusher    Pusher
	confirmer Confirmer // nil: a fault-cancelled page settles when reported
	hot       HotTier   // nil: no hot tier
	st        *stats.Counters
	log       *zap.Logger

	mu     sync.Mutex
	c      *core // GUARDED_BY(mu)
	closed bool  // GUARDED_BY(mu)
	idle   *sync.Cond

	prefillTurn chan struct{} // one prefill part admitted at a time

	kick      chan struct{} // wakes the fetch loop: new work, or room in flight
	quit      chan struct{} // closed by Close: the fetch loop ends
	fetchDone chan struct{}

	omu       sync.Mutex
	out       []outcome     // GUARDED_BY(omu): answers for the pushers (prefill, confirms)
	outDecode []outcome     // GUARDED_BY(omu): decode answers, taken before any of out
	outReady  chan struct{} // signalled when out or outDecode grows
	pushQuit  chan struct{} // closed by Close once nothing is in flight
	pushers   sync.WaitGroup
	// unstored is the pages the loader answered whose store has not
	// landed (or failed) yet: the pushers' backlog, bounded with the reads
	// in flight by unstoredBound. Taken off store by store, not batch by
	// batch: a batch's stores take milliseconds, and the reads waited for
	// all of them (a 4-rank prefill chunk took 0.5 s against 0.18 s).
	unstored atomic.Int64
	pushing  int // GUARDED_BY(mu): batches a pusher took and has not settled

	// Hint accuracy, by table ID.
	layerOf []*stats.LayerCounters
	hinted  []atomic.Pointer[pageBits]
	// pushed: the pages stored into the page cache since their last fault.
	pushed []atomic.Pointer[pageBits]
}

// pageBits is one bit per file page of a table: the pages hints asked for
// that no FUSE read has asked for since. A fault on a set bit is a hint that
// did not save the fault (the page was evicted after its push, or the push
// came late). A bitmap rather than a bounded set: exact, lock-free on the
// fault path (one atomic AND), and small: allocated on a table's first hint,
// 1 bit per 4 KiB page (3.2 MiB for a 100 GiB table).
type pageBits struct{ words []atomic.Uint64 }

// New starts the prefetcher's fetch loop and pushers.
func New(cfg Config, model *backing.Model, loader PageFetcher, pusher Pusher, hot HotTier, st *stats.Counters, log *zap.Logger) *Prefetcher {
	cfg.InflightPages = max(cfg.InflightPages, 1)
	cfg.Pushers = max(cfg.Pushers, 1)
	cfg.PrefillQueuePages = max(cfg.PrefillQueuePages, 1)
	cfg.DecodeQueuePages = max(cfg.DecodeQueuePages, cache.MaxRunPages)
	if log == nil {
		log = zap.NewNop()
	}
	p := &Prefetcher{
		cfg: cfg, model: model, loader: loader, pusher: pusher, hot: hot, st: st, log: log,
		c:    newCore(coreConfig{prefillPages: cfg.PrefillQueuePages, decodeInflight: cfg.InflightPages}),
		kick: make(chan struct{}, 1), quit: make(chan struct{}), fetchDone: make(chan struct{}),
		prefillTurn: make(chan struct{}, 1),
		outReady:    make(chan struct{}, 1), pushQuit: make(chan struct{}),
	}
	p.confirmer, _ = pusher.(Confirmer)
	p.idle = sync.NewCond(&p.mu)
	p.hinted = make([]atomic.Pointer[pageBits], len(model.Tables))
	p.pushed = make([]atomic.Pointer[pageBits], len(model.Tables))
	p.layerOf = make([]*stats.LayerCounters, len(model.Tables))
	for i, t := range model.Tables {
		if p.layerOf[i] = st.Layer(t.Layer); p.layerOf[i] == nil {
			p.layerOf[i] = &stats.LayerCounters{} // not reported
		}
	}
	p.c.onDrop = func(table uint32, first, n uint64) {
		p.layerOf[table].Dropped.Add(n)
		for pg := first; pg < first+n; pg++ {
			p.clearHinted(cache.PageKey{Table: table, Page: pg}) // never pushed: a later fault is not the hint's miss
		}
	}
	go p.fetchLoop()
	for range cfg.Pushers {
		p.pushers.Add(1)
		go p.pushLoop()
	}
	return p
}

// Config is the configuration in effect.
func (p *Prefetcher) Config() Config { return p.cfg }

// Submit queues a whole frame: the pages that hold rows in every table of
// layer, on behalf of b. Rows must be in range (the hint decoder checked
// them); Submit sorts them in place. It never blocks on I/O or on queue room.
func (p *Prefetcher) Submit(class hints.Class, layer int, rows []uint64, b *Barrier) {
	p.SubmitPart(b, class, layer, rows, true)
}

// SubmitPart queues part of a frame (the rows that one write delivered);
// frameEnd says the frame is complete. Rows are deduplicated before they
// become pages, pages become runs of adjacent pages, and pages already
// pinned or in the page cache (skipPresent) cost nothing but
// a count; pages already queued or in flight are not fetched twice, b just
// waits for them too.
func (p *Prefetcher) SubmitPart(b *Barrier, class hints.Class, layer int, rows []uint64, frameEnd bool) {
	if class == hints.Prefill {
		// One prefill part is admitted at a time, all handles together: on
		// a two-core node, four handles flooding prefill frames otherwise
		// keep both cores admitting, and a decode step (its write, the
		// fetch loop, the pushers) waits for CPU behind them (measured:
		// 155 ms against 15 ms alone). Decode parts never wait here.
		p.prefillTurn <- struct{}{}
		defer func() { <-p.prefillTurn }()
	}
	tables := p.model.LayerTables(layer)
	if len(tables) > 0 {
		rows = sortedUnique(rows, tables[0].Rows)
	}
	var runs []pageRun
	for _, t := range tables {
		runs = appendRowRuns(runs, t, rows)
	}
	p.submitRuns(b, runs, class == hints.Decode, class == hints.Decode, signalOf(class), frameEnd)
}

// SubmitPages queues pages as prefill work (best effort, behind every decode
// hint; dropped oldest first when the prefill queue is full) that is offered
// to the hot tier with sig once resident. Pages already pinned or in the
// page cache are not fetched; the tier hears of them at once.
// It is how a warm restart fetches the saved hot set: with
// cache.SignalDecode the pages are admitted as decode work would be, so
// they end up pinned again.
func (p *Prefetcher) SubmitPages(keys []cache.PageKey, sig cache.Signal, b *Barrier) {
	var valid []cache.PageKey
	for _, k := range keys {
		if t := p.modelTable(k.Table); t != nil && k.Page >= t.DataPage() && k.Page < t.Pages() {
			valid = append(valid, k)
		}
	}
	slices.SortFunc(valid, func(a, b cache.PageKey) int {
		if a.Table != b.Table {
			return int(a.Table) - int(b.Table)
		}
		return compareU64(a.Page, b.Page)
	})
	valid = slices.Compact(valid)
	var runs []pageRun
	for _, k := range valid {
		if n := len(runs); n > 0 && runs[n-1].table == k.Table && runs[n-1].first+runs[n-1].n == k.Page {
			runs[n-1].n++
			continue
		}
		runs = append(runs, pageRun{table: k.Table, first: k.Page, n: 1})
	}
	p.submitRuns(b, runs, false, sig == cache.SignalDecode, sig, true)
}

// sortedUnique sorts rows and removes duplicates, in place. When the rows
// are many for the layer (a bitmap of its rows is no larger than rows
// itself), it sets a bit per row and reads the bits back in order: linear,
// where a sort of a 1 MiB write's 131,072 rows costs ~8 ms of the CPU a
// decode step needs (measured: a quarter of the daemon's CPU under four
// handles flooding 4M-row frames). Rows at or past layerRows are dropped
// (the decoder refused them already).
func sortedUnique(rows []uint64, layerRows uint64) []uint64 {
	words := (layerRows + 63) / 64
	if words == 0 || words > uint64(len(rows)) {
		slices.Sort(rows)
		return slices.Compact(rows)
	}
	bits := make([]uint64, words)
	for _, r := range rows {
		if r < layerRows {
			bits[r/64] |= 1 << (r % 64)
		}
	}
	out := rows[:0]
	for w, word := range bits {
		for word != 0 {
			out = append(out, uint64(w)*64+uint64(bits64.TrailingZeros64(word)))
			word &= word - 1
		}
	}
	return out
}

func compareU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// appendRowRuns appends the runs of file pages of t that hold the sorted,
// unique rows: adjacent and shared pages merge, so a frame costs a run per
// stretch of pages, not an entry per row.
func appendRowRuns(runs []pageRun, t *backing.Table, rows []uint64) []pageRun {
	start := len(runs)
	for _, r := range rows {
		if r >= t.Rows {
			continue
		}
		first, last := t.RowPages(r)
		if n := len(runs); n > start {
			cur := &runs[n-1]
			if end := cur.first + cur.n; first <= end {
				if last >= end {
					cur.n = last + 1 - cur.first
				}
				continue
			}
		}
		runs = append(runs, pageRun{table: t.ID, first: first, n: last + 1 - first})
	}
	return runs
}

// Residency lookups: runs closer than spanGap pages share one mincore call
// (a call's cost is mostly its entry; a page's, a page cache lookup), and no
// call covers more than maxSpan pages (its vector is that many bytes).
const (
	spanGap = 32
	maxSpan = 4096
)

// residency is a window of a table's pages whose page cache residency one
// mincore call found (HotTier.ResidentRun).
type residency struct {
	table    uint32
	first, n uint64
	known    bool // false: the call could not tell (no page counts as present)
	vec      []byte
}

// present reports whether page pg of runs[i] is in the page cache, looking
// up a new window, from pg over the runs that follow within spanGap, when
// pg is outside the current one.
func (w *residency) present(hot HotTier, runs []pageRun, i int, pg uint64) bool {
	r := runs[i]
	if w.n == 0 || r.table != w.table || pg < w.first || pg >= w.first+w.n {
		end := r.first + r.n
		k := i + 1
		for ; k < len(runs) && runs[k].table == r.table && runs[k].first < end+spanGap && runs[k].first+runs[k].n-pg <= maxSpan; k++ {
			end = runs[k].first + runs[k].n
		}
		if k-i > 1 && hot.LookupPerRun(uint64(k-i), end-pg) {
			end = r.first + r.n // this run alone
		}
		w.table, w.first, w.n = r.table, pg, min(end-pg, maxSpan)
		if w.vec == nil {
			w.vec = make([]byte, maxSpan)
		}
		w.known = hot.ResidentRun(r.table, pg, w.n, w.vec[:w.n])
	}
	return w.known && w.vec[pg-w.first]&1 != 0
}

// skipPresent takes out of runs the pages the hot tier has pinned and those
// already in the page cache (a reader faulted them, or an earlier hint
// pushed them): fetching them would read and store them again, where
// fadvise(WILLNEED) would do nothing. It returns what is left and the pages
// it took out, pinned and only cached (the tier hears of them as the hint's
// accesses). Cached pages are marked hinted: one evicted before
// its reader gets there is a refault.
//
// Decode work looks up too. A decode step alone, from a dropped cache,
// names few cached pages that are not pinned (13 of 14,480 in the bench's
// decode phase), but in a serving loop under a memory limit the tier holds
// only part of decode's working set and the rest lives in the page cache:
// 78% of a step's pages were resident before it, and the barriers had
// fetched 132 pages a step (v3: 60 cold reads), each a backing read the
// step waited for. A lookup costs ~1 µs a window (runs within spanGap
// share one) and 40 ns a page; a cold read it saves, 35-40 µs.
func (p *Prefetcher) skipPresent(runs []pageRun) (kept []pageRun, pinned, cached []cache.PageKey) {
	kept = runs[:0:0]
	var w residency
	for i, r := range runs {
		start := r.first
		for pg := r.first; pg < r.first+r.n; pg++ {
			k := cache.PageKey{Table: r.table, Page: pg}
			switch {
			case p.hot.Pinned(k):
				pinned = append(pinned, k)
			case w.present(p.hot, runs, i, pg):
				cached = append(cached, k)
				p.markHinted(r.table, pg, 1)
			default:
				continue
			}
			if pg > start {
				kept = append(kept, pageRun{table: r.table, first: start, n: pg - start})
			}
			start = pg + 1
		}
		if end := r.first + r.n; end > start {
			kept = append(kept, pageRun{table: r.table, first: start, n: end - start})
		}
	}
	return kept, pinned, cached
}

// submitRuns takes out the pages the hot tier has pinned and those already
// in the page cache, then admits the rest.
func (p *Prefetcher) submitRuns(b *Barrier, runs []pageRun, decode, admitDecode bool, sig cache.Signal, frameEnd bool) {
	start := time.Now()
	var pinned, cached []cache.PageKey
	if p.hot != nil {
		runs, pinned, cached = p.skipPresent(runs)
		n := uint64(len(cached))
		p.st.PrefetchPagesCached.Add(n)
		if decode {
			p.st.PrefetchDecodePagesCached.Add(n)
		}
		if hits := append(pinned, cached...); len(hits) > 0 {
			p.hot.Admit(hits, sig)
		}
	}
	for _, r := range runs {
		p.markHinted(r.table, r.first, r.n)
	}

	// Admit a slice of pages per hold of p.mu: a prefill part names tens of
	// thousands of pages, and a decode step, a fault or the loops must not
	// wait behind all of them (measured: four handles flooding 4M-row
	// frames held one lock nearly all the time).
	p.mu.Lock()
	b.p.CompareAndSwap(nil, p)
	seq := p.c.submission(b)
	p.c.present(b, pinned, cached)
	var buf []pageRun
	var yielded time.Duration
	for len(runs) > 0 {
		if busy := p.c.decodeBusy(); busy != nil && !decode {
			// Never more waiting than admitting: a prefill write takes at
			// most twice its own time, however busy decode keeps the node.
			if allow := min(decodeYield, time.Since(start)-2*yielded); allow > 0 {
				p.mu.Unlock()
				yielded += p.yieldToDecode(busy, allow)
				p.mu.Lock()
			}
		}
		var slice []pageRun
		slice, runs = splitRuns(runs, admitSlice, &buf)
		if p.closed {
			for _, r := range slice {
				b.status.Pages += r.n
				b.fail(r.n, ErrStopped)
			}
		} else {
			p.c.admit(b, seq, slice, decode, admitDecode)
		}
		if len(runs) > 0 {
			p.publishLocked()
			p.mu.Unlock()
			p.wakeFetch()
			runtime.Gosched()
			p.mu.Lock()
		}
	}
	p.c.endSubmission(b, seq, frameEnd)
	p.publishLocked()
	p.mu.Unlock()
	if decode {
		p.claimAndFetch()
		return
	}
	p.wakeFetch()
}

// DecodeBusy returns nil when no decode work is pending, else a channel
// closed once none is: the hot tier holds its pinning back meanwhile
// (cache.HotCache.SetDemand).
func (p *Prefetcher) DecodeBusy() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.c.decodeBusy()
}

// admitSlice is how many pages submitRuns admits per hold of p.mu.
const admitSlice = 1024

// decodeYield bounds how long prefill admission waits, per slice, for the
// decode work pending to settle. On a node with two cores the decode
// step's path (the fetch loop, the read engine's completions, the pushers,
// the barrier's reply) needs a core at every hop, and prefill admission
// took them: a 72-row step beside four handles flooding 4M-row frames took
// 2.2-4.3× its time alone, and the scheduler-latency profile had the read
// engine's completion thread waiting for a core 35% of the time; with the
// wait, 0.8-1.1× (BenchmarkHintsDecodeBesidePrefillFlood, 500 µs, 1 ms
// and 2 ms alike). Bounded twice, so that back-to-back decode steps slow
// prefill admission but never stop it: a slice (1024 pages) per 500 µs at
// most, and never more waiting than admitting in one part, so a prefill
// write takes at most about twice its own time.
const decodeYield = 500 * time.Microsecond

// yieldToDecode waits until busy is closed (no decode work pending), for
// at most d, or until the prefetcher closes, and returns how long it
// waited.
func (p *Prefetcher) yieldToDecode(busy <-chan struct{}, d time.Duration) time.Duration {
	start := time.Now()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-busy:
	case <-t.C:
	case <-p.quit:
	}
	return time.Since(start)
}

// splitRuns cuts the first n pages off runs. A run cut in two is cut in
// place (rest starts with its tail), its head built in buf: nothing is
// copied but the head, where copying the rest at every cut made a part of
// many runs quadratic.
func splitRuns(runs []pageRun, n uint64, buf *[]pageRun) (head, rest []pageRun) {
	for i, r := range runs {
		if r.n >= n {
			if r.n == n {
				return runs[:i+1], runs[i+1:]
			}
			head = append(append((*buf)[:0], runs[:i]...), pageRun{table: r.table, first: r.first, n: n})
			*buf = head
			runs[i] = pageRun{table: r.table, first: r.first + n, n: r.n - n}
			return head, runs[i:]
		}
		n -= r.n
	}
	return runs, nil
}

// publishLocked moves the core's tallies to the counters.
//
// REQUIRES(p.mu)
func (p *Prefetcher) publishLocked() {
	if p.c.queued > 0 {
		p.st.PrefetchPagesQueued.Add(p.c.queued)
		p.c.queued = 0
	}
	if p.c.dropped > 0 {
		p.st.PrefetchPagesDropped.Add(p.c.dropped)
		p.c.dropped = 0
	}
	if p.c.throttledDrops > 0 {
		p.st.PrefetchPagesThrottled.Add(p.c.throttledDrops)
		p.c.throttledDrops = 0
	}
}

// modelTable returns the model's table id, or nil.
func (p *Prefetcher) modelTable(id uint32) *backing.Table {
	if int(id) >= len(p.model.Tables) {
		return nil
	}
	return p.model.Tables[id]
}

// Faulted is the one receiver of "FUSE reads asked for these pages" (fs
// calls it from the Read handler once the pages are loaded): it decides
// what a fault means, and every counter it feeds has no other writer.
//
//   - The hot tier's own populate faults (it faults a page in to pin it)
//     are no demand: they are dropped first.
//   - A page whose prefetch is still queued or in flight is late
//     (prefetch_late). A queued one has its fetch cancelled, since the
//     fault reads it (fetching it too would read it twice); it settles as
//     resident once a pusher has confirmed it in the page cache (the
//     fault's reply reaches the kernel after this call). An in-flight one
//     is the same read: the loader handed the fault the prefetch's read,
//     or the prefetch the fault's, and its push waits for the fault's reply
//     (the kernel holds the page's lock until then).
//   - A page a hint asked for since its last fault counts once as
//     refaulted in its layer (refaulted).
//   - The hot tier hears of the rest as fault hits (cache.SignalFault),
//     and of a late page only so: its prefetch's settle offers it nothing.
//
// It never blocks.
func (p *Prefetcher) Faulted(keys []cache.PageKey) {
	if p.hot != nil && slices.ContainsFunc(keys, p.hot.OwnFault) {
		keys = slices.DeleteFunc(slices.Clone(keys), p.hot.OwnFault)
		if len(keys) == 0 {
			return
		}
	}
	p.mu.Lock()
	confirm, keys, late := p.c.faulted(keys)
	p.mu.Unlock()
	if late > 0 {
		p.st.PrefetchLate.Add(late)
	}
	if len(confirm) > 0 {
		p.omu.Lock()
		for _, k := range confirm {
			p.out = append(p.out, outcome{run: cache.Run{Table: k.Table, First: k.Page, N: 1}, confirm: true})
		}
		p.omu.Unlock()
		p.signalPushers()
	}
	p.refaulted(keys)
	if p.hot != nil {
		p.hot.Admit(keys, cache.SignalFault)
	}
}

// refaulted counts, per layer, the pages of keys a hint asked for since
// their last fault, once each, and the pages of keys pushed since their
// last fault (prefetch_pushed_evicted: a fault on a pushed page means the
// page cache let it go before the reader got there, or after it read it
// once and came back unhinted). Lock-free: it runs in the Read handler.
func (p *Prefetcher) refaulted(keys []cache.PageKey) {
	for _, k := range keys {
		if p.clearHinted(k) {
			p.layerOf[k.Table].Refaulted.Add(1)
		}
		if clearBit(p.pushed, k) {
			p.st.PrefetchPushedEvicted.Add(1)
		}
	}
}

// markHinted sets the hinted bits of pages [first, first+n) of table.
func (p *Prefetcher) markHinted(table uint32, first, n uint64) {
	p.markBits(p.hinted, table, first, n)
}

// clearHinted clears k's hinted bit and reports whether it was set.
func (p *Prefetcher) clearHinted(k cache.PageKey) bool { return clearBit(p.hinted, k) }

// markBits sets the bits of pages [first, first+n) of table in the bitmaps
// of maps, allocating the table's bitmap on first use.
func (p *Prefetcher) markBits(maps []atomic.Pointer[pageBits], table uint32, first, n uint64) {
	if int(table) >= len(maps) {
		return
	}
	bits := maps[table].Load()
	if bits == nil {
		fresh := &pageBits{words: make([]atomic.Uint64, (p.model.Tables[table].Pages()+63)/64)}
		if !maps[table].CompareAndSwap(nil, fresh) {
			bits = maps[table].Load()
		} else {
			bits = fresh
		}
	}
	for pg := first; pg < first+n; pg++ {
		if w := pg / 64; w < uint64(len(bits.words)) {
			bits.words[w].Or(1 << (pg % 64))
		}
	}
}

// clearBit clears k's bit in the bitmaps of maps and reports whether it
// was set.
func clearBit(maps []atomic.Pointer[pageBits], k cache.PageKey) bool {
	if int(k.Table) >= len(maps) {
		return false
	}
	bits := maps[k.Table].Load()
	if bits == nil || k.Page/64 >= uint64(len(bits.words)) {
		return false
	}
	mask := uint64(1) << (k.Page % 64)
	return bits.words[k.Page/64].And(^mask)&mask != 0
}

// Close stops the prefetcher. Queued work fails (its handles hear it); work
// in flight finishes first.
func (p *Prefetcher) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.c.drain()
	p.mu.Unlock()
	close(p.quit)
	<-p.fetchDone
	p.mu.Lock()
	for p.c.inflight > 0 || p.c.pages.len() > 0 || p.pushing > 0 {
		p.idle.Wait()
	}
	p.mu.Unlock()
	close(p.pushQuit)
	p.pushers.Wait()
}

func signalOf(c hints.Class) cache.Signal {
	if c == hints.Decode {
		return cache.SignalDecode
	}
	return cache.SignalPrefill
}

// Package prefetch turns hints into resident pages: it queues the pages of
// hinted rows (decode work before prefill work), fetches them through the
// shared page loader at the backing queue depth, and pushes them into the
// kernel page cache through a Pusher, so the gather that follows never leaves
// memory. It knows nothing of FUSE: fs implements Pusher.
package prefetch

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// ErrNotLookedUp is what a Pusher returns when the kernel does not know the
// file's inode yet (NOTIFY_STORE answers ENOENT before the first lookup). No
// reader can have the page mapped then, so the page is skipped, not failed.
var ErrNotLookedUp = errors.New("inode not looked up by the kernel yet")

// Pusher stores data into the page cache of table's file at byte offset off.
// off is page-aligned and data is whole pages, except that the last page of
// the file may be short. Store must not be called from a FUSE Read handler
// (design.md: the folio being read is locked, the store would wait forever);
// the prefetcher only calls it from its own pusher goroutines.
type Pusher interface {
	Store(table uint32, off int64, data []byte) error
}

// PageLoader is the shared read-through loader (cache.Loader).
type PageLoader interface {
	Load(table uint32, first, n uint64, origin cache.Origin) ([][]byte, error)
}

// HotTier is the pinned hot tier, when there is one.
type HotTier interface {
	Pinned(k cache.PageKey) bool
	Admit(keys []cache.PageKey, sig cache.Signal)
}

// Config sizes the prefetcher.
type Config struct {
	// Workers is the number of fetches in flight; match the backing queue
	// depth, so that hints can keep the disk's queue full.
	Workers int
	// Pushers store fetched pages; a store costs ~2-4 µs a page (measured),
	// so a few keep up with a disk's IOPS.
	Pushers int
	// PrefillQueuePages bounds the queued prefill pages; past it the oldest
	// prefill work is dropped. Prefill hints are best effort.
	PrefillQueuePages int
	// DecodeQueuePages bounds the queued decode pages; past it, hinting
	// blocks until the workers catch up (decode work is never dropped).
	DecodeQueuePages int
}

// DefaultConfig is the configuration for a backing queue depth.
func DefaultConfig(queueDepth int) Config {
	return Config{Workers: queueDepth, Pushers: 4, PrefillQueuePages: 1 << 18, DecodeQueuePages: 1 << 16}
}

// Prefetcher schedules, fetches and pushes hinted pages.
type Prefetcher struct {
	cfg    Config
	model  *backing.Model
	loader PageLoader
	pusher Pusher
	hot    HotTier // nil: no hot tier
	st     *stats.Counters
	log    *zap.Logger

	mu       sync.Mutex
	work     *sync.Cond                   // signalled when a task is queued or on close
	room     *sync.Cond                   // signalled when decode queue space frees up
	decode   taskQueue                    // GUARDED_BY(mu)
	prefill  taskQueue                    // GUARDED_BY(mu)
	pages    map[cache.PageKey]*pageState // GUARDED_BY(mu): queued or in-flight pages
	closed   bool                         // GUARDED_BY(mu)
	pushes   chan pushJob
	workers  sync.WaitGroup
	pushersW sync.WaitGroup

	// Hint accuracy, by table ID.
	layerOf []*stats.LayerCounters
	hinted  []atomic.Pointer[pageBits]
}

// pageBits is one bit per file page of a table: the pages hints asked for
// that no FUSE read has asked for since. A fault on a set bit is a hint that
// did not save the fault (the page was evicted after its push, or the push
// came late). A bitmap rather than a bounded set: exact, lock-free on the
// fault path (one atomic AND), and small: allocated on a table's first hint,
// 1 bit per 4 KiB page (3.2 MiB for a 100 GiB table).
type pageBits struct{ words []atomic.Uint64 }

// pageState is one queued or in-flight page and who waits for it.
type pageState struct {
	queued   int  // queued tasks that list this page
	inflight bool // a worker has claimed it
	decode   bool // a decode hint asked for it: admit it to the hot tier as decode
	waiters  []*Barrier
}

// task is a run of adjacent pages of one table, all asked for by one hint.
type task struct {
	table uint32
	first uint64
	n     uint64
}

type pushJob struct {
	table uint32
	first uint64
	pages [][]byte
	err   error
}

// New starts the prefetcher's workers and pushers.
func New(cfg Config, model *backing.Model, loader PageLoader, pusher Pusher, hot HotTier, st *stats.Counters, log *zap.Logger) *Prefetcher {
	cfg.Workers = max(cfg.Workers, 1)
	cfg.Pushers = max(cfg.Pushers, 1)
	cfg.PrefillQueuePages = max(cfg.PrefillQueuePages, cache.MaxRunPages)
	cfg.DecodeQueuePages = max(cfg.DecodeQueuePages, cache.MaxRunPages)
	if log == nil {
		log = zap.NewNop()
	}
	p := &Prefetcher{
		cfg: cfg, model: model, loader: loader, pusher: pusher, hot: hot, st: st, log: log,
		pages:  map[cache.PageKey]*pageState{},
		pushes: make(chan pushJob, 2*cfg.Workers),
	}
	p.work = sync.NewCond(&p.mu)
	p.room = sync.NewCond(&p.mu)
	p.hinted = make([]atomic.Pointer[pageBits], len(model.Tables))
	p.layerOf = make([]*stats.LayerCounters, len(model.Tables))
	for i, t := range model.Tables {
		if p.layerOf[i] = st.Layer(t.Layer); p.layerOf[i] == nil {
			p.layerOf[i] = &stats.LayerCounters{} // not reported
		}
	}
	for range cfg.Workers {
		p.workers.Add(1)
		go p.worker()
	}
	for range cfg.Pushers {
		p.pushersW.Add(1)
		go p.pushLoop()
	}
	return p
}

// Submit queues the pages that hold rows in every table of layer, on behalf
// of the control handle whose barrier is b. Rows must be in range (the hint
// decoder checked them). Pages already pinned cost nothing; pages already
// queued or in flight are not fetched twice, b just waits for them too.
// A decode submit may block while the decode queue is full.
func (p *Prefetcher) Submit(class hints.Class, layer int, rows []uint64, b *Barrier) {
	for _, t := range p.model.LayerTables(layer) {
		p.submitTable(class, t, rows, b)
	}
}

func (p *Prefetcher) submitTable(class hints.Class, t *backing.Table, rows []uint64, b *Barrier) {
	pages := make([]uint64, 0, len(rows))
	for _, r := range rows {
		if r >= t.Rows {
			continue
		}
		first, last := t.RowPages(r)
		for pg := first; pg <= last; pg++ {
			pages = append(pages, pg)
		}
	}
	slices.Sort(pages)
	pages = slices.Compact(pages)

	// Pinned pages are resident already: no I/O, no store, nothing to wait
	// for; the tier only hears that they were asked for again.
	if p.hot != nil {
		var hits []cache.PageKey
		pages = slices.DeleteFunc(pages, func(pg uint64) bool {
			k := cache.PageKey{Table: t.ID, Page: pg}
			if p.hot.Pinned(k) {
				hits = append(hits, k)
				return true
			}
			return false
		})
		if len(hits) > 0 {
			p.hot.Admit(hits, signalOf(class))
		}
	}
	p.enqueue(class, class == hints.Decode, t.ID, pages, b)
}

// SubmitPages queues pages as prefill work (best effort, behind every decode
// hint; dropped oldest first when the prefill queue is full) that is offered
// to the hot tier with sig once resident. Pages already pinned are skipped
// and not waited for. It is how a warm restart fetches the saved hot set:
// with cache.SignalDecode the pages are admitted as decode work would be,
// so they end up pinned again.
func (p *Prefetcher) SubmitPages(keys []cache.PageKey, sig cache.Signal, b *Barrier) {
	byTable := map[uint32][]uint64{}
	for _, k := range keys {
		t := p.loaderTable(k.Table)
		if t == nil || k.Page < t.DataPage() || k.Page >= t.Pages() {
			continue
		}
		if p.hot != nil && p.hot.Pinned(k) {
			continue
		}
		byTable[k.Table] = append(byTable[k.Table], k.Page)
	}
	for table, pages := range byTable {
		slices.Sort(pages)
		p.enqueue(hints.Prefill, sig == cache.SignalDecode, table, slices.Compact(pages), b)
	}
}

func (p *Prefetcher) loaderTable(id uint32) *backing.Table {
	if int(id) >= len(p.model.Tables) {
		return nil
	}
	return p.model.Tables[id]
}

// enqueue queues sorted, unique pages of table on class's queue for b;
// admitDecode: admit them to the hot tier as decode work once resident.
func (p *Prefetcher) enqueue(class hints.Class, admitDecode bool, table uint32, pages []uint64, b *Barrier) {
	if len(pages) == 0 {
		return
	}
	p.markHinted(table, pages)
	// A prefill chunk names tens of thousands of pages; take the lock a slice
	// at a time, so that a fault (Queued) or an idle worker never waits
	// behind a whole frame's bookkeeping.
	for len(pages) > 0 {
		n := min(len(pages), enqueueSlice)
		if !p.enqueueLocked(class, admitDecode, table, pages[:n], b) {
			return
		}
		pages = pages[n:]
	}
}

// enqueueSlice is how many pages enqueue handles per hold of p.mu.
const enqueueSlice = 1024

// enqueueLocked is enqueue for one slice of pages, under p.mu; false once
// the prefetcher is closed.
func (p *Prefetcher) enqueueLocked(class hints.Class, admitDecode bool, table uint32, pages []uint64, b *Barrier) bool {
	q := &p.prefill
	if class == hints.Decode {
		q = &p.decode
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	// Only pages not already on their way need a task.
	fresh := pages[:0]
	for _, pg := range pages {
		k := cache.PageKey{Table: table, Page: pg}
		ps := p.pages[k]
		if ps == nil {
			ps = &pageState{}
			p.pages[k] = ps
		}
		ps.waiters = append(ps.waiters, b)
		if admitDecode {
			ps.decode = true
		}
		// A page queued as prefill gets a decode task too, so it is not
		// stuck behind prefill work; an in-flight page needs nothing.
		if !ps.inflight && (ps.queued == 0 || class == hints.Decode) {
			ps.queued++
			fresh = append(fresh, pg)
		}
	}
	b.add(len(pages))
	// Wake the workers once per slice, not once per task: on two cores a
	// wake-up per page costs more than the scheduling itself (measured: the
	// per-task Signal halved the rows/s of BenchmarkPrefillFrame).
	defer p.work.Broadcast()
	for _, tk := range runs(table, fresh) {
		if class == hints.Decode {
			for p.decode.pages+int(tk.n) > p.cfg.DecodeQueuePages && !p.closed {
				p.work.Broadcast()
				p.room.Wait()
			}
		} else {
			for p.prefill.pages+int(tk.n) > p.cfg.PrefillQueuePages {
				p.dropOldestPrefill()
			}
		}
		q.push(tk)
		p.st.PrefetchPagesQueued.Add(tk.n)
	}
	return true
}

// runs groups sorted pages into tasks of adjacent pages.
func runs(table uint32, pages []uint64) []task {
	var out []task
	for i := 0; i < len(pages); {
		j := i + 1
		for j < len(pages) && pages[j] == pages[j-1]+1 && j-i < cache.MaxRunPages {
			j++
		}
		out = append(out, task{table: table, first: pages[i], n: uint64(j - i)})
		i = j
	}
	return out
}

// dropOldestPrefill drops the oldest queued prefill task. Its pages that no
// other task still lists are settled without data: their waiters stop
// waiting (prefill is best effort) and the drop is counted.
//
// REQUIRES(p.mu)
func (p *Prefetcher) dropOldestPrefill() {
	tk, ok := p.prefill.pop()
	if !ok {
		return
	}
	for pg := tk.first; pg < tk.first+tk.n; pg++ {
		k := cache.PageKey{Table: tk.table, Page: pg}
		ps := p.pages[k]
		if ps == nil || ps.inflight {
			continue
		}
		ps.queued--
		if ps.queued > 0 {
			continue
		}
		delete(p.pages, k)
		p.st.PrefetchPagesDropped.Add(1)
		p.layerOf[k.Table].Dropped.Add(1)
		p.clearHinted(k) // never pushed: a later fault is not the hint's miss
		for _, w := range ps.waiters {
			w.done(nil)
		}
	}
}

func (p *Prefetcher) worker() {
	defer p.workers.Done()
	for {
		p.mu.Lock()
		var tk task
		var ok bool
		for {
			if tk, ok = p.decode.pop(); ok {
				p.room.Broadcast()
				break
			}
			if tk, ok = p.prefill.pop(); ok {
				break
			}
			if p.closed {
				p.mu.Unlock()
				return
			}
			p.work.Wait()
		}
		// Claim the pages nobody has fetched or claimed meanwhile.
		claimed := make([]bool, tk.n)
		for i := range claimed {
			ps := p.pages[cache.PageKey{Table: tk.table, Page: tk.first + uint64(i)}]
			if ps != nil && !ps.inflight {
				ps.inflight, claimed[i] = true, true
			}
		}
		p.mu.Unlock()

		for i := 0; i < len(claimed); {
			if !claimed[i] {
				i++
				continue
			}
			j := i + 1
			for j < len(claimed) && claimed[j] {
				j++
			}
			first := tk.first + uint64(i)
			pages, err := p.loader.Load(tk.table, first, uint64(j-i), cache.OriginPrefetch)
			p.dispatch(tk.table, first, pages, err)
			i = j
		}
	}
}

// dispatch hands the pages that loaded to the pushers, in runs of adjacent
// pages, and settles the failed ones: one bad page fails only itself.
func (p *Prefetcher) dispatch(table uint32, first uint64, pages [][]byte, err error) {
	for i := 0; i < len(pages); {
		j := i + 1
		for j < len(pages) && (pages[j] == nil) == (pages[i] == nil) {
			j++
		}
		if pages[i] == nil {
			p.settle(table, first+uint64(i), uint64(j-i), err)
		} else {
			p.pushes <- pushJob{table: table, first: first + uint64(i), pages: pages[i:j]}
		}
		i = j
	}
}

// pushLoop stores fetched runs into the page cache: one store per run of
// adjacent pages (merging saves a notify round trip per page).
func (p *Prefetcher) pushLoop() {
	defer p.pushersW.Done()
	var buf []byte
	for job := range p.pushes {
		data := job.pages[0]
		if len(job.pages) > 1 {
			buf = buf[:0]
			for _, pg := range job.pages {
				buf = append(buf, pg...)
			}
			data = buf
		}
		off := int64(job.first) * cache.PageSize
		err := p.pusher.Store(job.table, off, data)
		n := uint64(len(job.pages))
		switch {
		case err == nil:
			p.st.PrefetchPagesStored.Add(n)
			p.layerOf[job.table].Pushed.Add(n)
		case errors.Is(err, ErrNotLookedUp):
			p.st.PrefetchStoreErrors.Add(n)
			err = nil
		default:
			p.st.PrefetchStoreErrors.Add(n)
			p.log.Warn("page cache store failed", zap.Uint32("table", job.table), zap.Int64("offset", off), zap.Error(err))
		}
		p.settle(job.table, job.first, n, err)
	}
}

// settle completes pages [first, first+n) of table: their waiters are told,
// and stored pages are offered to the hot tier.
func (p *Prefetcher) settle(table uint32, first, n uint64, err error) {
	var decodeKeys, prefillKeys []cache.PageKey
	var waiters []*Barrier
	p.mu.Lock()
	for pg := first; pg < first+n; pg++ {
		k := cache.PageKey{Table: table, Page: pg}
		ps := p.pages[k]
		if ps == nil {
			continue
		}
		delete(p.pages, k)
		waiters = append(waiters, ps.waiters...)
		if ps.decode {
			decodeKeys = append(decodeKeys, k)
		} else {
			prefillKeys = append(prefillKeys, k)
		}
	}
	p.mu.Unlock()
	// Admit before releasing the waiters: once a barrier returns, the tier
	// has heard of its pages (a warm restart flushes the tier's pin queue
	// right after its barrier and counts what is pinned). Admit only
	// queues work, it never waits.
	if p.hot != nil && err == nil {
		if len(decodeKeys) > 0 {
			p.hot.Admit(decodeKeys, cache.SignalDecode)
		}
		if len(prefillKeys) > 0 {
			p.hot.Admit(prefillKeys, cache.SignalPrefill)
		}
	}
	for _, w := range waiters {
		w.done(err)
	}
}

// ServedByFault tells the prefetcher that a FUSE read is serving keys. A page
// still waiting in a queue is late: the fault reads it, so the prefetch
// would read it a second time. Its queued work is cancelled and its waiters
// released (the page is resident once the read returns); it returns how many
// pages were late this way. Pages already in flight are counted by the
// loader, which hands the fault the prefetch's read.
func (p *Prefetcher) ServedByFault(keys []cache.PageKey) (late int) {
	var waiters []*Barrier
	p.mu.Lock()
	for _, k := range keys {
		ps := p.pages[k]
		if ps == nil || ps.inflight {
			continue
		}
		delete(p.pages, k) // the queued task finds no state and skips the page
		waiters = append(waiters, ps.waiters...)
		late++
	}
	p.mu.Unlock()
	for _, w := range waiters {
		w.done(nil)
	}
	return late
}

// Refaulted tells the hint accounting that FUSE reads asked for keys: each
// page a hint asked for since its last fault counts once as refaulted in its
// layer. Lock-free; safe in a FUSE Read handler.
func (p *Prefetcher) Refaulted(keys []cache.PageKey) {
	for _, k := range keys {
		if p.clearHinted(k) {
			p.layerOf[k.Table].Refaulted.Add(1)
		}
	}
}

// markHinted sets the bits of pages of table, allocating the table's bitmap
// on its first hint.
func (p *Prefetcher) markHinted(table uint32, pages []uint64) {
	if int(table) >= len(p.hinted) {
		return
	}
	bits := p.hinted[table].Load()
	if bits == nil {
		fresh := &pageBits{words: make([]atomic.Uint64, (p.model.Tables[table].Pages()+63)/64)}
		if !p.hinted[table].CompareAndSwap(nil, fresh) {
			bits = p.hinted[table].Load()
		} else {
			bits = fresh
		}
	}
	for _, pg := range pages {
		if w := pg / 64; w < uint64(len(bits.words)) {
			bits.words[w].Or(1 << (pg % 64))
		}
	}
}

// clearHinted clears k's bit and reports whether it was set.
func (p *Prefetcher) clearHinted(k cache.PageKey) bool {
	if int(k.Table) >= len(p.hinted) {
		return false
	}
	bits := p.hinted[k.Table].Load()
	if bits == nil || k.Page/64 >= uint64(len(bits.words)) {
		return false
	}
	mask := uint64(1) << (k.Page % 64)
	return bits.words[k.Page/64].And(^mask)&mask != 0
}

// Close stops the workers and pushers. Queued work is dropped and its
// waiters released; work in flight finishes first.
func (p *Prefetcher) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	for {
		if _, ok := p.decode.pop(); !ok {
			break
		}
	}
	for p.prefill.pages > 0 {
		p.dropOldestPrefill()
	}
	var orphans []*Barrier
	for k, ps := range p.pages {
		if !ps.inflight {
			orphans = append(orphans, ps.waiters...)
			delete(p.pages, k)
		}
	}
	p.work.Broadcast()
	p.room.Broadcast()
	p.mu.Unlock()
	for _, w := range orphans {
		w.done(errClosed)
	}
	p.workers.Wait()
	close(p.pushes)
	p.pushersW.Wait()
}

var errClosed = errors.New("prefetcher closed")

func signalOf(c hints.Class) cache.Signal {
	if c == hints.Decode {
		return cache.SignalDecode
	}
	return cache.SignalPrefill
}

// taskQueue is a FIFO of tasks that counts its pages.
type taskQueue struct {
	tasks []task
	head  int
	pages int
}

func (q *taskQueue) push(t task) {
	q.tasks = append(q.tasks, t)
	q.pages += int(t.n)
}

func (q *taskQueue) pop() (task, bool) {
	if q.head == len(q.tasks) {
		return task{}, false
	}
	t := q.tasks[q.head]
	q.head++
	q.pages -= int(t.n)
	// Reclaim the consumed prefix once it is half the slice, so a long-lived
	// queue does not grow without bound.
	if q.head > 1024 && q.head*2 >= len(q.tasks) {
		q.tasks = append(q.tasks[:0], q.tasks[q.head:]...)
		q.head = 0
	}
	return t, true
}

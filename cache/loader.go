package cache

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// MaxRunPages caps one coalesced backing read (1 MiB): large enough to keep a
// disk streaming, small enough that one run does not hold a queue slot for
// long.
const MaxRunPages = 256

// NegativeTTL is how long a page whose backing read failed fails again at
// once, without a new read: a reader that retries a bad page (a fault
// restarts when a signal interrupts it) must not turn one bad sector into
// thousands of reads (seen: ~20K FUSE and backing reads in 100 s).
const NegativeTTL = time.Second

// maxNegative bounds the pages remembered as failed.
const maxNegative = 1 << 16

// Origin says who asked for a page: the reads of a fault and of a decode hint
// are demand reads (sources with lanes serve them first, and hedge them). Whether a fault caught a prefetch (prefetch_late) is
// the prefetcher's to count (prefetch.Prefetcher.Faulted), not the
// loader's.
type Origin uint8

const (
	// OriginFault is a FUSE read: a reader is blocked on the page.
	OriginFault Origin = iota
	// OriginPrefetch is prefill hint work (and the warm-up): due by a
	// deadline, not awaited by a reader yet.
	OriginPrefetch
	// OriginDecode is a decode hint's work: the step's gather follows its
	// barrier at once, so a reader is as good as blocked on it.
	OriginDecode
)

// Run is file pages [First, First+N) of table Table.
type Run struct {
	Table uint32
	First uint64
	N     uint64
}

// FetchDone receives the outcome of part of a fetch: the pages of run r
// (one slice per page, the last page of a file may be short), or err for
// all of them (pages is nil then). It is called from the read engine's
// completion goroutine, or from Fetch itself: it must not block.
type FetchDone func(r Run, pages [][]byte, err error)

// Loader is the read-through page loader of every table file: the fault path
// and the prefetch path both go through it, so a page is read from backing
// once even when a fault and a hint want it at the same moment
// (singleflight per page). It keeps no data of its own: the kernel page
// cache is the cache. The loader owns reads in flight, holds the pages a
// prefetch fetched until their store has landed (FetchHeld, Release), and
// remembers for a second the pages that failed.
type Loader struct {
	src    backing.Reader
	tables []*backing.Table
	st     *stats.Counters
	now    func() time.Time // tests move the clock

	mu       sync.Mutex
	flights  map[PageKey]*flight     // GUARDED_BY(mu)
	held     map[PageKey][]byte      // GUARDED_BY(mu): fetched by FetchHeld, not yet Released
	negative map[PageKey]negativeHit // GUARDED_BY(mu)
	negOrder negativeOrder           // GUARDED_BY(mu): negative's keys, oldest first

	inline atomic.Int32 // faults reading on their own goroutine now

	seen *Seen // nil: pages read again are not counted (SetSeen)
}

// SetSeen counts, in backing_pages_again, the pages read from backing that
// s says this daemon had already put in the page cache. Call it before
// the loader is used.
func (l *Loader) SetSeen(s *Seen) { l.seen = s }

// maxInline bounds the faults that read on their own goroutine (a thread
// each, blocked in pread); more at once (a WILLNEED burst, many gathering
// threads) go through the read engine, batched, their goroutines parked.
var maxInline = int32(max(2, runtime.NumCPU()))

// flight is one page being read, and the fetches that wait for it.
type flight struct {
	waiters []*fetch
}

// fetch is one run of one Fetch call.
type fetch struct {
	run  Run
	done FetchDone
	hold bool // FetchHeld: its pages stay in Loader.held until Release
}

type negativeHit struct {
	err   error
	until time.Time
}

// NewLoader reads the pages of tables through src.
func NewLoader(src backing.Reader, tables []*backing.Table, st *stats.Counters) *Loader {
	return &Loader{src: src, tables: tables, st: st, now: time.Now,
		flights: map[PageKey]*flight{}, held: map[PageKey][]byte{}, negative: map[PageKey]negativeHit{}}
}

// Table returns table id, or nil.
func (l *Loader) Table(id uint32) *backing.Table {
	if int(id) >= len(l.tables) {
		return nil
	}
	return l.tables[id]
}

// Load returns the data of file pages [first, first+n) of table id, one
// slice per page, and waits for them: it is Fetch for a single run, made
// synchronous for the fault path. When some pages fail, the error is the
// first failure and exactly the failed pages are nil. The returned slices
// must not be modified.
func (l *Loader) Load(id uint32, first, n uint64, origin Origin) ([][]byte, error) {
	out := make([][]byte, n)
	var (
		mu       sync.Mutex
		pending  = n
		firstErr error
		ready    = make(chan struct{})
	)
	l.fetch([]Run{{Table: id, First: first, N: n}}, origin, true, false, func(r Run, pages [][]byte, err error) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if pages != nil {
			copy(out[r.First-first:], pages)
		}
		if pending -= r.N; pending == 0 {
			close(ready)
		}
	})
	<-ready
	mu.Lock()
	defer mu.Unlock()
	return out, firstErr
}

// Fetch starts loading runs and calls done for every page, exactly once,
// as parts of a run complete (a part is a run of adjacent pages that one
// backing read answered). Header pages are not the loader's business: every
// run must lie in its table's data pages, or done gets an error for it.
// Pages another caller is already reading are waited for, not read again;
// a page that failed less than NegativeTTL ago fails again at once; the
// rest are read in runs of up to MaxRunPages adjacent pages, every read of
// the call submitted to backing at once.
//
// LOCKS_EXCLUDED(l.mu)
func (l *Loader) Fetch(runs []Run, origin Origin, done FetchDone) {
	l.fetch(runs, origin, false, false, done)
}

// FetchHeld is Fetch for a prefetch: the pages it reads are held, after
// their read, until Release says their store into the page cache has
// landed. A fault in that window (a reader that got there before the push)
// is answered with them at once; without the hold it would read the page
// from backing again, and did for ~35K of the bench's prefill chunk pair's
// ~110K pages (docs/design.md, Walk 2 step 8). The caller must Release
// every run it fetched, whatever became of it.
//
// LOCKS_EXCLUDED(l.mu)
func (l *Loader) FetchHeld(runs []Run, origin Origin, done FetchDone) {
	l.fetch(runs, origin, false, true, done)
}

// Release ends the hold on the pages of runs (FetchHeld): later faults
// read them from backing, if the page cache no longer has them.
//
// LOCKS_EXCLUDED(l.mu)
func (l *Loader) Release(runs ...Run) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.held) == 0 {
		return
	}
	for _, r := range runs {
		for pg := r.First; pg < r.First+r.N; pg++ {
			delete(l.held, PageKey{Table: r.Table, Page: pg})
		}
	}
}

// fetch is Fetch, and FetchHeld with hold. inline: run this call's own
// backing reads on the calling goroutine when the backing can (a fault's
// reader is blocked anyway, and a hand-off to another thread costs more than
// the read on these VMs), unless maxInline faults already do: then a thread
// blocked per read costs more than the hand-off, and the engine submits them
// together.
func (l *Loader) fetch(runs []Run, origin Origin, inline, hold bool, done FetchDone) {
	var reads []*backing.TableRead
	type failure struct {
		f   *fetch
		i   uint64
		err error
	}
	var failed []failure
	type heldPage struct {
		f    *fetch
		pg   uint64
		data []byte
	}
	var ready []heldPage
	now := l.now()
	demand := origin == OriginFault || origin == OriginDecode
	for _, r := range runs {
		t := l.Table(r.Table)
		if t == nil || r.N == 0 || r.First < t.DataPage() || r.First+r.N > t.Pages() || r.First+r.N < r.First {
			done(r, nil, fmt.Errorf("pages [%d, +%d) of table %d: outside its data pages", r.First, r.N, r.Table))
			continue
		}
		f := &fetch{run: r, done: done, hold: hold}
		l.mu.Lock()
		mine := uint64(0) // length of the current run of pages this call reads
		for i := uint64(0); i < r.N; i++ {
			k := PageKey{Table: r.Table, Page: r.First + i}
			if data, ok := l.held[k]; ok {
				ready = append(ready, heldPage{f, k.Page, data})
				reads = l.appendRead(reads, t, k.Page-mine, mine, demand)
				mine = 0
				continue
			}
			if fl, ok := l.flights[k]; ok {
				fl.waiters = append(fl.waiters, f)
				reads = l.appendRead(reads, t, k.Page-mine, mine, demand)
				mine = 0
				continue
			}
			if neg, ok := l.negative[k]; ok {
				if now.Before(neg.until) {
					l.st.BackingFailFast.Add(1)
					failed = append(failed, failure{f, i, neg.err})
					reads = l.appendRead(reads, t, k.Page-mine, mine, demand)
					mine = 0
					continue
				}
				delete(l.negative, k)
			}
			l.flights[k] = &flight{waiters: []*fetch{f}}
			if mine++; mine == MaxRunPages {
				reads = l.appendRead(reads, t, k.Page+1-mine, mine, demand)
				mine = 0
			}
		}
		reads = l.appendRead(reads, t, r.First+r.N-mine, mine, demand)
		l.mu.Unlock()
	}
	for _, fl := range failed {
		fl.f.done(Run{Table: fl.f.run.Table, First: fl.f.run.First + fl.i, N: 1}, nil, fl.err)
	}
	if len(ready) > 0 && !hold {
		l.st.PrefetchLateServed.Add(uint64(len(ready)))
	}
	for _, h := range ready {
		h.f.done(Run{Table: h.f.run.Table, First: h.pg, N: 1}, [][]byte{h.data}, nil)
	}
	if len(reads) == 0 {
		return
	}
	if sr, ok := l.src.(backing.SyncReader); ok && inline {
		if l.inline.Add(1) <= maxInline {
			sr.ReadSync(reads...)
			l.inline.Add(-1)
			return
		}
		l.inline.Add(-1)
	}
	l.src.Submit(reads...)
}

// appendRead adds the backing read of pages [first, first+n) of t, if n > 0;
// demand: a reader is blocked on it.
func (l *Loader) appendRead(reads []*backing.TableRead, t *backing.Table, first, n uint64, demand bool) []*backing.TableRead {
	if n == 0 {
		return reads
	}
	if again := l.seen.Count(t.ID, first, n); again > 0 {
		l.st.BackingAgain.Add(again)
	}
	off := int64(first-t.DataPage()) * PageSize
	length := min(int64(n)*PageSize, t.DataLen-off)
	return append(reads, &backing.TableRead{Table: t, Off: off, Len: int(length), Demand: demand, Done: func(data []byte, err error) {
		l.readDone(t, first, n, length, demand, data, err)
	}})
}

// readDone settles the pages of one backing read. A page-specific failure
// of a run of several pages is read again a page at a time, so that one bad
// page fails only itself; each page's waiters hear as soon as its own read
// answers.
func (l *Loader) readDone(t *backing.Table, first, n uint64, length int64, demand bool, data []byte, err error) {
	if err == nil && int64(len(data)) != length {
		err = fmt.Errorf("table %s: backing returned %d of %d bytes at page %d", t.Name, len(data), length, first)
	}
	if err != nil && n > 1 && backing.PageError(err) {
		var reads []*backing.TableRead
		for i := range n {
			reads = l.appendRead(reads, t, first+i, 1, demand)
		}
		l.src.Submit(reads...)
		return
	}
	pages := make([][]byte, n)
	if err == nil {
		for i := range pages {
			lo := int64(i) * PageSize
			hi := min(lo+PageSize, length)
			pages[i] = data[lo:hi:hi]
		}
	}
	l.settle(t.ID, first, pages, err)
}

// settle ends the flights of pages [first, first+len(pages)) of table and
// tells their waiters, a call per run of adjacent pages of each fetch.
//
// LOCKS_EXCLUDED(l.mu)
func (l *Loader) settle(table uint32, first uint64, pages [][]byte, err error) {
	// A read is one page nearly always: no allocation for its waiters.
	var one [1][]*fetch
	waiting := one[:]
	if len(pages) > 1 {
		waiting = make([][]*fetch, len(pages))
	}
	l.mu.Lock()
	for i := range pages {
		k := PageKey{Table: table, Page: first + uint64(i)}
		if fl, ok := l.flights[k]; ok {
			waiting[i] = fl.waiters
			delete(l.flights, k)
			if err == nil && slices.ContainsFunc(fl.waiters, func(f *fetch) bool { return f.hold }) {
				l.held[k] = pages[i]
			}
		}
		if err != nil && backing.PageError(err) && len(pages) == 1 {
			l.remember(k, err)
		}
	}
	l.mu.Unlock()
	// One call per part: a part grows while the same fetch waits for the
	// next page too. A read has a waiter or two, so a short list (searched
	// linearly) holds the open parts.
	var parts [4]openPart
	open := parts[:0]
	for i, ws := range waiting {
		for _, f := range ws {
			j := 0
			for j < len(open) && open[j].f != f {
				j++
			}
			switch {
			case j == len(open):
				open = append(open, openPart{f: f, lo: uint64(i), n: 1})
			case open[j].lo+open[j].n == uint64(i):
				open[j].n++
			default:
				open[j].flush(table, first, pages, err)
				open[j] = openPart{f: f, lo: uint64(i), n: 1}
			}
		}
	}
	for _, p := range open {
		p.flush(table, first, pages, err)
	}
}

// openPart is a run of pages of one read that one fetch waits for: page
// indexes [lo, lo+n) of the read.
type openPart struct {
	f     *fetch
	lo, n uint64
}

// flush answers the part's fetch.
func (p openPart) flush(table uint32, first uint64, pages [][]byte, err error) {
	r := Run{Table: table, First: first + p.lo, N: p.n}
	if err != nil {
		p.f.done(r, nil, err)
	} else {
		p.f.done(r, pages[p.lo:p.lo+p.n:p.lo+p.n], nil)
	}
}

// remember puts k in the negative cache.
//
// REQUIRES(l.mu)
func (l *Loader) remember(k PageKey, err error) {
	now := l.now()
	l.negOrder.expire(l.negative, now)
	if len(l.negative) >= maxNegative {
		return // a flood of bad pages: they are read again, never wrong
	}
	until := now.Add(NegativeTTL)
	l.negative[k] = negativeHit{err: err, until: until}
	l.negOrder.push(k, until)
}

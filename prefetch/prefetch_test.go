package prefetch

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// confirmingPusher counts stores and confirms.
type confirmingPusher struct {
	countingPusher
	mu        sync.Mutex
	confirmed []int64
}

func (c *confirmingPusher) Confirm(table uint32, off int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.confirmed = append(c.confirmed, off)
	return nil
}

// A fault on a queued page cancels its fetch; the page settles as resident
// only after the pusher confirmed it, and the barrier counts it.
func TestFaultCancelsAndConfirms(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	loader := cache.NewLoader(br, m.Tables, st)
	pusher := &confirmingPusher{}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1000}, m, loader, pusher, nil, st, nil)
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{10, 20, 30}, b) // one page in flight, two queued
	tb := m.Tables[0]
	first, _ := tb.RowPages(30)
	p.Faulted([]cache.PageKey{{Table: tb.ID, Page: first}})
	if late := st.PrefetchLate.Load(); late != 1 {
		t.Fatalf("late %d, want 1", late)
	}
	close(br.release)
	s, err := b.Status(waitCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if s.Pages != 3 || s.Resident != 3 || s.Frames != 1 {
		t.Fatalf("status %+v, want 3 pages resident", s)
	}
	if got := pusher.pages.Load(); got != 2 {
		t.Fatalf("stored %d pages, want 2 (the faulted one is not fetched)", got)
	}
	if len(pusher.confirmed) != 1 || pusher.confirmed[0] != int64(first)*cache.PageSize {
		t.Fatalf("confirmed %v, want page %d", pusher.confirmed, first)
	}
	p.Close()
}

// heapInUse is the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// heldPrefetcher is a prefetcher of m whose backing reads are held until
// the test ends: what it queues stays queued or in flight.
func heldPrefetcher(t *testing.T, m *backing.Model) *Prefetcher {
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1 << 20}, m, cache.NewLoader(br, m.Tables, st), &countingPusher{}, nil, st, nil)
	t.Cleanup(func() { close(br.release); p.Close() })
	return p
}

// Naming the same rows again costs nothing: 100 prefill frames of the same
// 50K rows hold what one frame holds (target: growth under 8 MiB).
func TestHeapIndependentOfMentions(t *testing.T) {
	m := testModel(t, 200000)
	p := heldPrefetcher(t, m)
	rows := make([]uint64, 50000)
	for i := range rows {
		rows[i] = uint64(i) * 4 // one page each, none adjacent
	}
	b := NewBarrier()
	before := heapInUse()
	frame := make([]uint64, len(rows))
	for range 100 {
		copy(frame, rows)
		p.Submit(hints.Prefill, 0, frame, b)
	}
	grew := int64(heapInUse()) - int64(before)
	t.Logf("heap grew %.1f MiB for 100 frames of the same 50K rows", float64(grew)/(1<<20))
	if grew > 8<<20 {
		t.Fatalf("heap grew %d MiB, want at most 8", grew>>20)
	}
}

// A 4M-row frame of one repeated row costs what one row's pages cost.
func TestRepeatedRowFrameCostsOneRow(t *testing.T) {
	m := testModel(t, 1000)
	p := heldPrefetcher(t, m)
	rows := make([]uint64, hints.MaxRowsPerFrame)
	for i := range rows {
		rows[i] = 7
	}
	b := NewBarrier()
	p.Submit(hints.Decode, 0, rows, b)
	p.mu.Lock()
	n, named := p.c.pages.len(), b.status.Pages
	p.mu.Unlock()
	if n != 1 || named != 1 {
		t.Fatalf("%d page states, %d pages counted; want 1", n, named)
	}
}

var _ = backing.DefaultTablePattern

// heldReader holds every read until release is closed, and reports each
// read on submitted as it is submitted.
type heldReader struct {
	submitted chan *backing.TableRead
	release   chan struct{}
}

func (h heldReader) Submit(reads ...*backing.TableRead) {
	for _, r := range reads {
		h.submitted <- r
		go func() {
			<-h.release
			r.Done(make([]byte, r.Len), nil)
		}()
	}
}

// gatedPusher holds every store until gate is closed, as the kernel holds a
// NOTIFY_STORE of a page whose FUSE read has not been answered yet (the
// read holds the page's lock).
type gatedPusher struct {
	countingPusher
	gate chan struct{}
	once sync.Once
}

// open lets the stores through (the page's FUSE read has been answered);
// later calls do nothing.
func (g *gatedPusher) open() { g.once.Do(func() { close(g.gate) }) }

func (g *gatedPusher) Store(table uint32, off int64, data []byte) error {
	<-g.gate
	return g.countingPusher.Store(table, off, data)
}

// A fault that catches a prefetch in flight shares its read, and counts as
// late exactly once, whoever sees it (the loader, which hands the fault the
// prefetch's read, and the prefetcher both know): Faulted is the one writer
// of prefetch_late.
func TestFaultOnAPrefetchInFlightIsLateOnce(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	hr := heldReader{submitted: make(chan *backing.TableRead, 16), release: make(chan struct{})}
	loader := cache.NewLoader(hr, m.Tables, st)
	pusher := &gatedPusher{gate: make(chan struct{})}
	tier := &recordingTier{pinned: map[cache.PageKey]bool{}}
	p := New(Config{InflightPages: 4, PrefillQueuePages: 1000}, m, loader, pusher, tier, st, nil)
	defer p.Close()
	defer pusher.open() // before Close, which waits for the pushers
	tb := m.Tables[0]
	first, _ := tb.RowPages(10)
	b := NewBarrier()
	p.Submit(hints.Decode, 0, []uint64{10}, b)
	<-hr.submitted // the prefetch's read is in flight

	// The fault: Fetch registers it with the read in flight before it
	// returns (Load is Fetch, waited for).
	faulted := make(chan error, 1)
	loader.Fetch([]cache.Run{{Table: tb.ID, First: first, N: 1}}, cache.OriginFault, func(r cache.Run, pages [][]byte, err error) {
		faulted <- err
	})
	select {
	case r := <-hr.submitted:
		t.Fatalf("the fault read [%d, +%d) again instead of sharing the prefetch's read", r.Off, r.Len)
	default:
	}
	close(hr.release)
	if err := <-faulted; err != nil {
		t.Fatal(err)
	}
	keys := []cache.PageKey{{Table: tb.ID, Page: first}}
	p.Faulted(keys) // the Read handler, before its reply
	if late := st.PrefetchLate.Load(); late != 1 {
		t.Fatalf("prefetch_late %d after one fault on a page in flight, want 1", late)
	}
	p.Faulted(keys) // a second reader's read of it, as a read(2) can
	if late := st.PrefetchLate.Load(); late != 1 {
		t.Fatalf("prefetch_late %d after two faults on a page in flight, want 1 (a page is late once)", late)
	}
	pusher.open() // the reply: the push lands
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	// The tier heard of the page as the faults that read it, not again as
	// the decode hint whose prefetch they caught.
	if sigs := tier.heard(keys[0]); !slices.Equal(sigs, []cache.Signal{cache.SignalFault, cache.SignalFault}) {
		t.Fatalf("the tier heard of the late page as %v, want its two faults only", sigs)
	}
	p.Faulted(keys) // evicted and faulted again: no prefetch pending now
	if late := st.PrefetchLate.Load(); late != 1 {
		t.Fatalf("prefetch_late %d after a fault with no prefetch pending, want still 1", late)
	}
	if got := st.Layer(0).Refaulted.Load(); got != 1 {
		t.Fatalf("refaulted %d, want 1 (one hint, two faults)", got)
	}
}

// ownFaultTier is a hot tier that is populating the pages in own.
type ownFaultTier struct {
	recordingTier
	own map[cache.PageKey]bool
}

func (o *ownFaultTier) OwnFault(k cache.PageKey) bool { return o.own[k] }

// The hot tier's own populate faults are no demand: not late, not
// refaulted, not a fault hit; the reader's fault beside it is all three.
func TestOwnPopulateFaultsAreNoDemand(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	tier := &ownFaultTier{recordingTier: recordingTier{pinned: map[cache.PageKey]bool{}}}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1000}, m, cache.NewLoader(br, m.Tables, st), &confirmingPusher{}, tier, st, nil)
	defer p.Close()
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{10, 20, 30}, b) // one page in flight, two queued
	tb := m.Tables[0]
	pg20, _ := tb.RowPages(20)
	pg30, _ := tb.RowPages(30)
	own, reader := cache.PageKey{Table: tb.ID, Page: pg20}, cache.PageKey{Table: tb.ID, Page: pg30}
	tier.own = map[cache.PageKey]bool{own: true}

	p.Faulted([]cache.PageKey{own})
	if late, refaulted, hits := st.PrefetchLate.Load(), st.Layer(0).Refaulted.Load(), tier.faultHits(); late != 0 || refaulted != 0 || len(hits) != 0 {
		t.Fatalf("own populate fault: late %d, refaulted %d, fault hits %v; want none", late, refaulted, hits)
	}
	p.Faulted([]cache.PageKey{own, reader})
	if late, refaulted := st.PrefetchLate.Load(), st.Layer(0).Refaulted.Load(); late != 1 || refaulted != 1 {
		t.Fatalf("a reader's fault beside an own one: late %d, refaulted %d; want 1 and 1", late, refaulted)
	}
	if hits := tier.faultHits(); len(hits) != 1 || hits[0] != reader {
		t.Fatalf("fault hits %v, want only page %d", hits, pg30)
	}
	close(br.release)
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	// The reader's page was heard of once, as its fault: the settle of the
	// prefetch it cancelled offers it nothing more.
	if sigs := tier.heard(reader); !slices.Equal(sigs, []cache.Signal{cache.SignalFault}) {
		t.Fatalf("the tier heard of the faulted page as %v, want only its fault", sigs)
	}
}

// demandReader answers every read with zeros and records, per data offset,
// whether the read was a demand read.
type demandReader struct {
	mu     sync.Mutex
	demand map[int64]bool
}

func (d *demandReader) Submit(reads ...*backing.TableRead) {
	d.mu.Lock()
	for _, r := range reads {
		for off := r.Off; off < r.Off+int64(r.Len); off += cache.PageSize {
			d.demand[off/cache.PageSize*cache.PageSize] = r.Demand
		}
	}
	d.mu.Unlock()
	for _, r := range reads {
		r.Done(make([]byte, r.Len), nil)
	}
}

// A decode hint's pages are read as demand reads (an object store's demand
// lane, hedged), a prefill hint's are not.
func TestDecodeHintsAreDemandReads(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	dr := &demandReader{demand: map[int64]bool{}}
	p := New(Config{InflightPages: 64, PrefillQueuePages: 1000, DecodeQueuePages: 1000}, m, cache.NewLoader(dr, m.Tables, st), &countingPusher{}, nil, st, nil)
	defer p.Close()
	dec, pre := NewBarrier(), NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{100}, pre)
	p.Submit(hints.Decode, 0, []uint64{2000}, dec)
	for _, b := range []*Barrier{pre, dec} {
		if err := b.Wait(waitCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	tb := m.Tables[0]
	check := func(row uint64, want bool) {
		t.Helper()
		first, last := tb.RowPages(row)
		for pg := first; pg <= last; pg++ {
			off := int64(pg-tb.DataPage()) * cache.PageSize
			d, ok := dr.demand[off]
			if !ok || d != want {
				t.Errorf("row %d page %d: read %v, demand %v; want a read, demand %v", row, pg, ok, d, want)
			}
		}
	}
	dr.mu.Lock()
	defer dr.mu.Unlock()
	check(100, false)
	check(2000, true)
}

// sortedUnique gives what a sort and a compaction give, on both of its
// paths (the bitmap for rows dense in the layer, the sort otherwise).
func TestSortedUnique(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, c := range []struct {
		n         int
		layerRows uint64
	}{{0, 100}, {1, 1}, {10, 1 << 40}, {5000, 1000}, {5000, 64 * 5000}, {5000, 64*5000 + 1}, {100, 63}} {
		rows := make([]uint64, c.n)
		for i := range rows {
			rows[i] = rng.Uint64N(c.layerRows)
		}
		want := slices.Clone(rows)
		slices.Sort(want)
		want = slices.Compact(want)
		if got := sortedUnique(rows, c.layerRows); !slices.Equal(got, want) {
			t.Fatalf("%d rows of %d: got %d rows, want %d", c.n, c.layerRows, len(got), len(want))
		}
	}
}

// splitRuns cuts runs into slices of n pages that, together, are the runs.
func TestSplitRuns(t *testing.T) {
	runs := []pageRun{{0, 0, 5}, {0, 10, 3}, {1, 0, 9}, {1, 20, 1}}
	var want []cache.PageKey
	for _, r := range runs {
		for pg := r.first; pg < r.first+r.n; pg++ {
			want = append(want, cache.PageKey{Table: r.table, Page: pg})
		}
	}
	var got []cache.PageKey
	var buf []pageRun
	for rest := slices.Clone(runs); len(rest) > 0; {
		var head []pageRun
		head, rest = splitRuns(rest, 4, &buf)
		n := uint64(0)
		for _, r := range head {
			n += r.n
			for pg := r.first; pg < r.first+r.n; pg++ {
				got = append(got, cache.PageKey{Table: r.table, Page: pg})
			}
		}
		if n != 4 && len(rest) > 0 {
			t.Fatalf("a slice of %d pages before the last", n)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("pages %v, want %v", got, want)
	}
}

// Prefill admission gives way to pending decode work but is never stopped
// by it: with a decode page that never settles (its read is held), a
// prefill frame of many slices is still admitted, whole.
func TestPrefillAdmittedWhileDecodePending(t *testing.T) {
	m := testModel(t, 200000)
	p := heldPrefetcher(t, m)
	p.Submit(hints.Decode, 0, []uint64{1}, NewBarrier())
	if p.DecodeBusy() == nil {
		t.Fatal("a decode page is pending, yet decode is not busy")
	}
	rows := make([]uint64, 50*admitSlice)
	for i := range rows {
		rows[i] = uint64(i) * 2
	}
	b := NewBarrier()
	done := make(chan struct{})
	go func() { p.Submit(hints.Prefill, 0, rows, b); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("prefill admission stopped behind a decode page that never settles")
	}
	p.mu.Lock()
	named := b.status.Pages
	p.mu.Unlock()
	if named < uint64(len(rows)) {
		t.Fatalf("%d pages admitted, want at least %d", named, len(rows))
	}
}

// countingReader answers every read with zeros and counts the reads.
type countingReader struct{ reads atomic.Int64 }

func (c *countingReader) Submit(reads ...*backing.TableRead) {
	for _, r := range reads {
		c.reads.Add(1)
		r.Done(make([]byte, r.Len), nil)
	}
}

// enteredPusher is a gatedPusher that says when a store has begun.
type enteredPusher struct {
	gatedPusher
	entered chan struct{}
}

func (e *enteredPusher) Store(table uint32, off int64, data []byte) error {
	select {
	case e.entered <- struct{}{}:
	default:
	}
	return e.gatedPusher.Store(table, off, data)
}

// A fault that comes after a prefetch's read has finished, while its store
// is still on its way, gets that read's bytes: no second backing read. Once
// the store has landed the page is the page cache's again.
func TestFaultBeforeThePushLandsSharesTheRead(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	cr := &countingReader{}
	loader := cache.NewLoader(cr, m.Tables, st)
	pusher := &enteredPusher{gatedPusher: gatedPusher{gate: make(chan struct{})}, entered: make(chan struct{}, 1)}
	p := New(Config{InflightPages: 4, PrefillQueuePages: 1000}, m, loader, pusher, nil, st, nil)
	defer p.Close()
	defer pusher.open() // before Close, which waits for the pushers
	tb := m.Tables[0]
	first, _ := tb.RowPages(10)
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{10}, b)
	<-pusher.entered // read, and being stored
	pages, err := loader.Load(tb.ID, first, 1, cache.OriginFault)
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) != 1 || len(pages[0]) != cache.PageSize {
		t.Fatalf("the fault got %d pages, want the page", len(pages))
	}
	if reads, served := cr.reads.Load(), st.PrefetchLateServed.Load(); reads != 1 || served != 1 {
		t.Fatalf("%d backing reads, %d pages served from the prefetch's read; want 1 and 1", reads, served)
	}
	p.Faulted([]cache.PageKey{{Table: tb.ID, Page: first}})
	if late := st.PrefetchLate.Load(); late != 1 {
		t.Fatalf("prefetch_late %d, want 1", late)
	}
	pusher.open() // the store lands
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := loader.Load(tb.ID, first, 1, cache.OriginFault); err != nil {
		t.Fatal(err)
	}
	if reads := cr.reads.Load(); reads != 2 {
		t.Fatalf("%d backing reads, want 2: once the store has landed, a fault reads backing (the page was evicted)", reads)
	}
}

// releaseCheck is the loader, with a count of the pages the prefetcher
// fetched with FetchHeld and has not released.
type releaseCheck struct {
	*cache.Loader
	mu   sync.Mutex
	held map[cache.PageKey]bool
}

func (r *releaseCheck) FetchHeld(runs []cache.Run, origin cache.Origin, done cache.FetchDone) {
	r.mu.Lock()
	for _, run := range runs {
		for pg := run.First; pg < run.First+run.N; pg++ {
			r.held[cache.PageKey{Table: run.Table, Page: pg}] = true
		}
	}
	r.mu.Unlock()
	r.Loader.FetchHeld(runs, origin, done)
}

func (r *releaseCheck) Release(runs ...cache.Run) {
	r.mu.Lock()
	for _, run := range runs {
		for pg := run.First; pg < run.First+run.N; pg++ {
			delete(r.held, cache.PageKey{Table: run.Table, Page: pg})
		}
	}
	r.mu.Unlock()
	r.Loader.Release(runs...)
}

// failingPusher fails every store into table bad.
type failingPusher struct {
	countingPusher
	bad uint32
}

func (f *failingPusher) Store(table uint32, off int64, data []byte) error {
	if table == f.bad {
		return errors.New("test: store refused")
	}
	return f.countingPusher.Store(table, off, data)
}

// Every page the prefetcher fetched is released once it settles, whether
// its read failed, its store failed or it landed: a page left held would
// be served to faults from memory long after the page cache dropped it.
func TestEveryFetchedPageIsReleased(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	// Reads of layer 0's rows 100-199 fail.
	bad0, _ := m.Tables[0].RowPages(100)
	bad1, _ := m.Tables[0].RowPages(199)
	reader := backing.ReaderFunc(func(tb *backing.Table, off int64, n int) ([]byte, error) {
		lo, hi := uint64(off)/cache.PageSize+tb.DataPage(), (uint64(off)+uint64(n)-1)/cache.PageSize+tb.DataPage()
		if tb.ID == m.Tables[0].ID && lo <= bad1 && hi >= bad0 {
			return nil, fmt.Errorf("test: %w", syscall.EIO)
		}
		return make([]byte, n), nil
	})
	rc := &releaseCheck{Loader: cache.NewLoader(reader, m.Tables, st), held: map[cache.PageKey]bool{}}
	p := New(Config{InflightPages: 8, PrefillQueuePages: 1 << 16}, m, rc, &failingPusher{bad: m.Tables[1].ID}, nil, st, nil)
	rng := rand.New(rand.NewPCG(1, 2))
	b := NewBarrier()
	for layer := range 2 {
		rows := make([]uint64, 500)
		for i := range rows {
			rows[i] = rng.Uint64N(4000)
		}
		p.Submit(hints.Prefill, m.Layers[layer], rows, b)
		p.Submit(hints.Decode, m.Layers[layer], []uint64{150, 3000}, b)
	}
	if err := b.Wait(waitCtx(t)); err != nil && !errors.Is(err, ErrPagesFailed) { // some pages fail: that is the point
		t.Fatal(err)
	}
	p.Close()
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.held) != 0 {
		t.Fatalf("%d fetched pages never released, e.g. %v", len(rc.held), firstKey(rc.held))
	}
	if st.PrefetchPagesFailed.Load() == 0 || st.PrefetchPagesStored.Load() == 0 {
		t.Fatalf("failed %d, stored %d: want both read or store failures and stores", st.PrefetchPagesFailed.Load(), st.PrefetchPagesStored.Load())
	}
}

func firstKey(m map[cache.PageKey]bool) cache.PageKey {
	for k := range m {
		return k
	}
	return cache.PageKey{}
}

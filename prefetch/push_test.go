package prefetch

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// waitUntil fails t unless cond holds within 30 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
	}
}

// queuedAnswers is the pages answered and waiting for a pusher, and how
// many of them are decode pages.
func (p *Prefetcher) queuedAnswers() (pages, decode uint64) {
	p.omu.Lock()
	defer p.omu.Unlock()
	for _, q := range [][]outcome{p.out, p.outDecode} {
		for _, o := range q {
			pages += o.run.N
			if o.decode {
				decode += o.run.N
			}
		}
	}
	return pages, decode
}

// holdingPusher records every store's table and offset in order, and holds
// a store of an offset the test asked to hold until it is let go.
type holdingPusher struct {
	mu      sync.Mutex
	stores  []cache.PageKey
	holds   map[int64]chan struct{}
	entered chan int64
}

func newHoldingPusher() *holdingPusher {
	return &holdingPusher{holds: map[int64]chan struct{}{}, entered: make(chan int64, 16)}
}

func (h *holdingPusher) hold(off int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.holds[off] = make(chan struct{})
}

// release lets a held store go (and every later store of off through).
func (h *holdingPusher) release(off int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if c, ok := h.holds[off]; ok {
		close(c)
		delete(h.holds, off)
	}
}

func (h *holdingPusher) releaseAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for off, c := range h.holds {
		close(c)
		delete(h.holds, off)
	}
}

func (h *holdingPusher) Store(table uint32, off int64, data []byte) error {
	h.mu.Lock()
	h.stores = append(h.stores, cache.PageKey{Table: table, Page: uint64(off / cache.PageSize)})
	c := h.holds[off]
	h.mu.Unlock()
	if c != nil {
		h.entered <- off
		<-c
	}
	return nil
}

// A decode step's pages wait for at most the prefill store in progress: a
// pusher that took every answer waiting stored them whole before it looked
// again (issue 24: a one-row decode step waited ~100 ms behind 5,000
// prefill stores).
func TestDecodeWaitsForAtMostOnePrefillStore(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	pusher := newHoldingPusher()
	loader := cache.NewLoader(&countingReader{}, m.Tables, st)
	p := New(Config{InflightPages: 4096, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: 1 << 16}, m, loader, pusher, nil, st, nil)
	defer p.Close()
	defer pusher.releaseAll()
	t0, t1 := m.LayerTables(0)[0], m.LayerTables(1)[0]
	off := func(tb *backing.Table, row uint64) int64 {
		pg, _ := tb.RowPages(row)
		return int64(pg) * cache.PageSize
	}

	// The pusher is held at a lone prefill page while 500 more answers
	// queue up behind it.
	pusher.hold(off(t0, 3999))
	bp := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{3999}, bp)
	<-pusher.entered
	var rows []uint64
	for r := uint64(0); r < 4000; r += 8 {
		rows = append(rows, r)
	}
	p.Submit(hints.Prefill, 0, rows, bp)
	waitUntil(t, "the prefill answers never queued up", func() bool { n, _ := p.queuedAnswers(); return n == uint64(len(rows)) })
	// It takes its next batch and is held at its first store; meanwhile a
	// decode step's page is answered.
	pusher.hold(off(t0, 0))
	pusher.release(off(t0, 3999))
	<-pusher.entered
	bd := NewBarrier()
	p.Submit(hints.Decode, 1, []uint64{5}, bd)
	waitUntil(t, "the decode answer never queued up", func() bool { _, d := p.queuedAnswers(); return d == 1 })
	pusher.release(off(t0, 0))
	for _, b := range []*Barrier{bp, bd} {
		if err := b.Wait(waitCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	pusher.mu.Lock()
	defer pusher.mu.Unlock()
	decodeKey := cache.PageKey{Table: t1.ID, Page: uint64(off(t1, 5) / cache.PageSize)}
	for i, k := range pusher.stores {
		if k == decodeKey {
			// stores[0] is the lone page, stores[1] the held one.
			if before := i - 2; before > 0 {
				t.Fatalf("the decode page waited for %d prefill stores after the one in progress, want none", before)
			}
			return
		}
	}
	t.Fatal("the decode page was never stored")
}

// Pages read and not yet stored are bounded: with the pusher held, no more
// than unstoredBoundFactor × InflightPages pages are read (issue 24: 49,981
// answered pages waited for a held pusher against a bound of 128).
func TestInflightBoundHoldsUntilStored(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	reader := &countingReader{}
	loader := cache.NewLoader(reader, m.Tables, st)
	pusher := &gatedPusher{gate: make(chan struct{})}
	const inflight = 16
	p := New(Config{InflightPages: inflight, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: 1 << 16}, m, loader, pusher, nil, st, nil)
	defer p.Close()
	defer pusher.open()
	var rows []uint64
	for r := uint64(0); r < 4000; r += 4 {
		rows = append(rows, r)
	}
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, rows, b)
	bound := int64(unstoredBoundFactor * inflight)
	waitUntil(t, "no read began", func() bool { return reader.reads.Load() >= bound })
	p.claimAndFetch() // whatever the fetch loop has not claimed yet
	if n, _ := p.queuedAnswers(); reader.reads.Load() != bound || n > uint64(bound) {
		t.Fatalf("%d pages read and %d waiting for the held pusher, want %d and at most %d", reader.reads.Load(), n, bound, bound)
	}
	pusher.open()
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	if got := reader.reads.Load(); got != int64(len(rows)) {
		t.Fatalf("%d pages read in all, want %d", got, len(rows))
	}
}

// refaultingConfirmer's Confirm faults the page in again, as the kernel does
// when the page was evicted between the fault's reply and the confirm read:
// the FUSE read that follows reaches Faulted.
type refaultingConfirmer struct {
	countingPusher
	p *Prefetcher
}

func (r *refaultingConfirmer) Confirm(table uint32, off int64) error {
	r.p.Faulted([]cache.PageKey{{Table: table, Page: uint64(off / cache.PageSize)}})
	return nil
}

// A Confirm read that faults its page in again is the pusher's own read,
// not a reader's demand: the tier hears of the page once, as the reader's
// fault, and the page is not late or refaulted twice (issue 24).
func TestConfirmFaultIsNoDemand(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	loader := cache.NewLoader(br, m.Tables, st)
	hot := &recordingTier{}
	pusher := &refaultingConfirmer{}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1000}, m, loader, pusher, hot, st, nil)
	pusher.p = p
	defer p.Close()
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{10, 20, 30}, b) // one page in flight, two queued
	tb := m.Tables[0]
	first, _ := tb.RowPages(30)
	k := cache.PageKey{Table: tb.ID, Page: first}
	p.Faulted([]cache.PageKey{k}) // the reader's fault: cancels the queued fetch
	close(br.release)
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	if sigs := hot.heard(k); len(sigs) != 1 || sigs[0] != cache.SignalFault {
		t.Fatalf("the tier heard of the faulted page as %v, want one fault", sigs)
	}
	if late, ref := st.PrefetchLate.Load(), st.Layer(m.Layers[0]).Refaulted.Load(); late != 1 || ref != 1 {
		t.Fatalf("late %d, refaulted %d, want 1 and 1", late, ref)
	}
}

// A page the handle still waits for counts once in its barrier, however it
// is named again: found in the page cache while its own fetch is still
// pending, or cut off by a prefill part larger than the queue (issue 24:
// barrier pages counted a page twice).
func TestBarrierCountsAPageOnce(t *testing.T) {
	m := testModel(t, 4000)
	tb := m.Tables[0]
	key := func(row uint64) cache.PageKey {
		pg, _ := tb.RowPages(row)
		return cache.PageKey{Table: tb.ID, Page: pg}
	}
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	hot := &recordingTier{pinned: map[cache.PageKey]bool{}, cached: map[cache.PageKey]bool{}}
	pusher := &gatedPusher{gate: make(chan struct{})}
	loader := cache.NewLoader(&countingReader{}, m.Tables, st)
	p := New(Config{InflightPages: 64, Pushers: 1, PrefillQueuePages: 10, DecodeQueuePages: 1 << 16}, m, loader, pusher, hot, st, nil)
	defer p.Close()
	defer pusher.open()

	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{0, 1, 2, 3, 4}, b) // pending: the pusher is held
	hot.mu.Lock()
	hot.cached[key(0)] = true // a reader faulted it meanwhile
	hot.mu.Unlock()
	p.Submit(hints.Decode, 0, []uint64{0}, b)
	var rows []uint64
	for r := uint64(0); r < 20; r++ {
		rows = append(rows, r)
	}
	p.Submit(hints.Prefill, 0, rows, b) // 20 pages, the queue holds 10: pages 0-9 cut off
	pusher.open()
	s, err := b.Status(waitCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	// Pages 0-4 pending, then resident; 5-9 dropped; 10-19 resident.
	if s.Pages != 20 || s.Resident != 15 || s.Dropped != 5 || s.Cached != 0 || s.Resident+s.Pinned+s.Dropped+s.Failed != s.Pages {
		t.Fatalf("status %+v, want 20 pages: 15 resident, 5 dropped, none cached", s)
	}
}

// A fault on a page a hint pushed counts as a push evicted before use,
// once; a fault that caught its prefetch in flight used it, and does not.
func TestPushedPageFaultedCountsAsEvicted(t *testing.T) {
	m := testModel(t, 4000)
	tb := m.Tables[0]
	key := func(row uint64) cache.PageKey {
		pg, _ := tb.RowPages(row)
		return cache.PageKey{Table: tb.ID, Page: pg}
	}
	p, st, _ := newTestPrefetcher(t, m, nil, DefaultConfig(4))
	b := NewBarrier()
	p.Submit(hints.Prefill, 0, []uint64{1, 2, 3}, b)
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	p.Faulted([]cache.PageKey{key(1), key(2)}) // evicted, then read
	p.Faulted([]cache.PageKey{key(1)})         // read again: not pushed since
	if got := st.PrefetchPushedEvicted.Load(); got != 2 {
		t.Fatalf("prefetch_pushed_evicted %d, want 2", got)
	}

	// A fault while the fetch is in flight: the reader used the page.
	pusher := &gatedPusher{gate: make(chan struct{})}
	st2 := &stats.Counters{}
	st2.SetLayers(m.Layers)
	p2 := New(DefaultConfig(4), m, cache.NewLoader(&countingReader{}, m.Tables, st2), pusher, nil, st2, nil)
	defer p2.Close()
	b2 := NewBarrier()
	p2.Submit(hints.Prefill, 0, []uint64{5}, b2)
	waitUntil(t, "never in flight", func() bool {
		p2.mu.Lock()
		defer p2.mu.Unlock()
		s := p2.c.pages.get(tb.ID, key(5).Page)
		return s != nil && s.stage == stInflight
	})
	p2.Faulted([]cache.PageKey{key(5)})
	pusher.open()
	if err := b2.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	p2.Faulted([]cache.PageKey{key(5)})
	if got := st2.PrefetchPushedEvicted.Load(); got != 0 {
		t.Fatalf("prefetch_pushed_evicted %d after a late fault, want 0", got)
	}
}

// evictingTier is a recordingTier whose pushed pages stay in the page cache
// or leave it at once, as resident says: the page cache of a node that holds
// a prefill frame, or of one whose memory the frame overruns. A page counts
// as pushed once the tier heard of it (a settle admits before it checks);
// none is cached before, so the frame's own lookup finds nothing, whenever
// it runs.
type evictingTier struct {
	recordingTier
	resident atomic.Bool
}

func (e *evictingTier) ResidentRun(table uint32, first, n uint64, vec []byte) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := range n {
		vec[i] = 0
		if e.resident.Load() && len(e.log[cache.PageKey{Table: table, Page: first + i}]) > 0 {
			vec[i] = 1
		}
	}
	return true
}

// A prefill frame larger than the page cache holds is throttled once the
// first page pushed for it has been evicted before its barrier returned:
// the rest drops (its reader faults it, one read a page) instead of being
// pushed and evicted in turn (issue 24: a prefill larger than memory read
// 90% of its pushed pages again). A handle whose pushes stay is never
// throttled, and a barrier ends the throttle.
func TestPrefillThrottledOnceItsPushesAreEvicted(t *testing.T) {
	m := testModel(t, 4000)
	var rows []uint64
	for r := range uint64(3000) {
		rows = append(rows, r)
	}
	for _, evicted := range []bool{false, true} {
		hot := &evictingTier{}
		p, st, _ := newTestPrefetcher(t, m, hot, Config{InflightPages: 16, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: 1 << 16})
		b := NewBarrier()
		hot.resident.Store(!evicted) // the pushes stay, or leave
		p.Submit(hints.Prefill, 0, rows, b)
		s, err := b.Status(waitCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if s.Pages != 3000 || s.Resident+s.Dropped != s.Pages || st.PrefetchPagesThrottled.Load() != s.Dropped {
			t.Fatalf("evicted %v: status %+v, %d counted throttled", evicted, s, st.PrefetchPagesThrottled.Load())
		}
		switch {
		case !evicted && s.Dropped != 0:
			t.Fatalf("pushes that stay: %d pages dropped, want none", s.Dropped)
		case evicted && (s.Resident < throttleCheckPages || s.Dropped < 3000-2*throttleCheckPages):
			t.Fatalf("pushes evicted: %d pushed, %d dropped; want the first %d pushed and most of the rest dropped", s.Resident, s.Dropped, throttleCheckPages)
		}
		// The barrier ended the throttle.
		p.Submit(hints.Prefill, 1, rows[:10], b)
		if s, err := b.Status(waitCtx(t)); err != nil || s.Dropped != 0 || s.Resident != 10 {
			t.Fatalf("evicted %v: after the barrier, status %+v (%v), want 10 resident", evicted, s, err)
		}
	}
}

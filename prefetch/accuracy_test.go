package prefetch

import (
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// testModel writes a two-layer model whose shard is a header and a hole.
func testModel(t testing.TB, rows int64) *backing.Model {
	t.Helper()
	dir := t.TempDir()
	var tensors []backing.TensorInfo
	var off int64
	for _, name := range []string{"layers.0.engram.embed.weight", "layers.1.engram.embed.weight"} {
		tensors = append(tensors, backing.TensorInfo{Name: name, Dtype: "U8", Shape: []int64{rows, 4096}, Begin: off, End: off + rows*4096})
		off += rows * 4096
	}
	hdr, err := backing.EncodeHeader(tensors, nil, 1)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(hdr); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(int64(len(hdr)) + off); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// recordingTier is a HotTier that pins nothing and remembers admissions.
type recordingTier struct {
	mu      sync.Mutex
	log     map[cache.PageKey][]cache.Signal // every signal each page was admitted with
	pinned  map[cache.PageKey]bool
	cached  map[cache.PageKey]bool // in the page cache, not pinned
	lookups int                    // ResidentRun calls
	perRun  bool                   // LookupPerRun's answer
}

// heard is every signal k was admitted with, in order.
func (r *recordingTier) heard(k cache.PageKey) []cache.Signal {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.log[k])
}

// faultHits is the pages admitted as fault hits.
func (r *recordingTier) faultHits() []cache.PageKey {
	r.mu.Lock()
	defer r.mu.Unlock()
	var keys []cache.PageKey
	for k, sigs := range r.log {
		if slices.Contains(sigs, cache.SignalFault) {
			keys = append(keys, k)
		}
	}
	return keys
}

func (r *recordingTier) Pinned(k cache.PageKey) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pinned[k]
}

func (r *recordingTier) OwnFault(k cache.PageKey) bool { return false }

func (r *recordingTier) LookupPerRun(runs, span uint64) bool { return r.perRun }

// ResidentRun reports the pages in cached as in the page cache.
func (r *recordingTier) ResidentRun(table uint32, first, n uint64, vec []byte) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lookups++
	for i := range n {
		vec[i] = 0
		if r.cached[cache.PageKey{Table: table, Page: first + i}] {
			vec[i] = 1
		}
	}
	return true
}

func (r *recordingTier) Admit(keys []cache.PageKey, sig cache.Signal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.log == nil {
		r.log = map[cache.PageKey][]cache.Signal{}
	}
	for _, k := range keys {
		r.log[k] = append(r.log[k], sig)
	}
}

func newTestPrefetcher(t *testing.T, m *backing.Model, hot HotTier, cfg Config) (*Prefetcher, *stats.Counters, *countingPusher) {
	t.Helper()
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	loader := cache.NewLoader(memReader{buf: make([]byte, cache.MaxRunPages*cache.PageSize)}, m.Tables, st)
	pusher := &countingPusher{}
	p := New(cfg, m, loader, pusher, hot, st, nil)
	t.Cleanup(p.Close)
	return p, st, pusher
}

func TestSubmitPagesFetchesAndAdmitsAsDecode(t *testing.T) {
	m := testModel(t, 1000)
	tb := m.Tables[1]
	hot := &recordingTier{pinned: map[cache.PageKey]bool{}}
	pinned := cache.PageKey{Table: tb.ID, Page: tb.DataPage() + 7}
	hot.pinned[pinned] = true
	p, st, pusher := newTestPrefetcher(t, m, hot, DefaultConfig(4))

	var keys []cache.PageKey
	for pg := tb.DataPage(); pg < tb.DataPage()+100; pg += 3 {
		keys = append(keys, cache.PageKey{Table: tb.ID, Page: pg})
	}
	keys = append(keys, keys[0])                                       // a duplicate
	keys = append(keys, cache.PageKey{Table: tb.ID, Page: tb.Pages()}) // past the end: skipped
	b := NewBarrier()
	p.SubmitPages(keys, cache.SignalDecode, b)
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	unique := 34 // pages DataPage, +3, ..., +99
	want := uint64(unique)
	if pinned.Page%3 == tb.DataPage()%3 {
		want-- // already pinned: not fetched
	}
	if got := pusher.pages.Load(); got != want {
		t.Fatalf("pushed %d pages, want %d", got, want)
	}
	if got := st.Layer(1).Pushed.Load(); got != want {
		t.Fatalf("layer 1 pushed %d, want %d", got, want)
	}
	if got := st.Layer(0).Pushed.Load(); got != 0 {
		t.Fatalf("layer 0 pushed %d, want 0", got)
	}
	for _, k := range keys[:unique] {
		if k == pinned {
			continue
		}
		if sigs := hot.heard(k); len(sigs) == 0 || sigs[len(sigs)-1] != cache.SignalDecode {
			t.Fatalf("page %v admitted as %v, want last as decode", k, sigs)
		}
	}
}

func TestRefaultedCountsEachHintOnce(t *testing.T) {
	m := testModel(t, 1000)
	p, st, _ := newTestPrefetcher(t, m, nil, DefaultConfig(4))
	rows := []uint64{1, 2, 500}
	hint := func() {
		b := NewBarrier()
		p.Submit(hints.Prefill, 0, rows, b)
		if err := b.Wait(waitCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	var keys []cache.PageKey
	for _, r := range rows {
		first, _ := m.Tables[0].RowPages(r)
		keys = append(keys, cache.PageKey{Table: 0, Page: first})
	}
	notHinted := cache.PageKey{Table: 0, Page: m.Tables[0].DataPage() + 900}

	hint()
	p.Faulted(append(keys, notHinted))
	if got := st.Layer(0).Refaulted.Load(); got != 3 {
		t.Fatalf("refaulted %d after faulting 3 hinted pages and 1 other, want 3", got)
	}
	p.Faulted(keys)
	if got := st.Layer(0).Refaulted.Load(); got != 3 {
		t.Fatalf("refaulted %d after faulting them again without a hint, want 3", got)
	}
	hint()
	p.Faulted(keys[:1])
	if got := st.Layer(0).Refaulted.Load(); got != 4 {
		t.Fatalf("refaulted %d after a new hint and one fault, want 4", got)
	}
	if got := st.Layer(1).Refaulted.Load() + st.Layer(1).Pushed.Load(); got != 0 {
		t.Fatalf("layer 1 counted %d, want nothing", got)
	}
}

// blockingReader holds every read until release is closed.
type blockingReader struct{ release chan struct{} }

func (b blockingReader) Submit(reads ...*backing.TableRead) {
	backing.ReaderFunc(func(t *backing.Table, off int64, n int) ([]byte, error) {
		<-b.release
		return make([]byte, n), nil
	}).Submit(reads...)
}

func TestDroppedCountedByLayer(t *testing.T) {
	m := testModel(t, 4000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	loader := cache.NewLoader(br, m.Tables, st)
	cfg := Config{InflightPages: 1, Pushers: 1, PrefillQueuePages: cache.MaxRunPages, DecodeQueuePages: cache.MaxRunPages}
	p := New(cfg, m, loader, &countingPusher{}, nil, st, nil)
	// Scattered rows of layer 1: one page each, far more than the queue holds.
	var rows []uint64
	for r := uint64(0); r < 4000; r += 4 {
		rows = append(rows, r)
	}
	b := NewBarrier()
	p.Submit(hints.Prefill, 1, rows, b)
	close(br.release)
	if err := b.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	p.Close()
	if d := st.PrefetchPagesDropped.Load(); d == 0 || st.Layer(1).Dropped.Load() != d || st.Layer(0).Dropped.Load() != 0 {
		t.Fatalf("dropped %d in all, %d in layer 1, %d in layer 0; want them all in layer 1", d, st.Layer(1).Dropped.Load(), st.Layer(0).Dropped.Load())
	}
	// A dropped page was never pushed: a fault on it is not a refault.
	first, _ := m.Tables[1].RowPages(rows[0])
	p.Faulted([]cache.PageKey{{Table: 1, Page: first}})
	if got := st.Layer(1).Refaulted.Load(); got != 0 {
		t.Fatalf("a fault on a dropped page counted as refaulted (%d)", got)
	}
}

// BenchmarkRefaulted is the hint accounting a demand fault pays: one atomic
// AND on the table's bitmap.
func BenchmarkRefaulted(b *testing.B) {
	m := testModel(b, 1<<16)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	p := New(DefaultConfig(1), m, nil, &countingPusher{}, nil, st, nil)
	defer p.Close()
	tb := m.Tables[0]
	pages := make([]uint64, 0, 4096)
	for pg := tb.DataPage(); pg < tb.DataPage()+4096; pg++ {
		pages = append(pages, pg)
	}
	p.markHinted(tb.ID, pages[0], uint64(len(pages)))
	keys := []cache.PageKey{{Table: tb.ID}}
	b.ResetTimer()
	for i := range b.N {
		keys[0].Page = pages[i%len(pages)]
		p.refaulted(keys)
	}
}

// Prefill pages already in the page cache are neither read nor stored: the
// barrier counts them resident, the tier hears of them as the hint's, and
// one evicted before its reader came is a refault. Nearby runs share one
// residency lookup, pinned pages need none, and decode work skips its
// cached pages too (a serving loop's decode steps find most of theirs
// cached).
func TestCachedPagesAreNotFetched(t *testing.T) {
	m := testModel(t, 4000)
	tb := m.Tables[0]
	hot := &recordingTier{pinned: map[cache.PageKey]bool{}, cached: map[cache.PageKey]bool{}}
	key := func(row uint64) cache.PageKey {
		pg, _ := tb.RowPages(row)
		return cache.PageKey{Table: tb.ID, Page: pg}
	}
	// Rows 0, 10, ..., 990: one page each, 10 apart. Every third is
	// cached, row 500 is pinned.
	var rows []uint64
	cached := 0
	for r := uint64(0); r < 1000; r += 10 {
		rows = append(rows, r)
		if r%30 == 0 && r != 500 {
			hot.cached[key(r)] = true
			cached++
		}
	}
	hot.pinned[key(500)] = true
	p, st, pusher := newTestPrefetcher(t, m, hot, DefaultConfig(4))
	b := NewBarrier()
	p.Submit(hints.Prefill, m.Layers[0], rows, b)
	s, err := b.Status(waitCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if want := uint64(len(rows) - cached - 1); pusher.pages.Load() != want {
		t.Fatalf("pushed %d pages, want %d (not the %d cached, not the pinned one)", pusher.pages.Load(), want, cached)
	}
	if s.Pages != uint64(len(rows)) || s.Resident != uint64(len(rows)-1) || s.Pinned != 1 {
		t.Fatalf("status %+v, want %d pages, %d resident (cached ones included), 1 pinned", s, len(rows), len(rows)-1)
	}
	if got := st.PrefetchPagesCached.Load(); got != uint64(cached) {
		t.Fatalf("prefetch_pages_cached %d, want %d", got, cached)
	}
	if sigs := hot.heard(key(30)); !slices.Equal(sigs, []cache.Signal{cache.SignalPrefill}) {
		t.Fatalf("the tier heard of a cached page as %v, want the prefill hint", sigs)
	}
	// 100 runs 10 pages apart, within spanGap: one lookup for them all.
	if hot.lookups != 1 {
		t.Fatalf("%d residency lookups for runs %d pages apart, want 1", hot.lookups, 10)
	}
	p.Faulted([]cache.PageKey{key(30)}) // evicted, then read
	if got := st.Layer(m.Layers[0]).Refaulted.Load(); got != 1 {
		t.Fatalf("refaulted %d after a fault on a cached hinted page, want 1", got)
	}

	// Decode work looks up too: its cached pages are not fetched, and the
	// barrier and the stats say how many there were.
	before, pushed := hot.lookups, pusher.pages.Load()
	b2 := NewBarrier()
	p.Submit(hints.Decode, m.Layers[0], rows, b2)
	s2, err := b2.Status(waitCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if hot.lookups != before+1 || pusher.pages.Load()-pushed != uint64(len(rows)-cached-1) {
		t.Fatalf("decode: %d lookups, %d pages pushed; want 1 and %d (not the cached, not the pinned one)", hot.lookups-before, pusher.pages.Load()-pushed, len(rows)-cached-1)
	}
	if s2.Cached != uint64(cached) || s2.Resident != uint64(len(rows)-1) || s2.Pinned != 1 {
		t.Fatalf("decode status %+v, want %d cached of %d resident, 1 pinned", s2, cached, len(rows)-1)
	}
	if got := st.PrefetchDecodePagesCached.Load(); got != uint64(cached) {
		t.Fatalf("prefetch_decode_pages_cached %d, want %d", got, cached)
	}
	if sigs := hot.heard(key(30)); !slices.Equal(sigs, []cache.Signal{cache.SignalPrefill, cache.SignalFault, cache.SignalDecode}) {
		t.Fatalf("the tier heard of a cached page as %v, want prefill, the fault, then decode", sigs)
	}
	before = hot.lookups

	// All pinned: no lookup at all.
	for _, r := range rows {
		hot.pinned[key(r)] = true
	}
	b3 := NewBarrier()
	p.Submit(hints.Prefill, m.Layers[0], rows, b3)
	if err := b3.Wait(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	if hot.lookups != before {
		t.Fatalf("%d residency lookups for pinned pages, want none", hot.lookups-before)
	}
}

// The residency window answers for exactly the pages it looked up: a long
// run takes a lookup per maxSpan pages, runs farther apart than spanGap one
// each, and every page's answer is its own.
func TestResidencyWindows(t *testing.T) {
	t.Run("windows", func(t *testing.T) { testResidencyWindows(t, false, 6) })
	// Where the tier says runs cost less a run at a time (cachestat), the
	// two runs that shared a window take a lookup each.
	t.Run("per-run", func(t *testing.T) { testResidencyWindows(t, true, 7) })
}

func testResidencyWindows(t *testing.T, perRun bool, lookups int) {
	hot := &recordingTier{cached: map[cache.PageKey]bool{}, perRun: perRun}
	for _, pg := range []uint64{5, 4100, 9999, 20000, 20100} {
		hot.cached[cache.PageKey{Table: 1, Page: pg}] = true
	}
	runs := []pageRun{
		{table: 1, first: 0, n: 10000},               // three windows
		{table: 1, first: 20000, n: 1},               // far: a window of its own...
		{table: 1, first: 20000 + spanGap - 1, n: 2}, // ...that reaches this one
		{table: 1, first: 20100, n: 1},               // past the gap: another
		{table: 2, first: 20100, n: 1},               // another table: another
	}
	var w residency
	for i, r := range runs {
		for pg := r.first; pg < r.first+r.n; pg++ {
			want := hot.cached[cache.PageKey{Table: r.table, Page: pg}]
			if got := w.present(hot, runs, i, pg); got != want {
				t.Fatalf("table %d page %d: present %v, want %v", r.table, pg, got, want)
			}
		}
	}
	if hot.lookups != lookups {
		t.Fatalf("%d lookups, want %d (3 windows of the long run, %d of the rest)", hot.lookups, lookups, lookups-3)
	}
}

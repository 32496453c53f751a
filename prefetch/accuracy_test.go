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
	mu       sync.Mutex
	admitted map[cache.PageKey]cache.Signal // each page's last signal
	log      map[cache.PageKey][]cache.Signal
	pinned   map[cache.PageKey]bool
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

func (r *recordingTier) Admit(keys []cache.PageKey, sig cache.Signal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.log == nil {
		r.log = map[cache.PageKey][]cache.Signal{}
	}
	for _, k := range keys {
		r.admitted[k] = sig
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
	hot := &recordingTier{admitted: map[cache.PageKey]cache.Signal{}, pinned: map[cache.PageKey]bool{}}
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
	if err := b.Wait(t.Context()); err != nil {
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
	hot.mu.Lock()
	defer hot.mu.Unlock()
	for _, k := range keys[:unique] {
		if k == pinned {
			continue
		}
		if sig, ok := hot.admitted[k]; !ok || sig != cache.SignalDecode {
			t.Fatalf("page %v admitted %v (%v), want as decode", k, ok, sig)
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
		if err := b.Wait(t.Context()); err != nil {
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
	if err := b.Wait(t.Context()); err != nil {
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

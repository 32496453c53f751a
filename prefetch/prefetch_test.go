package prefetch

import (
	"runtime"
	"sync"
	"testing"

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
	if late := p.ServedByFault([]cache.PageKey{{Table: tb.ID, Page: first}}); late != 1 {
		t.Fatalf("late %d, want 1", late)
	}
	close(br.release)
	s, err := b.Status(t.Context())
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

// Naming the same rows again costs nothing: 100 prefill frames of the same
// 50K rows hold what one frame holds (target: growth under 8 MiB).
func TestHeapIndependentOfMentions(t *testing.T) {
	m := testModel(t, 200000)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1 << 20}, m, cache.NewLoader(br, m.Tables, st), &countingPusher{}, nil, st, nil)
	defer func() { close(br.release); p.Close() }()
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
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	br := blockingReader{release: make(chan struct{})}
	p := New(Config{InflightPages: 1, PrefillQueuePages: 1 << 20}, m, cache.NewLoader(br, m.Tables, st), &countingPusher{}, nil, st, nil)
	defer func() { close(br.release); p.Close() }()
	rows := make([]uint64, hints.MaxRowsPerFrame)
	for i := range rows {
		rows[i] = 7
	}
	b := NewBarrier()
	p.Submit(hints.Decode, 0, rows, b)
	p.mu.Lock()
	n, named := len(p.c.pages), b.status.Pages
	p.mu.Unlock()
	if n != 1 || named != 1 {
		t.Fatalf("%d page states, %d pages counted; want 1", n, named)
	}
}

var _ = backing.DefaultTablePattern

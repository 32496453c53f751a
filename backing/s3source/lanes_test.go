package s3source

import (
	"bytes"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
)

// waitFor polls cond (every millisecond, for at most two minutes: the
// machine is shared, and this is never a timing assertion).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 2 minutes for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// With every GET slot held by prefetch reads and more prefetch reads
// queued, a demand read (a fault) takes the next free slot: its GET starts
// before any queued prefetch GET.
func TestDemandBeforeQueuedPrefetch(t *testing.T) {
	dir := synth(t)
	cfg := testConfig()
	cfg.Concurrency = 2
	src, f, _ := newFakeSource(t, dir, cfg)
	want, sf := shardBytes(t, dir, src)
	key := "m/" + sf.(*shard).name
	gate := map[int64]chan struct{}{0: make(chan struct{}), 512 << 10: make(chan struct{})}
	f.hold = func(g getReq, nth int) <-chan struct{} {
		if ch, ok := gate[g.off]; ok {
			return ch
		}
		return nil
	}
	var wg sync.WaitGroup
	submit := func(off int64, demand bool) {
		wg.Add(1)
		sf.Submit(&backing.ShardRead{Off: off, Len: 4096, Demand: demand, Done: func(b []byte, err error) {
			defer wg.Done()
			if err != nil || !bytes.Equal(b, want[off:off+4096]) {
				t.Errorf("read at %d (demand %v): %v, or wrong bytes", off, demand, err)
			}
		}})
	}
	// Two prefetch GETs hold both slots.
	submit(0, false)
	submit(512<<10, false)
	waitFor(t, "2 GETs", func() bool { return len(f.getLog()) == 2 })
	// Four more prefetch reads queue (submitted apart: no merging).
	queued := []int64{1 << 20, 1<<20 + 256<<10, 1<<20 + 512<<10, 1<<20 + 768<<10}
	for _, off := range queued {
		submit(off, false)
	}
	waitFor(t, "4 queued prefetch GETs", func() bool { _, p := src.slots.waiting(); return p == 4 })
	// Then a fault.
	const demandOff = 256 << 10
	submit(demandOff, true)
	waitFor(t, "a queued demand GET", func() bool { d, _ := src.slots.waiting(); return d == 1 })
	// One slot frees: the fault's GET is the next to start.
	close(gate[0])
	waitFor(t, "a third GET", func() bool { return len(f.getLog()) >= 3 })
	if g := f.getLog()[2]; g != (getReq{key, demandOff, 4096}) {
		t.Errorf("the GET after a slot freed is %+v, want the demand read at %d", g, demandOff)
	}
	close(gate[512<<10])
	wg.Wait()
	if got := len(f.getLog()); got != 7 {
		t.Errorf("%d GETs, want 7", got)
	}
}

// Prefetch reads are never hedged, however long their first byte takes;
// a demand read stalled the same way is hedged.
func TestPrefetchNeverHedged(t *testing.T) {
	dir := synth(t)
	cfg := testConfig()
	cfg.AttemptTimeout = time.Hour
	src, f, st := newFakeSource(t, dir, cfg)
	want, sf := shardBytes(t, dir, src)
	key := "m/" + sf.(*shard).name
	// Warm the latency window with fast demand GETs (hedging needs samples
	// and a budget).
	for i := int64(0); i < 200; i++ {
		if _, errs := readPagesAs(t, sf, []int64{(i % 64) * 4096}, 4096, true); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	if src.lat.delay(latencyQuiet) == 0 {
		t.Fatal("no p97 after 200 GETs")
	}
	// A prefetch GET whose first GET stalls until released, and a demand
	// GET, submitted after it, whose first GET stalls forever: only a hedge
	// can answer the demand read.
	before := st.S3Hedges.Load()
	const prefOff, demOff = 1 << 20, 1<<20 + 512<<10
	release := make(chan struct{})
	never := make(chan struct{})
	f.mu.Lock()
	f.hold = func(g getReq, nth int) <-chan struct{} {
		switch {
		case g.off == prefOff:
			return release
		case g.off == demOff && nth == 0:
			return never
		}
		return nil
	}
	f.mu.Unlock()
	prefDone := make(chan error, 1)
	sf.Submit(&backing.ShardRead{Off: prefOff, Len: 4096, Done: func(b []byte, err error) {
		if err == nil && !bytes.Equal(b, want[prefOff:prefOff+4096]) {
			t.Error("prefetch read: wrong bytes")
		}
		prefDone <- err
	}})
	waitFor(t, "the prefetch GET", func() bool {
		for _, g := range f.getLog() {
			if g.off == prefOff {
				return true
			}
		}
		return false
	})
	// The demand read waits out its hedge delay, as long as the prefetch
	// GET's would have been, and twice more.
	for i := 0; i < 3; i++ {
		data, errs := readPagesAs(t, sf, []int64{demOff + int64(i)*8192}, 4096, true)
		if errs[0] != nil || !bytes.Equal(data[0], want[demOff+int64(i)*8192:][:4096]) {
			t.Fatalf("stalled demand read: %v, or wrong bytes", errs[0])
		}
		f.mu.Lock()
		next := demOff + int64(i+1)*8192
		f.hold = func(g getReq, nth int) <-chan struct{} {
			switch {
			case g.off == prefOff:
				return release
			case g.off == next && nth == 0:
				return never
			}
			return nil
		}
		f.mu.Unlock()
	}
	close(release)
	if err := <-prefDone; err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range f.getLog() {
		if g == (getReq{key, prefOff, 4096}) {
			n++
		}
	}
	if n != 1 {
		t.Errorf("the stalled prefetch read made %d GETs, want 1 (never hedged)", n)
	}
	if h := st.S3Hedges.Load() - before; h < 3 {
		t.Errorf("%d hedges, want at least the 3 stalled demand reads'", h)
	}
}

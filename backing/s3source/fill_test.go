package s3source

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/stats"
)

// fillSource opens a Source over f with a mirror in dir and the fill lane
// at rate.
func fillSource(t *testing.T, f *fakeStore, dir string, budget, rate int64, concurrency int) (*Source, *stats.Counters) {
	t.Helper()
	cfg := testConfig()
	cfg.Concurrency = concurrency
	cfg.Mirror = MirrorConfig{Dir: dir, Size: budget, FillRate: rate}
	st := &stats.Counters{}
	src, err := newSource(f, "bucket", "m/", cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, st
}

// mirroredPages counts the pages of f whose bit is set.
func mirroredPages(f *mirrorFile) int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var n int64
	for p := int64(0); p < f.pages; p++ {
		if f.bits[p/64]&(1<<(p%64)) != 0 {
			n++
		}
	}
	return n
}

// The fill lane mirrors a whole object no read asked for, with its exact
// bytes (a new mount reads it all with 0 GETs), and never stops for good
// on a full queue: it pauses until there is room.
func TestFillMirrorsWithoutReads(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 10)
	f.put("m/"+mirrorKey, want)
	dir := t.TempDir()
	src, st := fillSource(t, f, dir, 64<<20, 1<<30, 8)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	mf := sf.(*shard).mir
	waitFor(t, "the fill lane to mirror the object", func() bool {
		src.mir.sync()
		return mirroredPages(mf) == mf.pages
	})
	if st.S3FillGets.Load() == 0 || st.S3FillBytes.Load() < uint64(len(want)) || st.MirrorHits.Load() != 0 {
		t.Errorf("%d fill GETs, %d fill bytes for %d, %d mirror hits (want 0: no read)", st.S3FillGets.Load(), st.S3FillBytes.Load(), len(want), st.MirrorHits.Load())
	}
	closeAll(t, sf, src)
	gets := st.S3Gets.Load()
	time.Sleep(50 * time.Millisecond)
	if st.S3Gets.Load() != gets {
		t.Error("GETs after Close: the fill lane did not stop")
	}

	// Remount without the lane: every page from the mirror.
	src, st = mirrorSource(t, f, dir, 64<<20)
	sf, err = src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int64
	for off := int64(0); off < int64(len(want)); off += 1 << 20 {
		offs = append(offs, off)
	}
	data, errs := readPages(t, sf, offs[:len(offs)-1], 1<<20)
	for i, off := range offs[:len(offs)-1] {
		if errs[i] != nil || !bytes.Equal(data[i], want[off:off+1<<20]) {
			t.Fatalf("read at %d: %v, or wrong bytes", off, errs[i])
		}
	}
	check(t, sf, want, []int64{offs[len(offs)-1]}, len(want)-int(offs[len(offs)-1]))
	if st.S3Gets.Load() != 0 {
		t.Errorf("%d GETs after the fill, want 0", st.S3Gets.Load())
	}
	closeAll(t, sf, src)
}

// The fill lane stops at the budget: it never evicts what reads brought
// in, and the pages it could not fit stay unmirrored.
func TestFillNeverEvicts(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 11)
	f.put("m/"+mirrorKey, want)
	const budget = 3 * mirrorExtent
	src, st := fillSource(t, f, t.TempDir(), budget, 0, 8) // no lane yet
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	// Reads bring in pages of the last extents.
	demanded := []int64{7 * mirrorExtent, 7*mirrorExtent + 1<<20, 6*mirrorExtent + 8192}
	check(t, sf, want, demanded, 4096)
	src.mir.sync()
	// Now the lane, with every page of the object to fill: far over budget.
	src.fill = newFiller(src, 1<<30)
	mf := sf.(*shard).mir
	waitFor(t, "the fill lane to fill the budget", func() bool {
		src.mir.sync()
		return mirroredPages(mf)*mirrorPage+fillChunk > budget
	})
	time.Sleep(100 * time.Millisecond) // room for a wrong eviction
	src.mir.sync()
	if n := st.MirrorEvictions.Load(); n != 0 {
		t.Errorf("%d evictions: the fill lane made room for itself", n)
	}
	if used := mirroredPages(mf) * mirrorPage; used > budget {
		t.Errorf("%d bytes mirrored, over the budget of %d", used, budget)
	}
	gets := st.S3Gets.Load() - st.S3FillGets.Load()
	check(t, sf, want, demanded, 4096)
	if got := st.S3Gets.Load() - st.S3FillGets.Load(); got != gets {
		t.Errorf("%d GETs for the demanded pages after the fill: evicted", got-gets)
	}
	closeAll(t, sf, src)
}

// The fill lane's bytes are bounded by its rate: at any time at most
// rate × elapsed + one chunk (a busy machine only lowers them). A demand
// read during the fill gets its bytes, and a fill GET that holds the only
// slot is canceled for it.
func TestFillRateAndPreemption(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 12)
	f.put("m/"+mirrorKey, want)
	const rate = 2 << 20
	start := time.Now()
	src, st := fillSource(t, f, t.TempDir(), 64<<20, rate, 1)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		time.Sleep(50 * time.Millisecond)
		filled := st.S3FillBytes.Load()
		if bound := rate*time.Since(start).Seconds() + fillChunk; float64(filled) > bound {
			t.Fatalf("%d bytes filled after %v: over %d B/s × elapsed + %d", filled, time.Since(start), rate, fillChunk)
		}
	}
	if st.S3FillBytes.Load() == 0 {
		t.Fatal("nothing filled in a second")
	}
	// Every fill GET now stalls until canceled: it holds the only slot.
	stalled := make(chan struct{}, 1)
	f.mu.Lock()
	f.hold = func(g getReq, nth int) <-chan struct{} {
		if g.n == fillChunk {
			select {
			case stalled <- struct{}{}:
			default:
			}
			return make(chan struct{}) // never
		}
		return nil
	}
	f.mu.Unlock()
	select {
	case <-stalled:
	case <-time.After(time.Minute):
		t.Fatal("no fill GET in a minute")
	}
	off := int64(len(want)) - 3*4096
	data, errs := readPagesAs(t, sf, []int64{off}, 4096, true)
	if errs[0] != nil || !bytes.Equal(data[0], want[off:off+4096]) {
		t.Fatalf("a demand read during the fill: %v, or wrong bytes", errs[0])
	}
	if st.S3FillPreempted.Load() == 0 {
		t.Error("the demand read got the only slot without preempting the fill GET")
	}
	closeAll(t, sf, src)
}

// Against a real store: the lane fills a shard's mirror with its exact
// bytes and no read, within its rate at every moment (one-sided: a busy
// machine only lowers the bytes), and a demand read during the fill gets
// its bytes.
func TestFillVersitygw(t *testing.T) {
	dir := synth(t)
	names, err := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	if err != nil || len(names) == 0 {
		t.Fatal(names, err)
	}
	want, err := os.ReadFile(names[0])
	if err != nil {
		t.Fatal(err)
	}
	// The fill takes about 2 s.
	rate := max(int64(len(want))/2, 64<<10)
	cfg := DefaultConfig()
	cfg.Mirror = MirrorConfig{Dir: t.TempDir(), Size: 64 << 20, FillRate: rate}
	st := &stats.Counters{}
	start := time.Now()
	src, _, _ := newServerSource(t, dir, cfg, st)
	sf, err := src.Open(filepath.Base(names[0]))
	if err != nil {
		t.Fatal(err)
	}
	mf := sf.(*shard).mir
	demanded := false
	waitFor(t, "the fill lane to mirror the shard", func() bool {
		filled := st.S3FillBytes.Load()
		if bound := float64(rate)*time.Since(start).Seconds() + fillChunk; float64(filled) > bound {
			t.Fatalf("%d bytes filled after %v: over %d B/s × elapsed + %d", filled, time.Since(start), rate, fillChunk)
		}
		if !demanded && filled > 0 {
			demanded = true
			off := int64(len(want)) / 4096 * 4096 / 2
			data, errs := readPagesAs(t, sf, []int64{off}, 4096, true)
			if errs[0] != nil || !bytes.Equal(data[0], want[off:off+4096]) {
				t.Fatalf("a demand read during the fill: %v, or wrong bytes", errs[0])
			}
		}
		src.mir.sync()
		return mirroredPages(mf) == mf.pages
	})
	// Read back whole as one mirror hit: the object's bytes.
	gets, hits := st.S3Gets.Load(), st.MirrorHits.Load()
	data, errs := readPages(t, sf, []int64{0}, len(want))
	if errs[0] != nil || !bytes.Equal(data[0], want) {
		t.Fatalf("the filled shard: %v, or wrong bytes", errs[0])
	}
	if st.S3Gets.Load() != gets || st.MirrorHits.Load() != hits+1 {
		t.Errorf("%d GETs, %d mirror hits reading the filled shard; want 0, 1", st.S3Gets.Load()-gets, st.MirrorHits.Load()-hits)
	}
	t.Logf("%d bytes filled by %d GETs in %v at %d B/s", st.S3FillBytes.Load(), st.S3FillGets.Load(), time.Since(start).Round(time.Millisecond), rate)
	closeAll(t, sf, src)
}

// An object rewritten under the mount: the lane's first GET of it stops
// the filling of its mirror (not a 412 a chunk from then on).
func TestFillStopsOnETagChange(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 13)
	f.put("m/"+mirrorKey, want)
	src, st := fillSource(t, f, t.TempDir(), 64<<20, 0, 8) // no lane yet
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	f.put("m/"+mirrorKey, mirrorObject(t, 14))
	src.fill = newFiller(src, 1<<30)
	src.fill.opened()
	waitFor(t, "the lane's first GET", func() bool { return st.S3FillGets.Load() > 0 })
	time.Sleep(100 * time.Millisecond)
	if n := st.S3FillGets.Load(); n != 1 || st.S3ETagFailures.Load() != 1 {
		t.Errorf("%d fill GETs, %d ETag failures of a rewritten object; want 1, 1", n, st.S3ETagFailures.Load())
	}
	closeAll(t, sf, src)
}

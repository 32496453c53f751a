package s3source

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/backing/sourcetest"
	"github.com/engramfs/engramfs/internal/pagecache"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
)

// mirrorObject is a 16 MiB object of random bytes (8 extents), plus a
// short last page.
func mirrorObject(t *testing.T, seed uint64) []byte {
	b := make([]byte, 16<<20+1000)
	rng := rand.New(rand.NewPCG(seed, seed+1))
	for i := 0; i+8 <= len(b); i += 8 {
		v := rng.Uint64()
		for j := 0; j < 8; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

const mirrorKey = "big.bin"

// mirrorSource opens a Source over f with a mirror in dir.
func mirrorSource(t *testing.T, f *fakeStore, dir string, budget int64) (*Source, *stats.Counters) {
	t.Helper()
	cfg := testConfig()
	cfg.Mirror = MirrorConfig{Dir: dir, Size: budget}
	st := &stats.Counters{}
	src, err := newSource(f, "bucket", "m/", cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, st
}

// check reads [off, off+n) for each off, as one Submit, and compares with
// want.
func check(t *testing.T, sf backing.ShardFile, want []byte, offs []int64, n int) {
	t.Helper()
	data, errs := readPages(t, sf, offs, n)
	for i, off := range offs {
		if errs[i] != nil || !bytes.Equal(data[i], want[off:off+int64(n)]) {
			t.Fatalf("read at %d: %v, or wrong bytes", off, errs[i])
		}
	}
}

func closeAll(t *testing.T, sf backing.ShardFile, src *Source) {
	t.Helper()
	if err := sf.Close(); err != nil {
		t.Fatal(err)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
}

// Pages fetched once are read again from the mirror: 0 GETs, the same
// bytes; a read that is not wholly mirrored is a GET. A new Source over
// the same mirror directory (a remount) reads them with 0 GETs too.
func TestMirrorServesAndSurvivesRemount(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 1)
	f.put("m/"+mirrorKey, want)
	dir := t.TempDir()
	src, st := mirrorSource(t, f, dir, 64<<20)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	offs := []int64{0, 4096, 3 << 20, 9<<20 + 8192}
	last := int64(len(want)) - 1000 - 4096 // the last whole page and the short one
	check(t, sf, want, offs, 4096)
	check(t, sf, want, []int64{last}, 5096)
	src.mir.sync()
	gets := st.S3Gets.Load()
	if st.MirrorBytesWritten.Load() != 4*4096+5096 {
		t.Errorf("mirror_bytes_written %d, want %d", st.MirrorBytesWritten.Load(), 4*4096+5096)
	}
	check(t, sf, want, offs, 4096)
	check(t, sf, want, []int64{0}, 8192)    // two mirrored pages
	check(t, sf, want, []int64{last}, 5096) // the short last page
	check(t, sf, want, []int64{100}, 3000)  // inside a page
	if got := st.S3Gets.Load() - gets; got != 0 {
		t.Errorf("%d GETs for mirrored pages, want 0", got)
	}
	if st.MirrorHits.Load() != 7 || st.MirrorBytesRead.Load() != 4*4096+8192+5096+3000 {
		t.Errorf("mirror hits %d, bytes read %d", st.MirrorHits.Load(), st.MirrorBytesRead.Load())
	}
	check(t, sf, want, []int64{4096}, 8192) // half mirrored: a GET
	if got := st.S3Gets.Load() - gets; got != 1 {
		t.Errorf("%d GETs for a half-mirrored read, want 1", got)
	}
	closeAll(t, sf, src)

	// Remount.
	src, st = mirrorSource(t, f, dir, 64<<20)
	sf, err = src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	check(t, sf, want, append(offs, 8192), 4096)
	check(t, sf, want, []int64{last}, 5096)
	hdr := make([]byte, 4000) // ReadAt (headers) reads the mirror too
	if n, err := sf.ReadAt(hdr, 3<<20+50); err != nil || n != len(hdr) || !bytes.Equal(hdr, want[3<<20+50:3<<20+4050]) {
		t.Fatalf("ReadAt from the mirror: %d, %v, or wrong bytes", n, err)
	}
	if got := st.S3Gets.Load(); got != 0 {
		t.Errorf("after a remount: %d GETs for mirrored pages, want 0", got)
	}
	if st.MirrorHits.Load() != 7 {
		t.Errorf("after a remount: %d mirror hits, want 7", st.MirrorHits.Load())
	}
	closeAll(t, sf, src)
}

// An object rewritten between mounts: the mirror is discarded at open and
// not one old byte is served; rewritten under a live mount: once a GET has
// seen the change, the mirror serves nothing of it either.
func TestMirrorETagChange(t *testing.T) {
	f := newFakeStore()
	old := mirrorObject(t, 2)
	f.put("m/"+mirrorKey, old)
	dir := t.TempDir()
	src, _ := mirrorSource(t, f, dir, 64<<20)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	offs := []int64{0, 1 << 20, 5 << 20}
	check(t, sf, old, offs, 8192)
	src.mir.sync()
	closeAll(t, sf, src)

	changed := mirrorObject(t, 3)
	f.put("m/"+mirrorKey, changed)
	src, st := mirrorSource(t, f, dir, 64<<20)
	sf, err = src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	check(t, sf, changed, offs, 8192)
	if st.S3Gets.Load() != uint64(len(offs)) || st.MirrorHits.Load() != 0 {
		t.Errorf("after the rewrite: %d GETs (want %d), %d mirror hits (want 0)", st.S3Gets.Load(), len(offs), st.MirrorHits.Load())
	}
	// Now mirrored as the new object: served with 0 GETs.
	src.mir.sync()
	check(t, sf, changed, offs, 8192)
	if st.S3Gets.Load() != uint64(len(offs)) || st.MirrorHits.Load() != uint64(len(offs)) {
		t.Errorf("the new mirror: %d GETs, %d hits", st.S3Gets.Load(), st.MirrorHits.Load())
	}

	// Rewritten again under the live mount: a read that needs a GET fails
	// with ErrShardChanged, and from then on the mirrored pages fail too.
	f.put("m/"+mirrorKey, old)
	if _, errs := readPages(t, sf, []int64{8 << 20}, 4096); errs[0] == nil {
		t.Fatal("a GET of a rewritten object succeeded")
	}
	data, errs := readPages(t, sf, offs, 8192)
	for i := range offs {
		if errs[i] == nil || data[i] != nil {
			t.Errorf("mirrored read at %d after the object changed: %d bytes, %v; want ErrShardChanged", offs[i], len(data[i]), errs[i])
		}
	}
	closeAll(t, sf, src)
}

// diskUsage is the bytes allocated to the mirror's data files.
func diskUsage(t *testing.T, dir string) int64 {
	t.Helper()
	matches, _ := filepath.Glob(filepath.Join(dir, "*.data"))
	var n int64
	for _, p := range matches {
		var s unix.Stat_t
		if err := unix.Stat(p, &s); err != nil {
			t.Fatal(err)
		}
		n += s.Blocks * 512
	}
	return n
}

// Reading a 16 MiB object through a mirror of 4 MiB: the data files never
// hold more than the budget and one extent, least recently used extents go
// first, and what was evicted is fetched again with the right bytes.
func TestMirrorBudget(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 4)
	f.put("m/"+mirrorKey, want)
	dir := t.TempDir()
	const budget = 4 << 20
	src, st := mirrorSource(t, f, dir, budget)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	// Extent 0 first, then every extent in turn (1 MiB reads), extent 0
	// read again (from the mirror) just before the last one.
	check(t, sf, want, []int64{0}, 1<<20)
	src.mir.sync()
	for off := int64(1 << 20); off+(1<<20) <= int64(len(want)); off += 1 << 20 {
		if off == 14<<20 {
			check(t, sf, want, []int64{0}, 1<<20)
		}
		check(t, sf, want, []int64{off}, 1<<20)
		src.mir.sync()
		if du := diskUsage(t, dir); du > budget+mirrorExtent {
			t.Fatalf("after reading to %d: %d bytes on disk, over the budget of %d and one extent", off+(1<<20), du, budget)
		}
	}
	if st.MirrorEvictions.Load() == 0 {
		t.Fatal("no eviction")
	}
	// Extent 0 was used recently: still mirrored. Extent 1 was not: evicted.
	gets := st.S3Gets.Load()
	check(t, sf, want, []int64{0}, 1<<20)
	if st.S3Gets.Load() != gets {
		t.Error("the recently used extent 0 was evicted")
	}
	check(t, sf, want, []int64{2 << 20}, 1<<20)
	if st.S3Gets.Load() != gets+1 {
		t.Error("extent 1, the least recently used, was not evicted")
	}
	t.Logf("%d extents evicted; %d bytes on disk for a budget of %d", st.MirrorEvictions.Load(), diskUsage(t, dir), budget)
	closeAll(t, sf, src)
	// The budget holds across a remount with a smaller one.
	src, _ = mirrorSource(t, f, dir, mirrorExtent)
	sf, err = src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	src.mir.sync()
	if du := diskUsage(t, dir); du > 2*mirrorExtent {
		t.Errorf("remounted with a budget of one extent: %d bytes on disk", du)
	}
	check(t, sf, want, []int64{0, 8 << 20}, 1<<20)
	closeAll(t, sf, src)
}

// A crash between writing pages and setting their bits: the pages are
// never served from the mirror, even when what is on disk is garbage.
func TestMirrorCrashBeforeBits(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 5)
	f.put("m/"+mirrorKey, want)
	dir := t.TempDir()
	src, st := mirrorSource(t, f, dir, 64<<20)
	src.mir.noBits = true
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	offs := []int64{0, 4 << 20}
	check(t, sf, want, offs, 65536)
	src.mir.sync()
	if st.MirrorBytesWritten.Load() != 0 {
		t.Errorf("%d bytes counted as mirrored without their bits", st.MirrorBytesWritten.Load())
	}
	closeAll(t, sf, src)
	// Torn or lost writes: the data file holds other bytes there.
	df, err := os.OpenFile(filepath.Join(dir, url.PathEscape(mirrorKey)+".data"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := df.WriteAt(bytes.Repeat([]byte{0xEE}, 65536), 0); err != nil {
		t.Fatal(err)
	}
	df.Close()

	src, st = mirrorSource(t, f, dir, 64<<20)
	sf, err = src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	check(t, sf, want, offs, 65536)
	if st.S3Gets.Load() != 2 || st.MirrorHits.Load() != 0 {
		t.Errorf("after the crash: %d GETs (want 2), %d mirror hits (want 0)", st.S3Gets.Load(), st.MirrorHits.Load())
	}
	closeAll(t, sf, src)
}

// One mirror directory, one daemon.
func TestMirrorDirLocked(t *testing.T) {
	f := newFakeStore()
	dir := t.TempDir()
	src, _ := mirrorSource(t, f, dir, 64<<20)
	defer src.Close()
	cfg := testConfig()
	cfg.Mirror = MirrorConfig{Dir: dir, Size: 64 << 20}
	if _, err := newSource(f, "bucket", "m/", cfg, nil); err == nil {
		t.Error("a second Source over a mirror directory in use: no error")
	}
}

// The conformance suite with a mirror: the same bytes and failures.
func TestConformanceFakeMirror(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		f := newFakeStore()
		if err := f.upload(dir, "m/"); err != nil {
			t.Fatal(err)
		}
		src, _ := mirrorSource(t, f, t.TempDir(), 64<<20)
		t.Cleanup(func() { src.Close() })
		return src
	})
}

// testEngine returns a read engine of depth reads in flight, closed when
// the test ends.
func testEngine(t testing.TB, depth int) ioengine.Engine {
	t.Helper()
	e, _, err := ioengine.New("auto", depth)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// engineMirrorSource opens a Source over a fake store holding
// mirrorObject(seed), with a mirror of budget bytes in dir read through
// eng.
func engineMirrorSource(t testing.TB, eng ioengine.Engine, dir string, seed uint64, budget int64) (*Source, *stats.Counters, []byte) {
	t.Helper()
	f := newFakeStore()
	want := mirrorObject(nil, seed)
	f.put("m/"+mirrorKey, want)
	cfg := testConfig()
	cfg.Mirror = MirrorConfig{Dir: dir, Size: budget, Engine: eng}
	st := &stats.Counters{}
	src, err := newSource(f, "bucket", "m/", cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, st, want
}

// countingEngine counts the reads submitted to an engine.
type countingEngine struct {
	ioengine.Engine
	reads atomic.Int64
}

func (e *countingEngine) Submit(reqs ...*ioengine.Req) {
	e.reads.Add(int64(len(reqs)))
	e.Engine.Submit(reqs...)
}

// residentPages counts the pages of path in the page cache.
func residentPages(t *testing.T, path string) int {
	t.Helper()
	n, err := pagecache.Count(testenv.MapFile(t, path))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Mirrored pages are read through the engine given (the one local shards
// use) with O_DIRECT where the filesystem takes it: neither the mirror's
// writes nor its reads leave the pages in the page cache. Where O_DIRECT
// fails (older tmpfs; here a test knob) they are read buffered, with the
// same bytes, and the Source says why.
func TestMirrorReadsThroughEngine(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			dir := t.TempDir()
			eng := &countingEngine{Engine: testEngine(t, 8)}
			src, st, want := engineMirrorSource(t, eng, dir, 6, 64<<20)
			if !direct {
				src.mir.noDirect = true
			}
			sf, err := src.Open(mirrorKey)
			if err != nil {
				t.Fatal(err)
			}
			if why := src.MirrorBuffered(); (why == "") != direct {
				t.Fatalf("MirrorBuffered() = %q", why)
			}
			offs := []int64{0, 1 << 20, 7<<20 + 4096, int64(len(want)) - 5000}
			check(t, sf, want, offs, 5000)
			src.mir.sync()
			gets := st.S3Gets.Load()
			check(t, sf, want, offs, 5000)
			check(t, sf, want, []int64{1<<20 + 100}, 3000)
			if st.S3Gets.Load() != gets || st.MirrorHits.Load() != uint64(len(offs)+1) {
				t.Errorf("%d GETs, %d mirror hits for mirrored reads; want 0, %d", st.S3Gets.Load()-gets, st.MirrorHits.Load(), len(offs)+1)
			}
			if n := eng.reads.Load(); n != int64(len(offs)+1) {
				t.Errorf("%d reads through the engine, want %d", n, len(offs)+1)
			}
			if direct {
				if n := residentPages(t, filepath.Join(dir, url.PathEscape(mirrorKey)+".data")); n != 0 {
					t.Errorf("%d pages of the mirror file in the page cache, want 0 (O_DIRECT reads, written pages dropped)", n)
				}
			}
			closeAll(t, sf, src)
		})
	}
}

// Reads race evictions: a mirror of one extent under readers of random
// pages of a 16 MiB object. No read returns anything but the object's
// bytes (a read of a page being punched would return zeros).
func TestMirrorReadsRaceEvictions(t *testing.T) {
	f := newFakeStore()
	want := mirrorObject(t, 7)
	f.put("m/"+mirrorKey, want)
	src, st := mirrorSource(t, f, t.TempDir(), mirrorExtent)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 8))
			for i := range 150 {
				if g == 0 && i%10 == 9 {
					src.mir.sync() // a busy writer drops pages: let it catch up
				}
				// Mostly the first extents (mirrored, read again), some
				// elsewhere (fetched, mirrored, evicting).
				var offs []int64
				for range 8 {
					ext := rng.Int64N(2)
					if rng.IntN(4) == 0 {
						ext = rng.Int64N(8)
					}
					offs = append(offs, ext*mirrorExtent+rng.Int64N(mirrorExtent/4096)*4096)
				}
				data, errs := readPages(t, sf, offs, 4096)
				for i, off := range offs {
					if errs[i] != nil || !bytes.Equal(data[i], want[off:off+4096]) {
						t.Errorf("read at %d: %v, or wrong bytes", off, errs[i])
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if st.MirrorHits.Load() == 0 || st.MirrorEvictions.Load() == 0 {
		t.Errorf("%d mirror hits, %d evictions: the race was not run", st.MirrorHits.Load(), st.MirrorEvictions.Load())
	}
	t.Logf("%d mirror hits, %d evictions, %d GETs", st.MirrorHits.Load(), st.MirrorEvictions.Load(), st.S3Gets.Load())
	closeAll(t, sf, src)
}

// holdingEngine holds the reads submitted while hold is set, until
// release.
type holdingEngine struct {
	ioengine.Engine
	mu   sync.Mutex
	hold bool
	held []*ioengine.Req
}

func (e *holdingEngine) Submit(reqs ...*ioengine.Req) {
	e.mu.Lock()
	if e.hold {
		e.held = append(e.held, reqs...)
		e.mu.Unlock()
		return
	}
	e.mu.Unlock()
	e.Engine.Submit(reqs...)
}

func (e *holdingEngine) release() {
	e.mu.Lock()
	held := e.held
	e.hold, e.held = false, nil
	e.mu.Unlock()
	e.Engine.Submit(held...)
}

// A mirror read in flight while its extent is evicted and punched: its
// bytes (maybe the zeros of the hole) are not used; it is answered by a
// GET, with the object's bytes. Eviction does not wait for reads.
func TestMirrorReadRacingEvictionRefetches(t *testing.T) {
	eng := &holdingEngine{Engine: testEngine(t, 8)}
	src, st, want := engineMirrorSource(t, eng, t.TempDir(), 8, mirrorExtent)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	check(t, sf, want, []int64{8192}, 4096)
	src.mir.sync()
	// A mirror hit in extent 0, held before it reaches the disk.
	eng.mu.Lock()
	eng.hold = true
	eng.mu.Unlock()
	type result struct {
		data []byte
		err  error
	}
	res := make(chan result, 1)
	sf.Submit(&backing.ShardRead{Off: 8192, Len: 4096, Done: func(b []byte, err error) { res <- result{b, err} }})
	waitFor(t, "the held mirror read", func() bool {
		eng.mu.Lock()
		defer eng.mu.Unlock()
		return len(eng.held) == 1
	})
	// Extent 3 fetched and mirrored: over the budget, extent 0 (the least
	// recently used) is evicted.
	check(t, sf, want, []int64{3 * mirrorExtent, 3*mirrorExtent + 1<<20}, 1<<20)
	src.mir.sync() // extent 0 evicted and punched, the read still held
	if st.MirrorEvictions.Load() == 0 {
		t.Fatal("no eviction")
	}
	gets := st.S3Gets.Load()
	eng.release()
	r := <-res
	if r.err != nil || !bytes.Equal(r.data, want[8192:8192+4096]) {
		t.Fatalf("the held read: %v, or wrong bytes (zeros: read from a punched hole)", r.err)
	}
	if st.S3Gets.Load() != gets+1 {
		t.Errorf("%d GETs for the read of an evicted page, want 1", st.S3Gets.Load()-gets)
	}
	closeAll(t, sf, src)
}

package s3source

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/sourcetest"
	"github.com/engramfs/engramfs/internal/stats"
)

// testConfig retries quickly: the tests inject many faults.
func testConfig() Config {
	cfg := DefaultConfig()
	cfg.Backoff = time.Millisecond
	return cfg
}

func newFakeSource(t *testing.T, dir string, cfg Config) (*Source, *fakeStore, *stats.Counters) {
	t.Helper()
	f := newFakeStore()
	if err := f.upload(dir, "m/"); err != nil {
		t.Fatal(err)
	}
	st := &stats.Counters{}
	src, err := newSource(f, "bucket", "m/", cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, f, st
}

func synth(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := backing.Synthesize(dir, sourcetest.Spec()); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestConformanceFake(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		src, _, _ := newFakeSource(t, dir, testConfig())
		return src
	})
}

func TestParseURL(t *testing.T) {
	for in, want := range map[string][2]string{
		"s3://b":           {"b", ""},
		"s3://b/":          {"b", ""},
		"s3://b/p":         {"b", "p/"},
		"s3://b/p/q/":      {"b", "p/q/"},
		"s3://b//p//":      {"b", "p/"},
		"s3://my.bucket/x": {"my.bucket", "x/"},
	} {
		b, p, err := ParseURL(in)
		if err != nil || b != want[0] || p != want[1] {
			t.Errorf("ParseURL(%q) = %q, %q, %v; want %q, %q", in, b, p, err, want[0], want[1])
		}
	}
	for _, bad := range []string{"", "/models", "s3://", "s3:///p", "gs://b/p"} {
		if _, _, err := ParseURL(bad); err == nil {
			t.Errorf("ParseURL(%q): no error", bad)
		}
	}
}

func TestPlan(t *testing.T) {
	rd := func(off int64, n int) *backing.ShardRead { return &backing.ShardRead{Off: off, Len: n} }
	// One span: adjacent, a gap of exactly 64 KiB, overlapping. It ends at
	// 8192+64 KiB+100+8000 = 81828.
	reads := []*backing.ShardRead{
		rd(400<<10, 4096), // far from the rest: its own span
		rd(0, 4096),
		rd(4096, 4096),
		rd(8192+64<<10, 4096),
		rd(8192+64<<10+100, 8000),
		rd(81828+64<<10+1, 1), // a gap of 64 KiB + 1: a span of its own
		rd(10<<20, 3<<20),     // longer than max: alone
	}
	spans := plan(reads, 64<<10, 1<<20, math.Inf(1))
	type got struct {
		off, n int64
		reads  int
	}
	var have []got
	for _, s := range spans {
		have = append(have, got{s.off, s.n, len(s.reads)})
	}
	want := []got{
		{0, 81828, 4},
		{81828 + 64<<10 + 1, 1, 1},
		{400 << 10, 4096, 1},
		{10 << 20, 3 << 20, 1},
	}
	if len(have) != len(want) {
		t.Fatalf("plan = %v, want %v", have, want)
	}
	for i := range want {
		if have[i] != want[i] {
			t.Errorf("span %d = %+v, want %+v", i, have[i], want[i])
		}
	}
	// The 1 MiB bound: 300 pages 8 KiB apart make spans of at most 1 MiB.
	reads = reads[:0]
	for i := int64(0); i < 300; i++ {
		reads = append(reads, rd(i*8192, 4096))
	}
	total := 0
	for _, s := range plan(reads, 64<<10, 1<<20, math.Inf(1)) {
		if s.n > 1<<20 {
			t.Errorf("span of %d bytes, over 1 MiB", s.n)
		}
		total += len(s.reads)
	}
	if total != 300 {
		t.Errorf("spans answer %d reads, want 300", total)
	}
}

// TestPlanWaste: a gap joins a span only while the span's unwanted bytes
// stay within waste times its wanted bytes.
func TestPlanWaste(t *testing.T) {
	rd := func(off int64, n int) *backing.ShardRead { return &backing.ShardRead{Off: off, Len: n} }
	spans := func(waste float64, reads ...*backing.ShardRead) [][2]int64 {
		var out [][2]int64
		for _, s := range plan(reads, 64<<10, 1<<20, waste) {
			if s.n-s.want > int64(waste*float64(s.want)) {
				t.Errorf("span %+v carries %d unwanted bytes for %d wanted, over %.2f", [2]int64{s.off, s.n}, s.n-s.want, s.want, waste)
			}
			out = append(out, [2]int64{s.off, s.n})
		}
		return out
	}
	check := func(what string, got, want [][2]int64) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: spans %v, want %v", what, got, want)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%s: span %d = %v, want %v", what, i, got[i], want[i])
			}
		}
	}
	// Two lone pages 8 KiB apart: 8 KiB of gap for 8 KiB wanted is over 25%.
	check("lone pages", spans(0.25, rd(0, 4096), rd(12288, 4096)), [][2]int64{{0, 4096}, {12288, 4096}})
	// Adjacent and overlapping reads carry no gap: one span at any waste.
	check("adjacent", spans(0, rd(0, 4096), rd(4096, 4096), rd(6000, 4096)), [][2]int64{{0, 10096}})
	// A dense run of 8 pages takes a 4 KiB gap (4 KiB for 36 KiB wanted).
	var dense []*backing.ShardRead
	for i := int64(0); i < 8; i++ {
		dense = append(dense, rd(i*4096, 4096))
	}
	dense = append(dense, rd(9*4096, 4096))
	check("dense run and a gap", spans(0.25, dense...), [][2]int64{{0, 10 * 4096}})
	// At waste 1, the lone pages are one GET (8 KiB of gap for 8 KiB wanted).
	check("waste 1", spans(1, rd(0, 4096), rd(12288, 4096)), [][2]int64{{0, 16384}})
	// 3000 random pages of a 1 GiB shard: at most 1.25 bytes per wanted byte.
	rng := rand.New(rand.NewPCG(3, 4))
	var random []*backing.ShardRead
	wanted := map[int64]bool{}
	for len(random) < 3000 {
		p := rng.Int64N(1 << 18)
		if !wanted[p] {
			wanted[p] = true
			random = append(random, rd(p*4096, 4096))
		}
	}
	var fetched int64
	for _, s := range spans(0.25, random...) {
		fetched += s[1]
	}
	if r := float64(fetched) / float64(3000*4096); r > 1.25 {
		t.Errorf("random pages: %.3f bytes fetched per byte wanted", r)
	}
}

// shardBytes is the local copy of the first shard, and the shard opened
// through src.
func shardBytes(t *testing.T, dir string, src *Source) ([]byte, backing.ShardFile) {
	t.Helper()
	names, err := src.List(".safetensors")
	if err != nil || len(names) == 0 {
		t.Fatalf("List: %v, %v", names, err)
	}
	want, err := os.ReadFile(filepath.Join(dir, names[0]))
	if err != nil {
		t.Fatal(err)
	}
	sf, err := src.Open(names[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sf.Close() })
	return want, sf
}

// readPages submits the pages at offs in one call, as prefetch reads, and
// waits.
func readPages(t *testing.T, sf backing.ShardFile, offs []int64, n int) ([][]byte, []error) {
	t.Helper()
	return readPagesAs(t, sf, offs, n, false)
}

// readPagesAs is readPages with the reads' Demand flag.
func readPagesAs(t *testing.T, sf backing.ShardFile, offs []int64, n int, demand bool) ([][]byte, []error) {
	t.Helper()
	data, errs := make([][]byte, len(offs)), make([]error, len(offs))
	var wg sync.WaitGroup
	wg.Add(len(offs))
	reads := make([]*backing.ShardRead, len(offs))
	for i, off := range offs {
		reads[i] = &backing.ShardRead{Off: off, Len: n, Demand: demand, Done: func(b []byte, err error) {
			data[i], errs[i] = b, err
			wg.Done()
		}}
	}
	sf.Submit(reads...)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("reads not answered within 2 minutes")
	}
	return data, errs
}

// Every kind of transient fault, on the first GETs of every range: the
// reads still get exactly their bytes, after retries.
func TestRetriesTransientFaults(t *testing.T) {
	dir := synth(t)
	for _, flt := range []fault{fault503, faultReset, faultResetBody, faultTruncated, faultWhole200, faultWrongRange} {
		src, f, st := newFakeSource(t, dir, testConfig())
		f.fault = func(g getReq, nth int) fault {
			if nth < 2 {
				return flt
			}
			return faultNone
		}
		want, sf := shardBytes(t, dir, src)
		offs := []int64{0, 300 << 10, 1 << 20}
		data, errs := readPages(t, sf, offs, 4096)
		for i, off := range offs {
			if errs[i] != nil || !bytes.Equal(data[i], want[off:off+4096]) {
				t.Fatalf("fault %d: page at %d: %v, or wrong bytes", flt, off, errs[i])
			}
		}
		if got := st.S3Retries.Load(); got != 2*uint64(len(offs)) {
			t.Errorf("fault %d: %d retries, want %d", flt, got, 2*len(offs))
		}
		if got := st.S3Gets.Load(); got != 3*uint64(len(offs)) {
			t.Errorf("fault %d: %d GETs, want %d", flt, got, 3*len(offs))
		}
	}
}

// A fault that does not go away fails the read after Attempts GETs, with an
// error and no bytes.
func TestGivesUp(t *testing.T) {
	dir := synth(t)
	src, f, st := newFakeSource(t, dir, testConfig())
	f.fault = func(getReq, int) fault { return fault503 }
	_, sf := shardBytes(t, dir, src)
	data, errs := readPages(t, sf, []int64{8192}, 4096)
	if errs[0] == nil || data[0] != nil {
		t.Fatalf("a read that always gets 503: %d bytes, %v", len(data[0]), errs[0])
	}
	if !backing.PageError(errs[0]) {
		t.Errorf("a 503 is not a page error: %v", errs[0])
	}
	if got := st.S3Gets.Load(); got != uint64(testConfig().Attempts) {
		t.Errorf("%d GETs, want %d", got, testConfig().Attempts)
	}
}

// An object rewritten under the mount: every later read fails with
// ErrShardChanged (the GET is conditional on the old ETag), never new bytes.
func TestETagChange(t *testing.T) {
	dir := synth(t)
	src, f, st := newFakeSource(t, dir, testConfig())
	want, sf := shardBytes(t, dir, src)
	if data, errs := readPages(t, sf, []int64{4096}, 4096); errs[0] != nil || !bytes.Equal(data[0], want[4096:8192]) {
		t.Fatalf("before the rewrite: %v", errs[0])
	}
	changed := bytes.Clone(want)
	for i := range changed {
		changed[i] ^= 0x5A
	}
	f.put("m/"+sf.(*shard).name, changed)
	data, errs := readPages(t, sf, []int64{4096, 1 << 20}, 4096)
	for i := range errs {
		if !errors.Is(errs[i], backing.ErrShardChanged) || data[i] != nil {
			t.Fatalf("after the rewrite: %d bytes, %v; want ErrShardChanged", len(data[i]), errs[i])
		}
	}
	if backing.PageError(errs[0]) {
		t.Error("ErrShardChanged is a page error: the loader would retry page by page")
	}
	if st.S3ETagFailures.Load() != 2 || st.S3Retries.Load() != 0 {
		t.Errorf("etag failures %d (want 2), retries %d (want 0)", st.S3ETagFailures.Load(), st.S3Retries.Load())
	}
	if _, err := sf.ReadAt(make([]byte, 10), 0); !errors.Is(err, backing.ErrShardChanged) {
		t.Errorf("ReadAt after the rewrite: %v, want ErrShardChanged", err)
	}
}

// Reads submitted together within 64 KiB are one GET of exactly their
// span; reads far apart are a GET each; nothing else is asked for.
func TestMergesNearbyReads(t *testing.T) {
	dir := synth(t)
	cfg := testConfig()
	cfg.MergeWaste = 100 // the gap rule alone (TestPlanWaste bounds the waste)
	src, f, st := newFakeSource(t, dir, cfg)
	want, sf := shardBytes(t, dir, src)
	offs := []int64{40960, 8192, 8192 + 4096, 1 << 20, 40960 + 64<<10 + 4096}
	data, errs := readPages(t, sf, offs, 4096)
	for i, off := range offs {
		if errs[i] != nil || !bytes.Equal(data[i], want[off:off+4096]) {
			t.Fatalf("page at %d: %v, or wrong bytes", off, errs[i])
		}
	}
	got := map[getReq]bool{}
	for _, g := range f.getLog() {
		got[g] = true
	}
	key := "m/" + sf.(*shard).name
	wantGets := map[getReq]bool{
		{key, 8192, 40960 + 64<<10 + 8192 - 8192}: true,
		{key, 1 << 20, 4096}:                      true,
	}
	if len(got) != len(wantGets) {
		t.Fatalf("GETs %v, want %v", got, wantGets)
	}
	for g := range wantGets {
		if !got[g] {
			t.Errorf("GETs %v lack %v", got, g)
		}
	}
	if st.BackingReads.Load() != 2 || st.S3Gets.Load() != 2 {
		t.Errorf("backing reads %d, GETs %d; want 2 and 2", st.BackingReads.Load(), st.S3Gets.Load())
	}
}

// A demand GET with no first byte after the p97 gets a second GET, which
// answers; hedges stay within 5% of GETs.
func TestHedgesSlowGETs(t *testing.T) {
	dir := synth(t)
	cfg := testConfig()
	cfg.AttemptTimeout = time.Hour // a stalled GET is answered by its hedge or not at all
	src, f, st := newFakeSource(t, dir, cfg)
	var slow sync.Map // getReq -> true: its next GET stalls
	f.latency = func(g getReq, nth int) time.Duration {
		if _, ok := slow.LoadAndDelete(g); ok {
			return time.Hour // canceled when the hedge wins
		}
		return 0
	}
	want, sf := shardBytes(t, dir, src)
	rng := rand.New(rand.NewPCG(5, 6))
	size := int64(len(want))
	// Warm the latency window: 200 fast GETs, one at a time.
	for i := 0; i < 200; i++ {
		off := rng.Int64N(size/4096) * 4096
		if _, errs := readPagesAs(t, sf, []int64{off}, min(4096, int(size-off)), true); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	// Two stalled GETs: both hedged, both answered by the hedge.
	for _, off := range []int64{8192, 1 << 20} {
		slow.Store(getReq{"m/" + sf.(*shard).name, off, 4096}, true)
		data, errs := readPagesAs(t, sf, []int64{off}, 4096, true)
		if errs[0] != nil || !bytes.Equal(data[0], want[off:off+4096]) {
			t.Fatalf("stalled page at %d: %v, or wrong bytes", off, errs[0])
		}
	}
	// At least the two stalled GETs were hedged (a loaded machine may push
	// a fast GET past the p97 too: no timing is asserted).
	if st.S3Hedges.Load() < 2 {
		t.Errorf("%d hedges, want at least 2", st.S3Hedges.Load())
	}
	// Now every first GET of a range stalls for 50 ms: only 5% of the
	// GETs may be hedged.
	f.mu.Lock()
	f.latency = func(g getReq, nth int) time.Duration {
		if nth == 0 {
			return 50 * time.Millisecond
		}
		return 0
	}
	f.mu.Unlock()
	before := st.S3Hedges.Load()
	for i := 0; i < 50; i++ {
		off := rng.Int64N(size/4096-1) * 4096
		if _, errs := readPagesAs(t, sf, []int64{off}, 4096, true); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	hedges, primaries := st.S3Hedges.Load(), src.budget.gets.Load()
	if hedges*100 > primaries*5 {
		t.Errorf("%d hedges for %d demand GETs: over 5%%", hedges, primaries)
	}
	if hedges == before {
		t.Errorf("no hedge among 50 GETs that all stall: the budget is never used")
	}
}

// quietSamples returns the lone-GET class's samples, oldest first.
func quietSamples(src *Source) []time.Duration {
	src.lat.mu.Lock()
	defer src.lat.mu.Unlock()
	r := &src.lat.class[latencyQuiet]
	var out []time.Duration
	for i := min(r.n, latencyWindow); i >= 1; i-- {
		out = append(out, r.d[(r.n-i)%latencyWindow])
	}
	return out
}

// A primary GET stopped by its winning hedge is a sample of the time it
// waited (at least the hedge delay), not left out: left out, a store whose
// slow GETs are always hedged would keep only its fast answers in the
// window, the p97 would sink toward the median and hedges would stop
// paying off when they are needed most.
func TestHedgedPrimaryCountsItsWait(t *testing.T) {
	dir := synth(t)
	cfg := testConfig()
	cfg.AttemptTimeout = time.Hour
	src, f, _ := newFakeSource(t, dir, cfg)
	var stall sync.Map // getReq -> true: its first GET waits until canceled
	f.hold = func(g getReq, nth int) <-chan struct{} {
		if _, ok := stall.Load(g); ok && nth == 0 {
			return make(chan struct{}) // never closed: only a cancel ends it
		}
		return nil
	}
	want, sf := shardBytes(t, dir, src)
	// Enough lone demand GETs for an estimate and a hedge's credit.
	for i := range 2 * latencyWarmup {
		if _, errs := readPagesAs(t, sf, []int64{int64(i) * 4096}, 4096, true); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	delay := src.lat.delay(latencyQuiet)
	if delay == 0 {
		t.Fatal("no hedge delay after the warm-up")
	}
	before := len(quietSamples(src))
	off := int64(64 * 4096)
	stall.Store(getReq{"m/" + sf.(*shard).name, off, 4096}, true)
	data, errs := readPagesAs(t, sf, []int64{off}, 4096, true)
	if errs[0] != nil || !bytes.Equal(data[0], want[off:off+4096]) {
		t.Fatalf("stalled page: %v, or wrong bytes", errs[0])
	}
	samples := quietSamples(src)
	if got := len(samples) - before; got != 2 {
		t.Fatalf("%d samples for a hedged read, want 2: the hedge's first byte and the primary it stopped", got)
	}
	// The primary is sampled last: get returns once it has stopped.
	if waited := samples[len(samples)-1]; waited < delay {
		t.Errorf("the stopped primary counted %v, want at least the %v it waited before its hedge", waited, delay)
	}
}

// A body that stalls after its headers (and half its bytes) is given up
// after StallTimeout without a byte, and the read is retried: with only the
// attempt timeout (an hour here; 30 s by default) it waited that long, for
// demand and prefetch reads alike (the hedge waits for a first byte only).
func TestStalledBodyIsRetried(t *testing.T) {
	dir := synth(t)
	for _, demand := range []bool{true, false} {
		t.Run(fmt.Sprintf("demand=%v", demand), func(t *testing.T) {
			cfg := testConfig()
			cfg.AttemptTimeout = time.Hour
			cfg.StallTimeout = 50 * time.Millisecond
			src, f, st := newFakeSource(t, dir, cfg)
			f.fault = func(g getReq, nth int) fault {
				if nth == 0 {
					return faultStallBody
				}
				return faultNone
			}
			want, sf := shardBytes(t, dir, src)
			offs := []int64{0, 1 << 20}
			data, errs := readPagesAs(t, sf, offs, 4096, demand)
			for i, off := range offs {
				if errs[i] != nil || !bytes.Equal(data[i], want[off:off+4096]) {
					t.Fatalf("read at %d behind a stalled body: %v, or wrong bytes", off, errs[i])
				}
			}
			if st.S3Retries.Load() < uint64(len(offs)) {
				t.Errorf("%d retries for %d stalled bodies", st.S3Retries.Load(), len(offs))
			}
		})
	}
}

// Close cancels a GET in flight: the read fails with ErrClosed, Close
// returns.
func TestCloseCancelsGETs(t *testing.T) {
	dir := synth(t)
	src, f, _ := newFakeSource(t, dir, testConfig())
	f.latency = func(getReq, int) time.Duration { return time.Hour }
	_, sf := shardBytes(t, dir, src)
	errc := make(chan error, 1)
	sf.Submit(&backing.ShardRead{Off: 0, Len: 4096, Done: func(_ []byte, err error) { errc <- err }})
	if err := sf.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, backing.ErrClosed) {
			t.Errorf("read canceled by Close: %v, want ErrClosed", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the read was not answered")
	}
}

// Many random row reads through LoadSource and the Store, concurrently,
// with 503s, resets, truncated bodies and 200s to range requests injected
// at random, and one shard rewritten halfway: not one wrong byte. Reads of
// the rewritten shard fail with ErrShardChanged, other failures only after
// every attempt failed.
func TestSoakNoWrongBytes(t *testing.T) {
	dir := soakModel(t)
	src, f, st := newFakeSource(t, dir, testConfig())
	var rmu sync.Mutex
	rng := rand.New(rand.NewPCG(11, 12))
	f.fault = func(getReq, int) fault {
		rmu.Lock()
		defer rmu.Unlock()
		switch x := rng.Float64(); {
		case x < 0.08:
			return fault503
		case x < 0.12:
			return faultTruncated
		case x < 0.16:
			return faultResetBody
		case x < 0.18:
			return faultReset
		case x < 0.20:
			return faultWhole200
		}
		return faultNone
	}
	soak(t, dir, src, st, func(name string, b []byte) { f.put("m/"+name, b) }, false)
}

func soakModel(t *testing.T) string { return soakModelRows(t, 2048) }

// soakReads is how many reads (of 1 to 64 rows each, ~32 on average) a
// soak makes: 4000, or $ENGRAMFS_SOAK_READS (the million row reads:
// ENGRAMFS_SOAK_READS=32000).
func soakReads(t *testing.T) int {
	v := os.Getenv("ENGRAMFS_SOAK_READS")
	if v == "" {
		return 4000
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 100 {
		t.Fatalf("ENGRAMFS_SOAK_READS=%q: want a number of reads, at least 100", v)
	}
	return n
}

func soakModelRows(t *testing.T, rows uint64) string {
	dir := t.TempDir()
	spec := backing.DefaultSynth()
	spec.Rows = rows
	spec.FlashGeometry()
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	return dir
}

// soak reads rows of the model in dir at random through src, rewriting
// one shard (with rewrite) halfway. No read of the rewritten shard may
// succeed after the rewrite; with cached set (a mirror: pages kept from
// before the rewrite, like pages in RAM), none submitted after the first
// ErrShardChanged was delivered.
func soak(t *testing.T, dir string, src backing.Source, st *stats.Counters, rewrite func(name string, b []byte), cached bool) {
	m, err := backing.LoadSource(src, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	store, err := backing.Open(m, src, st)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	shards := map[string][]byte{}
	for _, sh := range m.Shards {
		b, err := os.ReadFile(filepath.Join(dir, sh.Name))
		if err != nil {
			t.Fatal(err)
		}
		shards[sh.Name] = b
	}
	rng := rand.New(rand.NewPCG(13, 14))
	reads := soakReads(t)
	rowReads := 0
	var (
		mu                             sync.Mutex
		ok, wrong, changed, failed, rw int
		rewritten                      = m.Shards[0].Name
		after                          bool // the rewrite happened
		seen                           bool // an ErrShardChanged was delivered
	)
	var wg sync.WaitGroup
	for i := 0; i < reads; i++ {
		if i == reads/2 {
			wg.Wait()
			b := bytes.Clone(shards[rewritten])
			for j := range b {
				b[j] ^= 0xFF
			}
			rewrite(rewritten, b)
			mu.Lock()
			after = true
			mu.Unlock()
		}
		tb := m.Tables[rng.IntN(len(m.Tables))]
		row := rng.Int64N(int64(tb.Rows))
		rows := 1 + rng.Int64N(min(64, int64(tb.Rows)-row))
		rowReads += int(rows)
		off, n := row*tb.RowBytes, int(rows*tb.RowBytes)
		want := shards[tb.Shard.Name][tb.DataStart+off : tb.DataStart+off+int64(n)]
		mu.Lock()
		strict := after && (!cached || seen)
		mu.Unlock()
		wg.Add(1)
		store.Submit(&backing.TableRead{Table: tb, Off: off, Len: n, Done: func(data []byte, err error) {
			defer wg.Done()
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && bytes.Equal(data, want):
				ok++
			case err == nil:
				wrong++
			case errors.Is(err, backing.ErrShardChanged):
				changed++
				seen = true
				if !after || tb.Shard.Name != rewritten {
					t.Errorf("ErrShardChanged before the rewrite or on another shard: %v", err)
				}
			default:
				failed++
			}
			if strict && tb.Shard.Name == rewritten && err == nil {
				rw++
			}
		}})
	}
	wg.Wait()
	t.Logf("%d reads (%d row reads): %d right (%d from the mirror), %d wrong, %d ErrShardChanged, %d failed after %d attempts; %d GETs, %d retries, %d ETag failures",
		reads, rowReads, ok, st.MirrorHits.Load(), wrong, changed, failed, testConfig().Attempts, st.S3Gets.Load(), st.S3Retries.Load(), st.S3ETagFailures.Load())
	if wrong != 0 || rw != 0 {
		t.Fatalf("%d reads with wrong bytes, %d answered from the rewritten shard", wrong, rw)
	}
	if changed == 0 || ok < reads/3 || st.S3Retries.Load() == 0 {
		t.Errorf("the soak did not exercise the faults: %d changed, %d right, %d retries", changed, ok, st.S3Retries.Load())
	}
}

// The soak with a mirror: the same faults, not one wrong byte.
func TestSoakMirror(t *testing.T) {
	// Big enough that the reads before the rewrite leave pages unmirrored,
	// which reads after it must fetch (and find changed).
	dir := soakModelRows(t, 16384)
	f := newFakeStore()
	if err := f.upload(dir, "m/"); err != nil {
		t.Fatal(err)
	}
	var rmu sync.Mutex
	rng := rand.New(rand.NewPCG(15, 16))
	f.fault = func(getReq, int) fault {
		rmu.Lock()
		defer rmu.Unlock()
		if rng.Float64() < 0.2 {
			return []fault{fault503, faultTruncated, faultResetBody, faultReset, faultWhole200, faultWrongRange}[rng.IntN(6)]
		}
		return faultNone
	}
	src, st := mirrorSource(t, f, t.TempDir(), 64<<20)
	defer src.Close()
	soak(t, dir, src, st, func(name string, b []byte) { src.mir.sync(); f.put("m/"+name, b) }, true)
	if st.MirrorHits.Load() == 0 {
		t.Error("the soak never read the mirror")
	}
}

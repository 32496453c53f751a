package bench

import (
	"bytes"
	"encoding/json"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// fakeReport is a report with round numbers: mmap decodes in 10 ms and
// gathers a chunk in 1 s; the disk reads a page in 100 µs at QD1 and 100K
// pages/s at QD64 (85K at QD32); each chunk needs 50K pages (a 0.5 s limit);
// fio spends 10 µs of CPU a read. Every figure a target uses differs from
// the ones it must not use, so a target computed from the wrong path, phase
// or queue depth gets another value.
func fakeReport() *Report {
	ph := func(p50 time.Duration, chunk time.Duration) (*Phase, *Phase) {
		dec := &Phase{Times: Summary{N: 10, P50: p50, P99: 2 * p50, Mean: p50, Sum: 10 * p50}, Rows: 1440, BackingBytes: 1440 * 4096, BackingFrom: "x", BytesPerRow: 4096}
		pre := &Phase{Times: Summary{N: 2, Mean: chunk, Sum: 2 * chunk, P50: chunk}, Rows: 60_000, Pages: 100_000, BackingFrom: "x", BytesPerRow: 8192}
		pre.RowsPerSec = float64(pre.Rows) / pre.Times.Sum.Seconds()
		return dec, pre
	}
	g := &GeometryReport{Geometry: Geometry{Name: "big", Layers: 2, Rows: 1 << 20, WeightRow: 4096, ScaleRow: 128}, ChunkRows: []int{30_000, 30_000}, ChunkPages: []int{50_000, 50_000}}
	add := func(id PathID, p50, chunk time.Duration) *PathResult {
		d, p := ph(p50, chunk)
		r := &PathResult{Path: id, Label: id.Label(), Decode: d, Prefill: p}
		g.Paths = append(g.Paths, r)
		return r
	}
	add(PathPread, 8*time.Millisecond, 800*time.Millisecond)
	add(PathMmap, 10*time.Millisecond, time.Second)
	add(PathMmapWillneed, 2*time.Millisecond, 1500*time.Millisecond)
	eng := add(PathEngramfs, 12*time.Millisecond, 2*time.Second)
	eng.Daemon = &DaemonUsage{CPU: 3 * time.Second, Mem: procfs.Mem{RSS: 50 << 20, HWM: 60 << 20}, ReadEngine: "io_uring"}
	eng.Decode.Stats = &stats.Snapshot{FuseReads: 1000, BackingBytes: 1000 * 4608} // a page and 512 B of O_DIRECT alignment
	eng.Decode.DaemonCPUPerPage, eng.Prefill.DaemonCPUPerPage = 25, 40
	add(PathWarm, 100*time.Microsecond, 110*time.Millisecond)
	ew := add(PathEngramfsWillneed, 2400*time.Microsecond, 1800*time.Millisecond)
	ew.Daemon = &DaemonUsage{CPU: 2 * time.Second, Mem: procfs.Mem{RSS: 40 << 20, HWM: 50 << 20}, ReadEngine: "pread"}
	ew.Decode.DaemonCPUPerPage, ew.Prefill.DaemonCPUPerPage = 33, 44
	h := add(PathHints, 2500*time.Microsecond, 120*time.Millisecond)
	h.Daemon = &DaemonUsage{CPU: time.Second, Mem: procfs.Mem{RSS: 30 << 20, HWM: 40 << 20}, ReadEngine: "io_uring"}
	h.Decode.DaemonCPUPerPage, h.Prefill.DaemonCPUPerPage = 20, 12
	h.Decode.Barrier, h.Decode.BarrierHow = BarrierRead, "read(2) on the control handle"
	h.Prefill.Barrier, h.Prefill.BarrierHow = BarrierRead, "read(2) on the control handle"
	h.Prefill.Prefetch = &Prefetch{Times: Summary{N: 2, P50: 600 * time.Millisecond}, ReadsPerSec: 80_000, PagesPerSec: 95_000, WithinCompute: 2}
	h.Prefill.Stats = &stats.Snapshot{PrefetchLate: 3000, PrefetchLateServed: 2000, PrefetchPagesCached: 500}
	h.PrefetchAlone = &Phase{Times: Summary{N: 1, P50: 500 * time.Millisecond, Max: 500 * time.Millisecond}, Rows: 30_000, DaemonCPUPerPage: 14, DaemonSwitchesPerPage: 0.2,
		Prefetch: &Prefetch{Times: Summary{N: 1, P50: 500 * time.Millisecond, Max: 500 * time.Millisecond}, Pages: 35_000, Reads: 36_000, PagesPerSec: 70_000, ReadsPerSec: 72_000}}
	g.Paths = append(g.Paths, &PathResult{Path: PathMmapRA, Label: PathMmapRA.Label(), Skipped: "not asked for"})
	r := &Report{
		Machine:    Machine{CPUs: 2, MemBytes: 24 << 30, Kernel: "6.18", Disk: "ext4 on /dev/vda"},
		Settings:   Settings{DecodeSteps: 10, DecodeRows: 72, ZipfS: 0.9, Chunks: 2, ChunkTokens: 8192, Compute: time.Second, PreadWorkers: 32, PreadTaskRows: 16, MmapWorkers: 96},
		Geometries: []*GeometryReport{g},
	}
	r.DiskRuns = []*DiskLimit{
		{QD1: Summary{P50: 100 * time.Microsecond}, IOPS: map[int]float64{32: 80_000, 64: 90_000}},
		{QD1: Summary{P50: 150 * time.Microsecond}, IOPS: map[int]float64{32: 85_000, 64: 100_000}},
	}
	r.Disk = bestDisk(r.DiskRuns)
	r.ModelRoot, r.Models = "/var/tmp/m", []ModelFiles{{Dir: "/var/tmp/m/big-1024", Bytes: 3 << 30}, {Dir: "/var/tmp/m/flash-16384", Bytes: 1 << 30}}
	r.Fio = &FioFloor{File: "/m/model-00001.safetensors", RuntimeSec: 5, Reads: 300_000, IOPS: 60_000, UsrCPU: 10, SysCPU: 50, CPUPerRead: 10}
	r.finish(64)
	return r
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func TestRatios(t *testing.T) {
	r := fakeReport()
	g := r.Geometries[0]
	if !near(g.LimitChunkSec, 0.5) {
		t.Errorf("limit a chunk = %v s, want 50K pages at the best 100K IOPS = 0.5", g.LimitChunkSec)
	}
	for _, tc := range []struct {
		id               PathID
		decMmap, decDisk float64
		preMmap, preDisk float64
	}{
		{PathMmap, 1, 100, 1, 2},
		{PathPread, 0.8, 80, 0.8, 1.6},
		{PathEngramfs, 1.2, 120, 2, 4},
		{PathHints, 0.25, 25, 0.12, 0.24},
		{PathEngramfsWillneed, 0.24, 24, 1.8, 3.6},
	} {
		p := g.path(tc.id)
		got := p.Ratios
		if !near(got.DecodeVsMmap, tc.decMmap) || !near(got.DecodeVsDisk, tc.decDisk) || !near(got.PrefillVsMmap, tc.preMmap) || !near(got.PrefillVsDisk, tc.preDisk) {
			t.Errorf("%s: ratios %+v, want decode %v×mmap %v×disk, prefill %v×mmap %v×disk", tc.id, got, tc.decMmap, tc.decDisk, tc.preMmap, tc.preDisk)
		}
	}
	if p := g.Paths[len(g.Paths)-1]; p.Ratios != (Ratios{}) {
		t.Errorf("a skipped path got ratios %+v", p.Ratios)
	}
}

func TestBestDisk(t *testing.T) {
	r := fakeReport()
	if r.Disk.QD1.P50 != 100*time.Microsecond || r.Disk.IOPS[32] != 85_000 || r.Disk.IOPS[64] != 100_000 {
		t.Errorf("best of two runs = QD1 %v, IOPS %v", r.Disk.QD1.P50, r.Disk.IOPS)
	}
	if r.DiskRuns[0].IOPS[64] != 90_000 {
		t.Error("bestDisk changed a run it combined")
	}
}

// TestTargets checks every target's ratio against the figures it must be
// computed from: each alternative (another path, phase or queue depth, reads
// instead of pages) gives another value in fakeReport.
func TestTargets(t *testing.T) {
	r := fakeReport()
	want := map[string]struct {
		value float64
		met   bool
	}{
		TargetHintsVsV3:         {1.25, false}, // hints 2.5 ms / mmap+willneed 2 ms (vs mmap: 0.25)
		TargetV3MountVsShards:   {1.2, true},   // engramfs+willneed 2.4 ms / mmap+willneed 2 ms (vs mmap: 0.24)
		TargetPrefetchIOPS:      {0.95, true},  // 95K pages/s / 100K IOPS at QD64 (reads: 0.8; QD32: 1.12)
		TargetPrefetchAloneIOPS: {0.7, false},  // 70K pages/s / 100K IOPS at QD64 (reads: 0.72; the prefill phase's: 0.95)
		TargetCPUHintsDecode:    {2, false},    // 20 µs / 10 µs
		TargetCPUHintsPrefill:   {1.2, true},   // 12 µs / 10 µs
		TargetCPUPrefetchAlone:  {1.4, true},   // 14 µs / 10 µs (prefill: 1.2)
		TargetCPUFaultsDecode:   {2.5, true},   // 25 µs / 10 µs (engramfs+willneed: 3.3)
		TargetCPUFaultsPrefill:  {4, false},    // 40 µs / 10 µs (engramfs+willneed: 4.4)
		TargetNoHintsVsMmap:     {1.2, true},   // engramfs 12 ms / mmap 10 ms (vs mmap+willneed: 6)
	}
	got := map[string]Target{}
	for _, tg := range r.Targets {
		if _, dup := got[tg.ID]; dup {
			t.Errorf("target %s judged twice", tg.ID)
		}
		got[tg.ID] = tg
	}
	for id, w := range want {
		tg, ok := got[id]
		switch {
		case !ok:
			t.Errorf("target %s not judged", id)
		case !near(tg.Value, w.value) || tg.Met != w.met || tg.Unmet != "":
			t.Errorf("%s (%s): value %v met %v (%q), want %v met %v", id, tg.Name, tg.Value, tg.Met, tg.Unmet, w.value, w.met)
		}
		if tg.Geometry != "big" {
			t.Errorf("%s: geometry %q", id, tg.Geometry)
		}
	}
	if len(got) != len(want) {
		t.Errorf("judged %d targets, want %d: %v", len(got), len(want), got)
	}
	if !got[TargetPrefetchIOPS].AtLeast || got[TargetHintsVsV3].AtLeast {
		t.Error("the prefetch target is a lower bound, the others upper bounds")
	}

	// Without fio, the CPU targets are reported, not judged.
	r.Fio = &FioFloor{Missing: "fio is not on PATH"}
	r.finish(64)
	var b bytes.Buffer
	r.WriteTable(&b)
	n := 0
	for _, tg := range r.Targets {
		if strings.HasPrefix(tg.ID, "cpu-") {
			n++
			if tg.Unmet == "" || tg.Met || !strings.Contains(tg.Unmet, "not on PATH") {
				t.Errorf("%s judged without a fio floor: %+v", tg.ID, tg)
			}
		}
	}
	if n != 5 {
		t.Errorf("%d CPU targets without fio, want 5 (reported as n/a)", n)
	}
	for _, s := range []string{"fio floor: n/a (fio is not on PATH)",
		"n/a    big    not judged (no fio floor (fio is not on PATH)): cpu-"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("table without fio lacks %q:\n%s", s, b.String())
		}
	}
	if n := strings.Count(b.String(), "not judged"); n != 1 {
		t.Errorf("the targets not judged take %d lines, want them folded into 1:\n%s", n, b.String())
	}

	// A path that did not run takes its targets with it.
	for _, p := range r.Geometries[0].Paths {
		if p.Path == PathEngramfsWillneed {
			p.Failed = "daemon died"
		}
	}
	r.finish(64)
	for _, tg := range r.Targets {
		if tg.ID == TargetV3MountVsShards {
			t.Errorf("judged %s without its path", tg.ID)
		}
	}
}

func TestCPUPerPage(t *testing.T) {
	if got := cpuPerPage(time.Second, 1000*4096); !near(got, 1000) {
		t.Errorf("1 s over 1000 pages = %v µs a page, want 1000", got)
	}
	if got := cpuPerPage(time.Second, 0); got != 0 {
		t.Errorf("no backing bytes: %v, want 0 (not measured)", got)
	}
}

func TestWriteTableAndJSON(t *testing.T) {
	r := fakeReport()
	var b bytes.Buffer
	r.WriteTable(&b)
	out := b.String()
	for _, s := range []string{"2 mmap", "5 engramfs+hints", "4' engramfs+willneed", "warm page cache", "skipped: not asked for", "MISSED", "10.0ms", "60M", "QD64 100K IOPS",
		"cpu µs/page", "io_uring", "pread", "fio floor (4 KiB random reads, io_uring, QD64, O_DIRECT, 5 s on model-00001.safetensors): 60K IOPS, 10.0 µs of CPU a read",
		"5 engramfs+hints barrier: read(2) on the control handle", "(bound ≥ 0.90)", "(bound ≤ 1.00)",
		"models kept in /var/tmp/m for the next run: big-1024 (3.0 GiB), flash-16384 (1.0 GiB), 4.0 GiB in all; remove them with: engramfs bench --remove-models --model-dir /var/tmp/m",
		"5 engramfs+hints prefetch alone (one chunk's hints, cold cache, no gather): 35K pages in 500ms: 70K pages/s, 72K backing reads/s; daemon 14.0 µs and 0.20 context switches a backing page",
		"done within compute for 2 of 2 chunks; 3.0K pages late (2.0K of them taken from the prefetch's read before its store), 500 cached already (not read)"} {
		if !strings.Contains(out, s) {
			t.Errorf("table lacks %q:\n%s", s, out)
		}
	}
	path := filepath.Join(t.TempDir(), "r.json")
	if err := r.WriteJSON(path); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Geometries) != 1 || back.Geometries[0].path(PathHints).Decode.Times.P50 != 2500*time.Microsecond {
		t.Errorf("JSON round trip lost the figures")
	}
	h := back.Geometries[0].path(PathHints)
	if h.Decode.DaemonCPUPerPage != 20 || h.Prefill.DaemonCPUPerPage != 12 || h.Daemon.ReadEngine != "io_uring" || h.Decode.Barrier != BarrierRead ||
		h.PrefetchAlone == nil || h.PrefetchAlone.Prefetch == nil || h.PrefetchAlone.Prefetch.PagesPerSec != 70_000 {
		t.Errorf("JSON round trip lost the daemon's CPU a page, read engine or barrier: %+v %+v", h.Daemon, h.Decode)
	}
	if back.Fio == nil || back.Fio.CPUPerRead != 10 || len(back.Targets) != len(r.Targets) {
		t.Errorf("JSON round trip lost the fio floor or the targets")
	}
	for _, key := range []string{`"daemon_cpu_us_per_backing_page"`, `"read_engine"`, `"fio_floor"`, `"cpu_us_per_read"`, `"barrier"`, `"at_least"`} {
		if !bytes.Contains(raw, []byte(key)) {
			t.Errorf("JSON lacks %s", key)
		}
	}
}

func TestPlot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bench.png")
	if err := fakeReport().Plot(path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() < 800 || b.Dy() < 300 {
		t.Errorf("chart is %v, too small to read", b)
	}
	if os.Getenv("BENCH_KEEP_PLOT") != "" {
		raw, _ := os.ReadFile(path)
		os.WriteFile(os.Getenv("BENCH_KEEP_PLOT"), raw, 0o644)
	}
}

func TestStatsDelta(t *testing.T) {
	before := stats.Snapshot{FuseReads: 10, BackingBytes: 100, CacheUsedBytes: 5, CachePinned: true}
	after := stats.Snapshot{FuseReads: 15, BackingBytes: 400, CacheUsedBytes: 3, CachePinned: true}
	d := statsDelta(before, after)
	if d.FuseReads != 5 || d.BackingBytes != 300 || d.CacheUsedBytes != 3 || !d.CachePinned {
		t.Errorf("delta = %+v: counters subtract, gauges keep their last value", d)
	}
}

// The headline says hinted engramfs against mmap as people say it.
func TestHeadline(t *testing.T) {
	r := fakeReport()
	got := r.Headline()
	for _, want := range []string{"big: engramfs+hints decode step p50 2.50ms against mmap's", "4.0× faster", "prefill gather 8.3× faster", "without hints: decode"} {
		if !strings.Contains(got, want) {
			t.Errorf("headline %q lacks %q", got, want)
		}
	}
	if (&Report{}).Headline() != "" {
		t.Error("a report without the paths has a headline")
	}
}

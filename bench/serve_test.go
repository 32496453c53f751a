package bench

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/memcg"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
)

// tinyServe is the serving loop small enough for the suite: one 34 MiB
// model, 2 requests of 2 chunks and 4 steps, 2 ranks, the default paths
// (engramfs alone is mmap's code on the mount, which v3 on the mount
// maps too), small pools, every gathered row checked.
func tinyServe(t *testing.T) Config {
	t.Helper()
	cfg := tinyConfig(t)
	big, _ := NewGeometry(GeometryBig, 2, 4096)
	cfg.Serve = DefaultServe()
	cfg.Serve.Only = true
	cfg.Serve.Geometries = []Geometry{big}
	cfg.Serve.Paths = DefaultServePaths
	cfg.Serve.Ranks = []int{2}
	cfg.Serve.Spec = ServeSpec{Requests: 2, Chunks: 2, ChunkRows: 256, RareFraction: 0.2, Steps: 4, StepRows: 16, S: 0.9}
	cfg.Serve.Compute, cfg.Serve.DecodeCompute = 20*time.Millisecond, time.Millisecond
	// Race-built daemons and ranks are large: the limit holds them all,
	// the point here is that they run inside it.
	cfg.Serve.MemLimit = 2 << 30
	cfg.Serve.CacheSize = "8MiB"
	cfg.Serve.GatherWorkers, cfg.Serve.PrefetchThreads, cfg.Serve.PrefetchTaskRows = 8, 4, 64
	cfg.Serve.BurstRuns = 3
	cfg.Serve.VerifySample = 0
	cfg.Serve.CommandTimeout = time.Minute
	cfg.FioRuntime = 0
	return cfg
}

// ownCgroups lists the cgroups this process made and has not removed.
func ownCgroups(t *testing.T) []string {
	t.Helper()
	left, err := memcg.Owned(cgroupPrefix)
	if err != nil {
		t.Logf("listing cgroups: %v", err)
	}
	return left
}

// TestServeTiny runs the serving loop on a real mount, 2 rank processes,
// the default paths, inside a memory cgroup: every step and chunk ran and was
// checked against the model's bytes, every figure the report judges on
// was measured, and nothing is left mounted or in the cgroup tree. The
// figures themselves are the bench's to judge, not the suite's.
func TestServeTiny(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyServe(t)
	rep := runTiny(t, cfg)
	if left := ownCgroups(t); len(left) > 0 {
		t.Errorf("cgroups left: %v", left)
	}
	s := rep.Serve
	if s == nil || len(s.Runs) != 1 || len(rep.Geometries) != 0 {
		t.Fatalf("serving report %+v, %d geometries of paths 1-5 (want none with --serve)", s, len(rep.Geometries))
	}
	if s.Cgroup == "" {
		t.Logf("no memory cgroup here: %s", s.NoCgroup)
	}
	if s.Floor == nil || len(s.Floor.Points) != len(BurstSizes) || len(s.FloorRuns) != 2 {
		t.Errorf("step floor %+v (%d runs), want every burst size, measured twice", s.Floor, len(s.FloorRuns))
	}
	run := s.Runs[0]
	spec := cfg.Serve.Spec
	steps, chunks := spec.Requests*spec.Steps, spec.Requests*spec.Chunks
	layers := 2
	// Every row of every step and chunk, of every rank: a step's lookups
	// are checked as they are (repeats too), a chunk's unique rows.
	wantVerified := int64(run.Ranks * layers * (steps*spec.StepRows + chunks*spec.ChunkRows))
	if run.MountPages == 0 || run.ShardPages <= run.MountPages || run.MountReadOnce == 0 || run.Shape.ChunkRows != layers*spec.ChunkRows {
		t.Errorf("run's pages and plan: %+v", run)
	}
	if len(run.Paths) != len(cfg.Serve.Paths) {
		t.Fatalf("%d paths, want %d", len(run.Paths), len(cfg.Serve.Paths))
	}
	for _, p := range run.Paths {
		if !p.measured() {
			t.Errorf("%s: not measured: %s%s", p.Path, p.Skipped, p.Failed)
			continue
		}
		if p.Decode.N != steps || p.Chunk.N != chunks || len(p.StepReads) != steps || len(p.Steps) != steps || len(p.Chunks) != chunks {
			t.Errorf("%s: %d steps, %d chunks, %d step reads timed; want %d, %d", p.Path, p.Decode.N, p.Chunk.N, len(p.StepReads), steps, chunks)
		}
		if p.Verified != wantVerified {
			t.Errorf("%s: %d rows checked against the model, want %d", p.Path, p.Verified, wantVerified)
		}
		if p.StepPages == 0 || p.StepResident > p.StepPages {
			t.Errorf("%s: step pages %d, resident before %d", p.Path, p.StepPages, p.StepResident)
		}
		// A page not resident before its step has no entry in the rank's
		// page tables: reading it through the mapping takes a fault.
		if p.StepResident < p.StepPages && p.StepFaults == 0 {
			t.Errorf("%s: %d of the steps' %d pages not resident before them, and no page fault counted", p.Path, p.StepPages-p.StepResident, p.StepPages)
		}
		if g := p.DecodeGather; g != nil && (g.N != steps || p.Hint.N != steps || run.Ranks == 1 && p.Hint.P50 > p.Decode.P50) {
			t.Errorf("%s: decode step parts %+v and %+v of %+v", p.Path, *p.Hint, *g, p.Decode)
		}
		// From dropped caches every path reads its tables from the disk.
		// The device counts every process's reads, the cgroup only ours.
		if s.Device != nil && (p.Disk.Reads == 0 || p.Disk.Bytes == 0 || p.Device.Bytes() < p.Disk.Bytes && s.IOFrom == ioFromCgroup) {
			t.Errorf("%s: disk %+v, device %+v (%s)", p.Path, p.Disk, p.Device, s.IOFrom)
		}
		if p.BytesPerDistinct <= 0 || p.ReadOnce <= 0 || p.RankCPU <= 0 {
			t.Errorf("%s: bytes per distinct page %v, per read-once %v, rank CPU %v", p.Path, p.BytesPerDistinct, p.ReadOnce, p.RankCPU)
		}
		if s.Cgroup != "" && (p.Memory == nil || p.Memory.Peak <= 0 || p.Memory.Peak > cfg.Serve.MemLimit) {
			t.Errorf("%s: memory %+v, want a peak within %d", p.Path, p.Memory, cfg.Serve.MemLimit)
		}
		if p.Path.mounts() != (p.Daemon != nil) {
			t.Fatalf("%s: daemon %+v", p.Path, p.Daemon)
		}
		if d := p.Daemon; d != nil {
			if d.CPU <= 0 || d.Stats.BackingBytes == 0 || d.Stats.CacheCapacityBytes != 8<<20 || d.Mem.HWM <= 0 {
				t.Errorf("%s: daemon %+v", p.Path, d)
			}
			// The daemon's backing reads are the cgroup's: it runs inside.
			// (The cgroup may read more: a rank's or the daemon's own text
			// pages, when someone dropped the page cache meanwhile.)
			if s.IOFrom == ioFromCgroup && p.Disk.Bytes < d.Stats.BackingBytes {
				t.Errorf("%s: the cgroup read %d bytes, the daemon %d", p.Path, p.Disk.Bytes, d.Stats.BackingBytes)
			}
		}
		hinted := p.Path == PathHints
		if hinted != (p.DecodeBarrier != nil && p.PrefillBarrier != nil) || (hinted || p.Path.willneed()) != (p.Hint != nil && p.DecodeGather != nil) {
			t.Fatalf("%s: barriers %v %v, hint times %v", p.Path, p.DecodeBarrier, p.PrefillBarrier, p.Hint)
		}
		if hinted {
			b := p.DecodeBarrier
			if b.Frames != uint64(run.Ranks*layers*steps) || b.Pages == 0 || b.Failed != 0 || p.Daemon.Stats.HintFrames == 0 || p.PrefillBarrier.Pages == 0 {
				t.Errorf("%s: decode barriers %+v (want %d frames), prefill %+v", p.Path, b, run.Ranks*layers*steps, p.PrefillBarrier)
			}
		}
	}
	// Every serving target of the run is judged (or n/a, and why).
	n := 0
	for _, tg := range rep.Targets {
		if strings.HasPrefix(tg.ID, "serve-") {
			n++
			if tg.Ranks != run.Ranks || tg.Detail == "" {
				t.Errorf("target %+v", tg)
			}
		}
	}
	if n != 8 {
		t.Errorf("%d serving targets, want 8", n)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, want := range []string{"serving loop: 2 requests", "2 rank processes", "5 engramfs+hints decode barriers", "step floor: bursts", "serving ×2: decode p50"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	if err := rep.Plot(filepath.Join(t.TempDir(), "serve.png")); err != nil {
		t.Error(err)
	}
}

// TestServeDecodePerLayer runs the serving loop's engramfs+hints path with
// a decode handle and a barrier per layer: every row of every step checked,
// every layer's frames settled, the mode named in the report.
func TestServeDecodePerLayer(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyServe(t)
	cfg.Serve.Paths = []PathID{PathHints}
	cfg.Serve.Ranks = []int{1}
	cfg.Serve.DecodePerLayer = true
	rep := runTiny(t, cfg)
	spec := cfg.Serve.Spec
	steps, chunks, layers := spec.Requests*spec.Steps, spec.Requests*spec.Chunks, 2
	p := rep.Serve.Runs[0].Paths[0]
	if !p.measured() {
		t.Fatalf("not measured: %s%s", p.Skipped, p.Failed)
	}
	if want := int64(layers * (steps*spec.StepRows + chunks*spec.ChunkRows)); p.Verified != want || p.Decode.N != steps {
		t.Errorf("%d rows checked in %d steps, want %d in %d", p.Verified, p.Decode.N, want, steps)
	}
	if b := p.DecodeBarrier; b == nil || b.Frames != uint64(layers*steps) || b.Pages == 0 || b.Failed != 0 {
		t.Errorf("decode barriers %+v, want %d frames settled", b, layers*steps)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	if !strings.Contains(table.String(), "decode per layer:") {
		t.Errorf("table does not name the mode:\n%s", table.String())
	}
	cfg.Serve.DecodeOverlap = true
	if _, err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "choose one") {
		t.Errorf("overlap and per layer together: %v, want refused", err)
	}
}

// TestServeInterrupted cancels the serving loop while its daemon and ranks
// run (what Ctrl-C does): Run returns the cancellation promptly, with no
// mount, rank or cgroup left.
func TestServeInterrupted(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyServe(t)
	cfg.Serve.Paths = []PathID{PathHints}
	// The cancel lands in a compute: a run that waited it out would take
	// a minute, one that stops at once takes the daemon's and the ranks'
	// stop, seconds even on a busy machine.
	cfg.Serve.Compute = time.Minute
	runCanceled(t, cfg, "request 1/2, chunk 1/2", cfg.Serve.Compute)
	if left := ownCgroups(t); len(left) > 0 {
		t.Errorf("cgroups left: %v", left)
	}
}

// fakeServeRun is a run with round figures: v3 on the shards steps in 2 ms
// (p99 8 ms) with 60 device reads a step, chunks in 100 ms, reads 1 GiB;
// engramfs+hints steps in 1.5 ms (p99 4 ms) with 30 reads, chunks in 90 ms,
// reads 512 MiB of which the daemon 500 MiB. The floor is 40 µs a read.
func fakeServeRun() (*ServeReport, *ServeRun) {
	floor := &BurstFloor{Points: []BurstPoint{{N: 1, P50: 40 * time.Microsecond}, {N: 128, P50: 128 * 40 * time.Microsecond}}}
	run := &ServeRun{Geometry: Geometry{Name: "big"}, Ranks: 4, MountPages: 100_000, ShardPages: 160_000, MountReadOnce: 100_000 * 4608, Align: 512}
	path := func(id PathID, p50, p99, chunk time.Duration, stepReads []uint64, bytes uint64) *ServePath {
		p := &ServePath{Path: id, Label: id.Label(), Decode: Summary{N: len(stepReads), P50: p50, P99: p99},
			Chunk: Summary{N: 8, Mean: chunk}, ChunkWait: Summary{Mean: chunk / 2}, StepReads: stepReads,
			Disk: memcg.IOCounters{Bytes: bytes}, Memory: &memcg.Usage{Refaults: 777}}
		for _, n := range stepReads {
			p.DecodeDisk.Reads += n
		}
		return p
	}
	v3 := path(PathMmapWillneed, 2*time.Millisecond, 8*time.Millisecond, 100*time.Millisecond, []uint64{50, 60, 70}, 1<<30)
	h := path(PathHints, 1500*time.Microsecond, 4*time.Millisecond, 90*time.Millisecond, []uint64{20, 30, 40}, 512<<20)
	h.Daemon = &ServeDaemon{CPUPerPage: 15, Stats: stats.Snapshot{BackingBytes: 500 << 20, BackingAgain: 3210}}
	run.Paths = []*ServePath{v3, h, {Path: PathMmap, Label: PathMmap.Label(), Failed: "died"}}
	rep := &ServeReport{Cgroup: "cgroup v1", Device: &BlockDev{Name: "vda"}, IOFrom: ioFromCgroup, Floor: floor, Runs: []*ServeRun{run}}
	for _, p := range run.Paths {
		p.finish(run, floor)
	}
	return rep, run
}

// TestServeArithmetic: a path's per-step figures, floor and bytes per
// distinct page come from its own counts, and each serving target is the
// ratio of the figures it names.
func TestServeArithmetic(t *testing.T) {
	rep, run := fakeServeRun()
	v3, h := run.path(PathMmapWillneed), run.path(PathHints)
	if !near(v3.ColdReads, 60) || !near(h.ColdReads, 30) {
		t.Errorf("cold reads a step: v3 %v, hints %v; want 60 and 30", v3.ColdReads, h.ColdReads)
	}
	// The p50 of the steps' floors (20, 30, 40 reads at 40 µs each).
	if v3.Floor != 60*40*time.Microsecond || h.Floor != 30*40*time.Microsecond {
		t.Errorf("floors v3 %v, hints %v", v3.Floor, h.Floor)
	}
	// Shards: the disk's bytes over their 160K distinct pages; the mount:
	// the daemon's over its 100K, and over reading each once (4608 B).
	if !near(v3.BytesPerDistinct, float64(1<<30)/(160_000*4096)) || !near(v3.ReadOnce, v3.BytesPerDistinct) || v3.Reread != 777 {
		t.Errorf("v3: %v B/distinct, %v per read-once, %v reread", v3.BytesPerDistinct, v3.ReadOnce, v3.Reread)
	}
	if !near(h.BytesPerDistinct, float64(500<<20)/(100_000*4096)) || !near(h.ReadOnce, float64(500<<20)/(100_000*4608)) ||
		h.Reread != 3210 {
		t.Errorf("hints: %v B/distinct, %v per read-once, %v reread", h.BytesPerDistinct, h.ReadOnce, h.Reread)
	}
	r := &Report{Serve: rep, Fio: &FioFloor{CPUPerRead: 10}}
	got := map[string]Target{}
	for _, tg := range r.serveTargets() {
		got[tg.ID] = tg
	}
	for id, want := range map[string]struct {
		v   float64
		met bool
	}{
		TargetServeDecodeP50:   {0.75, true},
		TargetServeDecodeP99:   {0.5, true},
		TargetServeColdReads:   {0.5, true},
		TargetServePrefill:     {0.9, true},
		TargetServeDiskBytes:   {0.5, true},
		TargetServeDecodeFloor: {1.25, true}, // 1.5 ms over 1.2 ms
		TargetServeDistinct:    {float64(500<<20) / (100_000 * 4096), false},
		TargetServeCPU:         {1.5, true},
	} {
		tg, ok := got[id]
		if !ok || !near(tg.Value, want.v) || tg.Met != want.met || tg.Ranks != 4 || tg.Geometry != "big" || tg.Unmet != "" {
			t.Errorf("%s: %+v, want %v met %v", id, tg, want.v, want.met)
		}
	}
	if len(got) != 8 {
		t.Errorf("%d targets", len(got))
	}
	// Without a memory limit they are reported, never met; without device
	// counters the I/O ones are n/a.
	rep.Cgroup, rep.NoCgroup = "", "not root"
	for _, tg := range r.serveTargets() {
		if tg.Met || !strings.Contains(tg.Unmet, "no memory limit") {
			t.Errorf("without a cgroup: %+v", tg)
		}
	}
	rep.Cgroup, rep.NoCgroup, rep.Device, rep.NoDevice = "cgroup v1", "", nil, "a network filesystem"
	for _, tg := range r.serveTargets() {
		io := tg.ID == TargetServeColdReads || tg.ID == TargetServeDiskBytes || tg.ID == TargetServeDecodeFloor
		if io != (tg.Unmet != "") {
			t.Errorf("without device counters: %+v", tg)
		}
	}
	r.Targets = r.serveTargets()
	var b bytes.Buffer
	r.WriteTable(&b)
	for _, want := range []string{"FAILED: died", "3.2K", "30.0", "serving ×4: decode p50"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestAddStatus(t *testing.T) {
	sum := hints.Status{Frames: 1, Pages: 10, Resident: 4, Pinned: 5, Dropped: 1}
	addStatus(&sum, hints.Status{Frames: 2, Pages: 20, Resident: 15, Pinned: 3, Failed: 2})
	if sum != (hints.Status{Frames: 3, Pages: 30, Resident: 19, Pinned: 8, Dropped: 1, Failed: 2}) {
		t.Errorf("sum %+v", sum)
	}
}

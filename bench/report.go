package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// Report is everything one bench run measured.
type Report struct {
	Started  time.Time     `json:"started"`
	Elapsed  time.Duration `json:"elapsed_ns"`
	Machine  Machine       `json:"machine"`
	Settings Settings      `json:"settings"`
	// Disk is the disk limit the ratios use: the best of DiskRuns (lowest
	// QD1 p50, highest IOPS), measured at the start and at the end of the run.
	Disk     *DiskLimit   `json:"disk_limit,omitempty"`
	DiskRuns []*DiskLimit `json:"disk_runs,omitempty"`
	// Fio is fio's CPU per 4 KiB random read (io_uring, QD64, O_DIRECT, on
	// a shard), measured once at the start: the floor the daemon's CPU per
	// backing page is judged against.
	Fio        *FioFloor         `json:"fio_floor,omitempty"`
	Geometries []*GeometryReport `json:"geometries"`
	Targets    []Target          `json:"targets"`
	Notes      []string          `json:"notes,omitempty"`

	// ObjectStore is the object-store run (nil: --no-s3).
	ObjectStore *ObjectStoreReport `json:"object_store,omitempty"`
	// Serve is the serving loop (nil: skipped).
	Serve *ServeReport `json:"serve,omitempty"`
	// Models are the model directories the run used, kept under
	// ModelRoot for the next run (none when the run's models are
	// temporary: the demo's).
	ModelRoot string       `json:"model_root,omitempty"`
	Models    []ModelFiles `json:"models,omitempty"`
}

// ModelFiles is a generated model kept under the model root.
type ModelFiles struct {
	Dir   string `json:"dir"`
	Bytes int64  `json:"bytes"`
}

// Settings are the knobs of the run that shape its figures.
type Settings struct {
	DecodeSteps   int           `json:"decode_steps"`
	DecodeRows    int           `json:"decode_rows_per_layer"`
	ZipfS         float64       `json:"zipf_s"`
	Chunks        int           `json:"prefill_chunks"`
	ChunkTokens   int           `json:"prefill_chunk_tokens"`
	Compute       time.Duration `json:"compute_ns"`
	PreadWorkers  int           `json:"pread_workers"`
	PreadTaskRows int           `json:"pread_task_rows"`
	MmapWorkers   int           `json:"mmap_workers"`
	DaemonFlags   []string      `json:"daemon_flags,omitempty"`
	QueueDepth    int           `json:"queue_depth"` // the daemon's --queue-depth
	DaemonEnv     []string      `json:"daemon_env,omitempty"`
	Drop          DropMode      `json:"drop"`
}

// GeometryReport is the paths measured on one geometry.
type GeometryReport struct {
	Geometry      Geometry      `json:"geometry"`
	ModelDir      string        `json:"model_dir"`
	Generated     time.Duration `json:"generated_ns,omitempty"` // 0: reused from an earlier run
	ChunkRows     []int         `json:"prefill_chunk_rows"`     // unique rows per chunk, all layers
	ChunkPages    []int         `json:"prefill_chunk_pages"`    // 4 KiB pages those rows need that earlier chunks did not
	Paths         []*PathResult `json:"paths"`
	LimitChunkSec float64       `json:"limit_chunk_seconds"` // mean chunk pages / best disk IOPS
}

// PathResult is one path on one geometry.
type PathResult struct {
	Path    PathID `json:"path"`
	Label   string `json:"label"`
	Decode  *Phase `json:"decode,omitempty"`
	Prefill *Phase `json:"prefill,omitempty"`
	// PrefetchAlone (path 5): one more chunk's prefill hints into a cold
	// cache, waited for, with nothing else running.
	PrefetchAlone *Phase       `json:"prefetch_alone,omitempty"`
	Daemon        *DaemonUsage `json:"daemon,omitempty"`
	Skipped       string       `json:"skipped,omitempty"`
	Failed        string       `json:"failed,omitempty"` // the error that stopped the path (the run goes on)
	Ratios        Ratios       `json:"ratios"`
}

// DaemonUsage is what the engramfs daemon of a path used.
type DaemonUsage struct {
	CPU time.Duration `json:"cpu_ns"` // user + system over the measured phases
	Mem procfs.Mem    `json:"mem"`    // at the end of the path
	// ReadEngine is how the daemon issued backing reads (.engramfs/stats
	// read_engine: io_uring or pread), ReadEngineUnknown from a daemon that
	// does not say.
	ReadEngine string `json:"read_engine"`
}

// ReadEngineUnknown is DaemonUsage.ReadEngine for a daemon whose stats have
// no read_engine.
const ReadEngineUnknown = "unknown"

// Phase is one workload (decode or prefill) on one path.
type Phase struct {
	Cold  string  `json:"cold"`  // how the page cache was emptied before it
	Times Summary `json:"times"` // per decode step / per prefill chunk gather
	Rows  int64   `json:"rows"`  // rows gathered: decode lookups, or unique prefill rows (all layers)
	Pages int64   `json:"pages"` // prefill: distinct 4 KiB pages those rows need (mount layout), over all chunks

	RowsPerSec   float64 `json:"rows_per_sec,omitempty"` // prefill: Rows / gather time
	BackingBytes uint64  `json:"backing_bytes"`
	BackingFrom  string  `json:"backing_from"`
	BytesPerRow  float64 `json:"backing_bytes_per_row"`

	ClientCPU time.Duration `json:"client_cpu_ns"`
	DaemonCPU time.Duration `json:"daemon_cpu_ns,omitempty"`
	// DaemonCPUPerPage is DaemonCPU in µs over BackingBytes/4096: the
	// daemon's CPU per 4 KiB page of backing reads.
	DaemonCPUPerPage float64 `json:"daemon_cpu_us_per_backing_page,omitempty"`
	// DaemonSwitches counts the context switches of the daemon's threads
	// over the phase; DaemonSwitchesPerPage is it over BackingBytes/4096.
	// These VMs make every switch (and the wake-up of an idle CPU it often
	// means) expensive.
	DaemonSwitches        uint64  `json:"daemon_switches,omitempty"`
	DaemonSwitchesPerPage float64 `json:"daemon_switches_per_backing_page,omitempty"`

	// Barrier is how path 5 waited for its hints (BarrierRead or
	// BarrierFsync); BarrierHow says how that was decided.
	Barrier    string `json:"barrier,omitempty"`
	BarrierHow string `json:"barrier_how,omitempty"`

	Hint     *Summary        `json:"hint,omitempty"`     // decode with hints: hints sent + barrier, per step
	Prefetch *Prefetch       `json:"prefetch,omitempty"` // prefill with hints
	Stats    *stats.Snapshot `json:"stats,omitempty"`    // engramfs counters over the phase (gauges: at its end)
}

// Prefetch is how the prefill hints of path 5 did.
type Prefetch struct {
	Times         Summary `json:"times"` // hints sent -> barrier returned, per chunk
	Pages         uint64  `json:"pages_stored"`
	Reads         uint64  `json:"backing_reads"`
	PagesPerSec   float64 `json:"pages_per_sec"`
	ReadsPerSec   float64 `json:"reads_per_sec"`
	WithinCompute int     `json:"chunks_within_compute"` // chunks whose prefetch ended before their compute did
	Failed        int     `json:"chunks_failed"`         // barriers that returned an error
}

// setTimes sets the chunks' times and the rates over their sum.
func (pf *Prefetch) setTimes(times []time.Duration) {
	pf.Times = Summarize(times)
	if s := pf.Times.Sum.Seconds(); s > 0 {
		pf.PagesPerSec, pf.ReadsPerSec = float64(pf.Pages)/s, float64(pf.Reads)/s
	}
}

// Ratios compare a path with path 2 (mmap) and with the disk limit; 0 means
// not measured. Every ratio is time over time: below 1 is faster.
type Ratios struct {
	DecodeVsMmap  float64 `json:"decode_p50_vs_mmap,omitempty"`
	DecodeVsDisk  float64 `json:"decode_p50_vs_disk_qd1,omitempty"`
	PrefillVsMmap float64 `json:"prefill_gather_vs_mmap,omitempty"`
	PrefillVsDisk float64 `json:"prefill_gather_vs_disk_iops,omitempty"`
}

// Target is one of the data path's targets, judged on one geometry.
type Target struct {
	Geometry string `json:"geometry"`
	Ranks    int    `json:"ranks,omitempty"` // the serving loop's rank processes`
	ID       string `json:"id"`              // stable name (the Target* constants)
	Name     string `json:"name"`
	// Value is the measured ratio; Bound its upper bound, or its lower
	// bound when AtLeast.
	Value   float64 `json:"value"`
	Bound   float64 `json:"bound"`
	AtLeast bool    `json:"at_least,omitempty"`
	Met     bool    `json:"met"`
	Detail  string  `json:"detail"`
	// Unmet is set when the target's precondition did not hold in this run
	// (then Met says nothing): why.
	Unmet string `json:"precondition_unmet,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	CPUs     int    `json:"cpus"`
	MemBytes int64  `json:"mem_bytes"`
	Kernel   string `json:"kernel"`
	// Load is the machine's load before the run, and how busy other
	// processes kept the CPUs during it: other work makes the figures noisy.
	Load      []string `json:"load"`
	Disk      string   `json:"disk"` // the filesystem and device under the models
	GoVersion string   `json:"go_version"`
}

// judge sets Met: the value measured and within its bound.
func (t *Target) judge() {
	if t.AtLeast {
		t.Met = t.Value > 0 && t.Value >= t.Bound
	} else {
		t.Met = t.Value > 0 && t.Value <= t.Bound
	}
}

// measured reports whether the path ran to the end.
func (p *PathResult) measured() bool { return p.Skipped == "" && p.Failed == "" }

func (g *GeometryReport) path(id PathID) *PathResult {
	for _, p := range g.Paths {
		if p.Path == id && p.measured() {
			return p
		}
	}
	return nil
}

func ratio(a, b float64) float64 {
	if a <= 0 || b <= 0 || math.IsNaN(a) || math.IsNaN(b) {
		return 0
	}
	return a / b
}

// finish computes the ratios and judges the targets.
func (r *Report) finish(queueDepth int) {
	r.Targets = nil
	for _, g := range r.Geometries {
		mmap := g.path(PathMmap)
		var chunkPages float64
		for _, n := range g.ChunkPages {
			chunkPages += float64(n)
		}
		if r.Disk != nil && len(g.ChunkPages) > 0 && r.Disk.BestIOPS() > 0 {
			g.LimitChunkSec = chunkPages / float64(len(g.ChunkPages)) / r.Disk.BestIOPS()
		}
		for _, p := range g.Paths {
			if !p.measured() {
				continue
			}
			p.Ratios = Ratios{}
			if p.Decode != nil {
				if mmap != nil && mmap.Decode != nil {
					p.Ratios.DecodeVsMmap = ratio(float64(p.Decode.Times.P50), float64(mmap.Decode.Times.P50))
				}
				if r.Disk != nil {
					p.Ratios.DecodeVsDisk = ratio(float64(p.Decode.Times.P50), float64(r.Disk.QD1.P50))
				}
			}
			if p.Prefill != nil {
				if mmap != nil && mmap.Prefill != nil {
					p.Ratios.PrefillVsMmap = ratio(float64(p.Prefill.Times.Sum), float64(mmap.Prefill.Times.Sum))
				}
				if g.LimitChunkSec > 0 {
					p.Ratios.PrefillVsDisk = ratio(p.Prefill.Times.Sum.Seconds(), g.LimitChunkSec*float64(p.Prefill.Times.N))
				}
			}
		}
		r.Targets = append(r.Targets, judge(g, r.Disk, r.Fio, queueDepth)...)
	}
	r.Targets = append(r.Targets, r.objectStoreTargets()...)
	r.Targets = append(r.Targets, r.serveTargets()...)
}

// The targets' IDs.
const (
	TargetHintsVsV3         = "decode-hints-vs-v3"          // engramfs+hints decode p50 ≤ 1.0× mmap+willneed (both read the same cold pages: parity is the floor)
	TargetV3MountVsShards   = "decode-v3-mount-vs-shards"   // engramfs+willneed decode p50 ≤ 1.3× mmap+willneed
	TargetPrefetchIOPS      = "prefetch-vs-disk-iops"       // prefetch pages/s (prefill, beside the gather) ≥ 0.9× disk IOPS at the daemon's QD
	TargetPrefetchAloneIOPS = "prefetch-alone-vs-disk-iops" // the same, one chunk's prefetch with nothing else running
	TargetCPUHintsDecode    = "cpu-hints-decode"            // daemon CPU/page, engramfs+hints decode ≤ 1.5× fio's per read
	TargetCPUHintsPrefill   = "cpu-hints-prefill"           // the same in prefill
	TargetCPUPrefetchAlone  = "cpu-prefetch-alone"          // the same, prefetch alone
	TargetCPUFaultsDecode   = "cpu-faults-decode"           // daemon CPU/page, engramfs (faults) decode ≤ 3× fio's per read
	TargetCPUFaultsPrefill  = "cpu-faults-prefill"          // the same in prefill
	TargetNoHintsVsMmap     = "decode-nohints-vs-mmap"      // engramfs decode p50 ≤ 1.5× mmap (MADV_RANDOM)
)

// judge checks the targets on one geometry, those whose paths ran. A target
// whose reference is missing (no fio floor) is reported but not judged.
func judge(g *GeometryReport, disk *DiskLimit, fio *FioFloor, queueDepth int) []Target {
	var out []Target
	name := g.Geometry.Name
	mmap, willneed, eng, engWill, hints := g.path(PathMmap), g.path(PathMmapWillneed), g.path(PathEngramfs), g.path(PathEngramfsWillneed), g.path(PathHints)
	add := func(t Target) {
		t.Geometry = name
		t.judge()
		out = append(out, t)
	}
	decode := func(id, what string, p, ref *PathResult, refName string, bound float64) {
		if p == nil || p.Decode == nil || ref == nil || ref.Decode == nil {
			return
		}
		add(Target{ID: id, Name: fmt.Sprintf("decode p50: %s ≤ %.1f× %s", what, bound, refName),
			Value: ratio(float64(p.Decode.Times.P50), float64(ref.Decode.Times.P50)), Bound: bound,
			Detail: fmt.Sprintf("%s vs %s", fmtDur(p.Decode.Times.P50), fmtDur(ref.Decode.Times.P50))})
	}
	decode(TargetHintsVsV3, "engramfs+hints", hints, willneed, "mmap+willneed (v3 on the shards)", 1.0)
	decode(TargetV3MountVsShards, "engramfs+willneed (v3 on the mount)", engWill, willneed, "mmap+willneed", 1.3)

	prefetch := func(id, what string, ph *Phase) {
		if ph == nil || ph.Prefetch == nil || disk == nil {
			return
		}
		qd := queueDepth
		iops, ok := disk.IOPS[qd]
		if !ok {
			iops = disk.BestIOPS()
			qd = 0
		}
		pf := ph.Prefetch
		d := fmt.Sprintf("%.0f pages/s (%.0f backing reads/s) vs %.0f IOPS", pf.PagesPerSec, pf.ReadsPerSec, iops)
		if qd > 0 {
			d += fmt.Sprintf(" at QD%d", qd)
		} else {
			d += fmt.Sprintf(" (the best measured: none at the daemon's QD%d)", queueDepth)
		}
		if fio != nil && fio.IOPS > 0 {
			d += fmt.Sprintf("; fio %.0f IOPS at QD%d", fio.IOPS, fioQueueDepth)
		}
		add(Target{ID: id, Name: fmt.Sprintf("prefetch %s pages/s ≥ 0.9× disk 4 KiB random-read IOPS, same QD", what), AtLeast: true,
			Value: ratio(pf.PagesPerSec, iops), Bound: 0.9, Detail: d})
	}
	if hints != nil {
		prefetch(TargetPrefetchIOPS, "beside the gather", hints.Prefill)
		prefetch(TargetPrefetchAloneIOPS, "alone", hints.PrefetchAlone)
	}

	cpu := func(id, what string, p *PathResult, phase string, ph *Phase, bound float64) {
		if p == nil || ph == nil {
			return
		}
		t := Target{ID: id, Name: fmt.Sprintf("daemon CPU/page, %s %s ≤ %.1f× fio's/read", what, phase, bound), Bound: bound}
		switch {
		case fio == nil || fio.CPUPerRead <= 0:
			why := "not measured"
			if fio != nil && fio.Missing != "" {
				why = fio.Missing
			}
			t.Unmet = "no fio floor (" + why + ")"
			t.Detail = fmt.Sprintf("%.1f µs a backing page vs n/a", ph.DaemonCPUPerPage)
		default:
			t.Value = ratio(ph.DaemonCPUPerPage, fio.CPUPerRead)
			t.Detail = fmt.Sprintf("%.1f µs a backing page (%s CPU, %s read) vs %.1f µs a read", ph.DaemonCPUPerPage,
				fmtDur(ph.DaemonCPU), fmtBytes(float64(ph.BackingBytes)), fio.CPUPerRead)
		}
		add(t)
	}
	if hints != nil {
		cpu(TargetCPUHintsDecode, "engramfs+hints", hints, "decode", hints.Decode, 1.5)
		cpu(TargetCPUHintsPrefill, "engramfs+hints", hints, "prefill", hints.Prefill, 1.5)
		cpu(TargetCPUPrefetchAlone, "engramfs+hints", hints, "prefetch alone", hints.PrefetchAlone, 1.5)
	}
	if eng != nil {
		cpu(TargetCPUFaultsDecode, "engramfs (faults)", eng, "decode", eng.Decode, 3)
		cpu(TargetCPUFaultsPrefill, "engramfs (faults)", eng, "prefill", eng.Prefill, 3)
	}

	decode(TargetNoHintsVsMmap, "engramfs (no hints)", eng, mmap, "mmap (MADV_RANDOM)", 1.5)
	return out
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// WriteTable prints the human report: per geometry a table of paths, then
// the targets.
func (r *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "engramfs bench — %s, %d CPUs, %s RAM, kernel %s\n", r.Machine.Disk, r.Machine.CPUs, fmtBytes(float64(r.Machine.MemBytes)), r.Machine.Kernel)
	s := r.Settings
	if len(r.Geometries) > 0 {
		fmt.Fprintf(w, "decode: %d steps × %d Zipf(s=%.2g) rows × every layer, one thread (pread: %d workers × %d rows); prefill: %d chunks × %d tokens, %d workers (path 3: one thread), compute %v\n",
			s.DecodeSteps, s.DecodeRows, s.ZipfS, s.PreadWorkers, s.PreadTaskRows, s.Chunks, s.ChunkTokens, s.MmapWorkers, s.Compute)
	}
	if len(s.DaemonFlags) > 0 {
		fmt.Fprintf(w, "daemon: %sengramfs mount %s\n", strings.Join(append(s.DaemonEnv, ""), " "), strings.Join(s.DaemonFlags, " "))
	}
	for _, l := range r.Machine.Load {
		fmt.Fprintf(w, "load: %s\n", l)
	}
	for i, d := range r.DiskRuns {
		var qds []string
		for _, qd := range slices.Sorted(maps.Keys(d.IOPS)) {
			qds = append(qds, fmt.Sprintf("QD%d %s IOPS", qd, fmtCount(d.IOPS[qd])))
		}
		when := "start"
		if i > 0 {
			when = "end"
		}
		fmt.Fprintf(w, "disk limit at the %s (4 KiB O_DIRECT random reads on the shards): QD1 %s p50 (%s p99), %s\n",
			when, fmtDur(d.QD1.P50), fmtDur(d.QD1.P99), strings.Join(qds, ", "))
	}
	if f := r.Fio; f != nil {
		if f.CPUPerRead > 0 {
			fmt.Fprintf(w, "fio floor (4 KiB random reads, io_uring, QD%d, O_DIRECT, %.0f s on %s): %s IOPS, %.1f µs of CPU a read (usr %.1f%% + sys %.1f%% of one CPU)\n",
				fioQueueDepth, f.RuntimeSec, filepath.Base(f.File), fmtCount(f.IOPS), f.CPUPerRead, f.UsrCPU, f.SysCPU)
		} else {
			fmt.Fprintf(w, "fio floor: n/a (%s)\n", f.Missing)
		}
	}
	for _, g := range r.Geometries {
		fmt.Fprintf(w, "\n%s  (%s", g.Geometry, g.ModelDir)
		if g.Generated > 0 {
			fmt.Fprintf(w, ", generated in %v", g.Generated.Round(time.Second))
		}
		fmt.Fprint(w, ")\n")
		if len(g.ChunkRows) > 0 {
			var rows, pages int
			for i := range g.ChunkRows {
				rows += g.ChunkRows[i]
				pages += g.ChunkPages[i]
			}
			fmt.Fprintf(w, "prefill chunk: %s unique rows (all layers), %.2f new pages/row (not read by an earlier chunk); disk limit %s a chunk\n",
				fmtCount(float64(rows)/float64(len(g.ChunkRows))), float64(pages)/float64(rows), fmtDur(time.Duration(g.LimitChunkSec*float64(time.Second))))
		}
		fmt.Fprintf(w, "%-20s │ %27s │ %35s │ %13s │ %13s │ %31s\n", "", "decode step", "prefill chunk gather", "backing B/row", "cpu µs/page", "daemon")
		fmt.Fprintf(w, "%-20s │ %6s %6s %6s %6s │ %8s %7s %6s %6s │ %6s %6s │ %6s %6s │ %5s %7s %8s %8s\n",
			"path", "p50", "p99", "×mmap", "×disk", "mean", "rows/s", "×mmap", "×disk", "dec", "pre", "dec", "pre", "cpu s", "rss max", "anon", "engine")
		fmt.Fprintf(w, "%s\n", strings.Repeat("─", 21)+"┼"+strings.Repeat("─", 29)+"┼"+strings.Repeat("─", 37)+"┼"+strings.Repeat("─", 15)+"┼"+strings.Repeat("─", 15)+"┼"+strings.Repeat("─", 33))
		for _, p := range g.Paths {
			if p.Skipped != "" {
				fmt.Fprintf(w, "%-20s │ skipped: %s\n", p.Label, p.Skipped)
				continue
			}
			if p.Failed != "" {
				first, _, _ := strings.Cut(p.Failed, "\n")
				fmt.Fprintf(w, "%-20s │ FAILED: %s\n", p.Label, first)
				continue
			}
			dec := [4]string{"-", "-", "-", "-"}
			if ph := p.Decode; ph != nil {
				dec = [4]string{fmtDur(ph.Times.P50), fmtDur(ph.Times.P99), fmtRatio(p.Ratios.DecodeVsMmap), fmtRatio(p.Ratios.DecodeVsDisk)}
			}
			pre := [4]string{"-", "-", "-", "-"}
			if ph := p.Prefill; ph != nil {
				pre = [4]string{fmtDur(ph.Times.Mean), fmtCount(ph.RowsPerSec), fmtRatio(p.Ratios.PrefillVsMmap), fmtRatio(p.Ratios.PrefillVsDisk)}
			}
			bpr, cpp := [2]string{"-", "-"}, [2]string{"-", "-"}
			for i, ph := range []*Phase{p.Decode, p.Prefill} {
				if ph != nil && ph.BackingFrom != "" {
					bpr[i] = fmtCount(ph.BytesPerRow)
				}
				if ph != nil && ph.DaemonCPUPerPage > 0 {
					cpp[i] = sig3(ph.DaemonCPUPerPage)
				}
			}
			dm := [4]string{"-", "-", "-", "-"}
			if d := p.Daemon; d != nil {
				dm = [4]string{fmt.Sprintf("%.1f", d.CPU.Seconds()), fmtMiB(d.Mem.HWM), fmtMiB(d.Mem.Anon), d.ReadEngine}
			}
			fmt.Fprintf(w, "%-20s │ %6s %6s %6s %6s │ %8s %7s %6s %6s │ %6s %6s │ %6s %6s │ %5s %7s %8s %8s\n",
				p.Label, dec[0], dec[1], dec[2], dec[3], pre[0], pre[1], pre[2], pre[3], bpr[0], bpr[1], cpp[0], cpp[1], dm[0], dm[1], dm[2], dm[3])
		}
		for _, p := range g.Paths {
			if p.Prefill == nil || p.Prefill.Prefetch == nil {
				continue
			}
			pf := p.Prefill.Prefetch
			fmt.Fprintf(w, "%s prefetch: %s a chunk p50 (%s max) for compute %v: %s pages/s, %s backing reads/s; done within compute for %d of %d chunks",
				p.Label, fmtDur(pf.Times.P50), fmtDur(pf.Times.Max), r.Settings.Compute, fmtCount(pf.PagesPerSec), fmtCount(pf.ReadsPerSec), pf.WithinCompute, pf.Times.N)
			if st := p.Prefill.Stats; st != nil && st.PrefetchLate+st.PrefetchPagesCached > 0 {
				fmt.Fprintf(w, "; %s pages late (%s of them taken from the prefetch's read before its store), %s cached already (not read)",
					fmtCount(float64(st.PrefetchLate)), fmtCount(float64(st.PrefetchLateServed)), fmtCount(float64(st.PrefetchPagesCached)))
			}
			if pf.Failed > 0 {
				fmt.Fprintf(w, "; %d barriers FAILED", pf.Failed)
			}
			fmt.Fprintln(w)
		}
		for _, p := range g.Paths {
			ph := p.PrefetchAlone
			if ph == nil || ph.Prefetch == nil {
				continue
			}
			pf := ph.Prefetch
			fmt.Fprintf(w, "%s prefetch alone (one chunk's hints, cold cache, no gather): %s pages in %s: %s pages/s, %s backing reads/s; daemon %s µs and %.2f context switches a backing page\n",
				p.Label, fmtCount(float64(pf.Pages)), fmtDur(pf.Times.Max), fmtCount(pf.PagesPerSec), fmtCount(pf.ReadsPerSec), sig3(ph.DaemonCPUPerPage), ph.DaemonSwitchesPerPage)
		}
		for _, p := range g.Paths {
			seen := map[string]bool{}
			for _, ph := range []*Phase{p.Decode, p.Prefill} {
				if ph != nil && ph.Barrier != "" && !seen[ph.BarrierHow] {
					seen[ph.BarrierHow] = true
					fmt.Fprintf(w, "%s barrier: %s", p.Label, ph.BarrierHow)
					if h := p.Decode; h != nil && h.Hint != nil {
						fmt.Fprintf(w, "; decode hints + barrier p50 %s of the step's %s", fmtDur(h.Hint.P50), fmtDur(h.Times.P50))
					}
					fmt.Fprintln(w)
				}
			}
		}
		for _, p := range g.Paths {
			if p.Decode == nil || p.Prefill == nil || p.Decode.DaemonSwitchesPerPage+p.Prefill.DaemonSwitchesPerPage == 0 {
				continue
			}
			fmt.Fprintf(w, "%s daemon context switches a backing page: decode %.2f, prefill %.2f\n",
				p.Label, p.Decode.DaemonSwitchesPerPage, p.Prefill.DaemonSwitchesPerPage)
		}
		colds := map[string]bool{}
		for _, p := range g.Paths {
			if p.Path == PathWarm {
				continue
			}
			for _, ph := range []*Phase{p.Decode, p.Prefill} {
				if ph != nil && ph.Cold != "" {
					colds[ph.Cold] = true
				}
			}
		}
		var cs []string
		for c := range colds {
			cs = append(cs, c)
		}
		if len(cs) > 0 {
			fmt.Fprintf(w, "cold caches before each path and phase: %s; daemon cpu µs/page is its CPU over the phase per 4 KiB of backing reads; rss max includes the table pages its hot tier pins, anon is its heap at the end\n", strings.Join(cs, ", "))
		}
	}
	r.writeObjectStore(w)
	r.writeServe(w)
	if len(r.Targets) > 0 {
		fmt.Fprintf(w, "\ntargets (measured ratio, bound):\n")
		// Targets whose precondition did not hold say nothing: one line per
		// geometry and reason names them (the demo had five lines of n/a).
		type unjudged struct{ geometry, why string }
		var order []unjudged
		folded := map[unjudged][]string{}
		for _, t := range r.Targets {
			if t.Unmet != "" {
				k := unjudged{t.Geometry, t.Unmet}
				if folded[k] == nil {
					order = append(order, k)
				}
				folded[k] = append(folded[k], t.ID)
				continue
			}
			mark := "MISSED"
			if t.Met {
				mark = "met   "
			}
			val := fmt.Sprintf("%6.2f", t.Value)
			if t.Value <= 0 {
				val = "   n/a"
			}
			cmp := "≤"
			if t.AtLeast {
				cmp = "≥"
			}
			fmt.Fprintf(w, "  %s %-6s %-72s %s (bound %s %.2f): %s\n", mark, t.Geometry, t.Name, val, cmp, t.Bound, t.Detail)
		}
		for _, k := range order {
			fmt.Fprintf(w, "  n/a    %-6s not judged (%s): %s\n", k.geometry, k.why, strings.Join(folded[k], ", "))
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	if len(r.Models) > 0 {
		var names []string
		var total int64
		for _, m := range r.Models {
			names = append(names, fmt.Sprintf("%s (%s)", filepath.Base(m.Dir), fmtBytes(float64(m.Bytes))))
			total += m.Bytes
		}
		fmt.Fprintf(w, "\nmodels kept in %s for the next run: %s, %s in all; remove them with: engramfs bench --remove-models --model-dir %s\n",
			r.ModelRoot, strings.Join(names, ", "), fmtBytes(float64(total)), r.ModelRoot)
	}
	fmt.Fprintf(w, "\nratios are time over time (below 1 is faster): ×mmap against path 2; ×disk against one QD1 read (decode) or the chunk's pages at the best measured IOPS (prefill).\n")
}

// Headline is the run's result in a line a geometry: hinted engramfs's
// decode step and prefill gather against mmap of the shards, and engramfs
// without hints; empty when those paths did not run.
func (r *Report) Headline() string {
	var lines []string
	for _, g := range r.Geometries {
		mmap, hints, eng := g.path(PathMmap), g.path(PathHints), g.path(PathEngramfs)
		if mmap == nil || mmap.Decode == nil || hints == nil || hints.Decode == nil {
			continue
		}
		line := fmt.Sprintf("%s: %s decode step p50 %s against mmap's %s (%s)", g.Geometry.Name, pathName(hints),
			fmtDur(hints.Decode.Times.P50), fmtDur(mmap.Decode.Times.P50), timesFaster(hints.Ratios.DecodeVsMmap))
		if hints.Prefill != nil && hints.Ratios.PrefillVsMmap > 0 {
			line += fmt.Sprintf(", prefill gather %s", timesFaster(hints.Ratios.PrefillVsMmap))
		}
		if eng != nil && eng.Ratios.DecodeVsMmap > 0 {
			line += fmt.Sprintf("; %s without hints: decode %s", pathName(eng), timesFaster(eng.Ratios.DecodeVsMmap))
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// pathName is a path's label without the table's number ("5 engramfs+hints").
func pathName(p *PathResult) string { return strings.TrimLeft(p.Label, "0123456789' ") }

// timesFaster says a time ratio (below 1 is faster) as people say it.
func timesFaster(ratio float64) string {
	switch {
	case ratio <= 0:
		return "n/a"
	case ratio < 1:
		return fmt.Sprintf("%.1f× faster", 1/ratio)
	case ratio > 1:
		return fmt.Sprintf("%.1f× slower", ratio)
	}
	return "the same"
}

// statsDelta is after - before for every counter; gauges (signed fields and
// flags) keep their value after.
func statsDelta(before, after stats.Snapshot) stats.Snapshot {
	out := after
	bv, ov := reflect.ValueOf(before), reflect.ValueOf(&out).Elem()
	for i := range ov.NumField() {
		if f := ov.Field(i); f.Kind() == reflect.Uint64 {
			f.SetUint(f.Uint() - bv.Field(i).Uint())
		}
	}
	return out
}

// fmtDur prints a duration with three significant digits in µs, ms or s.
func fmtDur(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Millisecond:
		return sig3(float64(d)/1e3) + "µs"
	case d < time.Second:
		return sig3(float64(d)/1e6) + "ms"
	}
	return sig3(d.Seconds()) + "s"
}

func sig3(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func fmtRatio(v float64) string {
	if v <= 0 {
		return "-"
	}
	if v >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	if v >= 10 {
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

// fmtCount prints a count with a K or M suffix.
func fmtCount(v float64) string {
	switch {
	case v <= 0:
		return "-"
	case v >= 10e6:
		return fmt.Sprintf("%.0fM", v/1e6)
	case v >= 1e6:
		return fmt.Sprintf("%.1fM", v/1e6)
	case v >= 10e3:
		return fmt.Sprintf("%.0fK", v/1e3)
	case v >= 1e3:
		return fmt.Sprintf("%.1fK", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

func fmtMiB(n int64) string { return fmt.Sprintf("%.0fM", float64(n)/(1<<20)) }

func fmtBytes(v float64) string {
	switch {
	case v >= 1<<30:
		return fmt.Sprintf("%.1f GiB", v/(1<<30))
	case v >= 1<<20:
		return fmt.Sprintf("%.0f MiB", v/(1<<20))
	case v >= 1<<10:
		return fmt.Sprintf("%.0f KiB", v/(1<<10))
	}
	return fmt.Sprintf("%.0f B", v)
}

package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/memcg"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// ServeConfig is the serving loop: an inference node's requests (a
// prefill of chunks, the next chunk warmed while this one computes, then
// decode steps whose rows are known only at the step) served by rank
// processes on tables several times larger than the memory the ranks and
// the daemon may use, every path on the same plan from the same cold
// start (bench/README.md, "The serving loop").
type ServeConfig struct {
	// Skip leaves the serving loop out of the run; Only runs nothing else
	// (`engramfs bench --serve`).
	Skip, Only bool
	// Geometries are the serving loop's own models (their own sizes:
	// ~3 GB of tables by default, as in the run).
	Geometries []Geometry
	Paths      []PathID // of PathMmap, PathMmapWillneed, PathEngramfsWillneed, PathEngramfs, PathHints
	Ranks      []int    // rank processes on one mount, each count a run of its own
	Spec       ServeSpec
	// Compute is a prefill chunk's compute, during which the next chunk is
	// prefetched; DecodeCompute the compute after each decode step.
	Compute, DecodeCompute time.Duration
	// MemLimit is the memory cgroup's limit over the ranks and the daemon;
	// CacheSize the daemon's --cache-size (its pinned hot tier, inside
	// the limit).
	MemLimit  int64
	CacheSize string
	// GatherWorkers gather a prefill chunk in each rank (the seed's 96 mmap
	// threads); PrefetchThreads and PrefetchTaskRows are the v3 prefetch
	// pool (_hash_ahead: 32 threads, tasks of 512 rows).
	GatherWorkers, PrefetchThreads, PrefetchTaskRows int
	// BurstRuns is how many bursts of each size time the step floor.
	BurstRuns int
	// VerifySample rows of each layer of each chunk are checked against
	// the model (0: all); every decode row is.
	VerifySample int
	// CommandTimeout fails a path whose ranks do not answer a command in
	// time (a hung daemon) instead of hanging the run.
	CommandTimeout time.Duration
	// DecodeOverlap: engramfs+hints gathers a decode step right after its
	// hints and reads the barrier after the gather, so the gather's faults
	// join the reads still in flight, instead of waiting for the barrier
	// first (docs/design.md, Walk 2, "Overlapping the gather").
	DecodeOverlap bool
	// DecodePerLayer: engramfs+hints sends a step's hints on a handle per
	// layer and waits for each layer right before its gather, so the later
	// layers' reads land while the earlier layers are gathered.
	DecodePerLayer bool
	// DecodeWrites: engramfs+hints sends a step's hints as a write a layer
	// and then reads the barrier, instead of one step ioctl
	// (hints.StepCmd).
	DecodeWrites bool
	// PrefillGatherFirst: engramfs+hints gathers a prefill chunk without
	// waiting for its prefill hints, and reads the prefill barrier after
	// the gather for the counts (the example engine's way: nothing waits
	// for its hash-ahead).
	PrefillGatherFirst bool
}

// ServePaths are the serving loop's paths, in report order.
var ServePaths = []PathID{PathMmap, PathMmapWillneed, PathEngramfsWillneed, PathEngramfs, PathHints}

// DefaultServePaths are those the issue compares.
var DefaultServePaths = []PathID{PathMmap, PathMmapWillneed, PathEngramfsWillneed, PathHints}

// DefaultServe is the run: two layers of 360,448 rows (3.0 GB of
// tables on big, 5,767,168 rows and as many bytes on flash), a 1.25 GiB
// memory limit, a 512 MiB hot tier, 10 requests of 4 chunks of 3,072 rows
// a layer and 32 decode steps of 72 lookups a layer, 1 and 4 ranks.
func DefaultServe() ServeConfig {
	big, _ := NewGeometry(GeometryBig, 2, 360448)
	flash, _ := NewGeometry(GeometryFlash, 2, 16*360448)
	return ServeConfig{
		Geometries: []Geometry{big, flash},
		Paths:      DefaultServePaths,
		Ranks:      []int{1, 4},
		Spec: ServeSpec{Requests: 10, Chunks: 4, ChunkRows: 3072, RareFraction: 0.2,
			Steps: 32, StepRows: 72, S: 0.9},
		Compute:          200 * time.Millisecond,
		DecodeCompute:    10 * time.Millisecond,
		MemLimit:         1280 << 20,
		CacheSize:        "512MiB",
		GatherWorkers:    96,
		PrefetchThreads:  32,
		PrefetchTaskRows: 512,
		BurstRuns:        40,
		VerifySample:     64,
		CommandTimeout:   2 * time.Minute,
	}
}

// QuickServe is the serving loop of `bench --quick`: the quick run's
// 1.0 GiB models, the limit and the tier scaled with them (the tables 2.3×
// the limit, as by default), 3 requests of 16 steps.
func QuickServe() ServeConfig {
	s := DefaultServe()
	big, _ := NewGeometry(GeometryBig, 2, 128<<10)
	flash, _ := NewGeometry(GeometryFlash, 2, 2<<20)
	s.Geometries = []Geometry{big, flash}
	s.Spec.Requests, s.Spec.Steps = 3, 16
	s.MemLimit = 464 << 20
	s.CacheSize = "192MiB"
	s.BurstRuns = 20
	return s
}

func (s *ServeConfig) check() error {
	if s.Skip {
		return nil
	}
	switch {
	case len(s.Geometries) == 0 || len(s.Paths) == 0 || len(s.Ranks) == 0:
		return errors.New("serving loop: nothing to measure (geometries, paths, ranks)")
	case s.MemLimit < 0 || s.GatherWorkers < 1 || s.PrefetchThreads < 1 || s.PrefetchTaskRows < 1 || s.BurstRuns < 1:
		return errors.New("serving loop: the limit, worker pools, prefetch tasks and burst runs must be positive")
	case s.DecodeOverlap && s.DecodePerLayer:
		return errors.New("serving loop: --serve-decode-overlap and --serve-decode-per-layer are two ways of waiting for a step's hints; choose one")
	case s.DecodeWrites && (s.DecodeOverlap || s.DecodePerLayer):
		return errors.New("serving loop: --serve-decode-writes is implied by --serve-decode-overlap and --serve-decode-per-layer (neither waits with the step ioctl)")
	}
	for _, p := range s.Paths {
		if !slices.Contains(ServePaths, p) {
			return fmt.Errorf("serving loop: path %s: want one of %v", p, ServePaths)
		}
	}
	for _, n := range s.Ranks {
		if n < 1 || n > 64 {
			return fmt.Errorf("serving loop: %d ranks: want 1 to 64", n)
		}
	}
	return s.Spec.check()
}

func (s *ServeConfig) needsMount() bool { return slices.ContainsFunc(s.Paths, PathID.mounts) }

// ServeReport is the serving loop's part of a report.
type ServeReport struct {
	Spec           ServeSpec     `json:"spec"`
	Compute        time.Duration `json:"compute_ns"`
	DecodeCompute  time.Duration `json:"decode_compute_ns"`
	DecodeOverlap  bool          `json:"decode_overlap,omitempty"`
	DecodePerLayer bool          `json:"decode_per_layer,omitempty"`
	DecodeWrites   bool          `json:"decode_writes,omitempty"`
	// PrefillGatherFirst: see ServeConfig.
	PrefillGatherFirst bool   `json:"prefill_gather_first,omitempty"`
	MemLimit           int64  `json:"mem_limit_bytes"`
	CacheSize          string `json:"cache_size"`
	// Cgroup is the memory cgroup the ranks and the daemon ran in, or
	// NoCgroup why there was none (the run then had no memory limit).
	Cgroup   string `json:"cgroup,omitempty"`
	NoCgroup string `json:"no_cgroup,omitempty"`
	// Device is the block device under the models; NoDevice why there is
	// none. IOFrom says what counted the paths' disk reads: the serving
	// processes' own, from their cgroup's block-layer counters (blkio or
	// io.stat: the readahead, fadvise(WILLNEED) and O_DIRECT reads of the
	// ranks and the daemon, no other process's), or, where there is no
	// such cgroup, the device's (/sys/dev/block/MAJ:MIN/stat: every
	// process's, so on a shared machine others' reads too). The device's
	// are reported beside the cgroup's either way.
	Device   *BlockDev `json:"device,omitempty"`
	NoDevice string    `json:"no_device,omitempty"`
	IOFrom   string    `json:"io_from"`
	// Floor is the burst latencies the step floor is read from: the best
	// of FloorRuns, measured before and after the paths.
	Floor     *BurstFloor   `json:"floor,omitempty"`
	FloorRuns []*BurstFloor `json:"floor_runs,omitempty"`
	Runs      []*ServeRun   `json:"runs"`
}

// ServeRun is the paths of one geometry and rank count.
type ServeRun struct {
	Geometry Geometry `json:"geometry"`
	ModelDir string   `json:"model_dir"`
	Ranks    int      `json:"ranks"`
	// Shape is rank 0's plan's; the others' are alike.
	Shape PlanShape `json:"plan_shape"`
	// Distinct pages every rank's plan asks for, in the mount's layout and
	// the shards'; MountReadOnce the backing bytes of reading each mount
	// page once (O_DIRECT's alignment included, at Align).
	MountPages    int    `json:"distinct_mount_pages"`
	ShardPages    int    `json:"distinct_shard_pages"`
	MountReadOnce uint64 `json:"mount_read_once_bytes"`
	Align         int64  `json:"shard_dio_align"`
	// StepNewMount and StepNewShard are the reads a decode step (all
	// ranks, mean over steps) needs for pages that no earlier chunk or
	// step of any rank named, taken in the order the loop runs them
	// (request by request: its chunks, then its steps, every rank at
	// each), in the mount's layout and the shards': the compulsory reads,
	// which no cache of any size saves.
	StepNewMount float64      `json:"step_new_reads_mount"`
	StepNewShard float64      `json:"step_new_reads_shard"`
	Paths        []*ServePath `json:"paths"`
}

// ServePath is one path of the serving loop.
type ServePath struct {
	Path    PathID `json:"path"`
	Label   string `json:"label"`
	Failed  string `json:"failed,omitempty"`
	Skipped string `json:"skipped,omitempty"`

	// Decode is each step's time: the slowest rank's, since TP ranks wait
	// for each other at the step's end; Hint its hints and barrier
	// (engramfs+hints), or its fadvise calls (v3).
	Decode Summary  `json:"decode"`
	Hint   *Summary `json:"hint,omitempty"`
	// DecodeGather is each step's gather after its hints and barrier or
	// its fadvise calls (the slowest rank's), where Hint is measured.
	DecodeGather *Summary `json:"decode_gather,omitempty"`
	// Steps and Chunks are each step's and chunk's time, in order.
	Steps  []time.Duration `json:"step_ns"`
	Chunks []time.Duration `json:"chunk_ns"`
	// Chunk is each prefill chunk's wait for its prefetch + gather (the
	// slowest rank's), and each part alone.
	Chunk       Summary `json:"chunk"`
	ChunkWait   Summary `json:"chunk_wait"`
	ChunkGather Summary `json:"chunk_gather"`

	// Disk is the reads over the whole path, DecodeDisk during decode
	// steps only, StepReads each step's, counted as ServeReport.IOFrom
	// says; Device the block device's own over the whole path.
	Disk       memcg.IOCounters `json:"disk"`
	DecodeDisk memcg.IOCounters `json:"decode_disk"`
	StepReads  []uint64         `json:"step_reads"`
	Device     DevCounters      `json:"device"`
	// ColdReads is the device reads a decode step (mean), NewReads the
	// compulsory ones in the path's layout (ServeRun.StepNewMount or
	// StepNewShard); Floor the p50 over steps of each step's floor (a
	// burst of its reads), FloorMean the floor of the mean.
	ColdReads float64       `json:"cold_reads_per_step"`
	NewReads  float64       `json:"new_reads_per_step"`
	Floor     time.Duration `json:"floor_p50_ns"`
	// StepPages and StepResident: the steps' distinct pages and those
	// resident before their step (mincore, summed over steps and ranks).
	StepPages    int64 `json:"step_pages"`
	StepResident int64 `json:"step_resident"`
	// StepFaults: the ranks' page faults during the steps (getrusage).
	StepFaults int64 `json:"step_faults"`
	Verified   int64 `json:"rows_verified"`
	// DecodeBarrier and PrefillBarrier sum what the barriers said settled.
	DecodeBarrier  *hints.Status `json:"decode_barrier,omitempty"`
	PrefillBarrier *hints.Status `json:"prefill_barrier,omitempty"`

	// BytesPerDistinct is the path's backing bytes (the daemon's for the
	// mount's paths, the disk's for the shards') over its distinct pages ×
	// 4096; ReadOnce the same bytes over those of reading each page once.
	BytesPerDistinct float64 `json:"backing_bytes_per_distinct_page"`
	ReadOnce         float64 `json:"backing_bytes_per_read_once"`
	// Reread is the pages read more than once. For the shards' paths
	// (the page cache's reads), the cgroup's refaults: pages read again
	// after its reclaim evicted them. For the mount's, the daemon's
	// backing_pages_again: table pages read from backing after it had put
	// them in the page cache once.
	Reread float64 `json:"pages_reread"`

	Daemon  *ServeDaemon  `json:"daemon,omitempty"`
	Memory  *memcg.Usage  `json:"memory,omitempty"` // the cgroup's, at the end
	RankCPU time.Duration `json:"rank_cpu_ns"`
	Elapsed time.Duration `json:"elapsed_ns"`
}

// ServeDaemon is what the daemon of a mount path did over the whole path.
type ServeDaemon struct {
	CPU             time.Duration  `json:"cpu_ns"`
	CPUPerPage      float64        `json:"cpu_us_per_backing_page"`
	SwitchesPerPage float64        `json:"switches_per_backing_page"`
	Stats           stats.Snapshot `json:"stats"` // counters over the path; gauges (cache_used_bytes: the hot tier) at its end
	Mem             procfs.Mem     `json:"mem"`
	Refaulted       uint64         `json:"hint_pages_refaulted"` // hinted pages FUSE read anyway, all layers
}

func (p *ServePath) measured() bool { return p.Failed == "" && p.Skipped == "" }

func (r *ServeRun) path(id PathID) *ServePath {
	for _, p := range r.Paths {
		if p.Path == id && p.measured() {
			return p
		}
	}
	return nil
}

// serveRun measures the serving loop: the floor, then for every geometry
// and rank count every path, then the floor again.
func serveRun(ctx context.Context, cfg *Config, dirs map[string]string, flags []string, drop *dropper, prog *progress, note func(string, ...any)) (*ServeReport, error) {
	sc := &cfg.Serve
	rep := &ServeReport{Spec: sc.Spec, Compute: sc.Compute, DecodeCompute: sc.DecodeCompute, DecodeOverlap: sc.DecodeOverlap, DecodePerLayer: sc.DecodePerLayer, DecodeWrites: sc.DecodeWrites, PrefillGatherFirst: sc.PrefillGatherFirst, MemLimit: sc.MemLimit, CacheSize: sc.CacheSize}
	var shards []string
	for _, g := range sc.Geometries {
		ents, err := filepath.Glob(filepath.Join(dirs[g.DirName()], "model-*.safetensors"))
		if err != nil {
			return rep, err
		}
		shards = append(shards, ents...)
	}
	if dev, err := FindBlockDev(dirs[sc.Geometries[0].DirName()]); err != nil {
		rep.NoDevice = err.Error()
		note("serving loop: %v: no disk bytes, cold reads or floor", err)
	} else {
		rep.Device = dev
	}
	floor := func(when string) error {
		prog.setPhase("serving loop: step floor (%s): bursts of %v random 4 KiB O_DIRECT reads", when, BurstSizes)
		f, err := MeasureBursts(ctx, shards, BurstSizes, sc.BurstRuns, "auto")
		if err != nil {
			return err
		}
		rep.FloorRuns = append(rep.FloorRuns, f)
		rep.Floor = bestBursts(rep.FloorRuns)
		return nil
	}
	if err := floor("start"); err != nil {
		return rep, err
	}
	// One group per path, so each path's peak is its own; a first one made
	// here says whether there can be any.
	rep.IOFrom = ioFromDevice
	if sc.MemLimit > 0 {
		if g, err := memcg.New(cgroupPrefix, sc.MemLimit); err != nil {
			rep.NoCgroup = err.Error()
			note("serving loop: %v: ran without a memory limit, so the tables may fit in RAM (not the issue's setup)", err)
		} else {
			rep.Cgroup = g.String()
			if rep.Device != nil {
				if err := g.CountIO(rep.Device.Major, rep.Device.Minor); err != nil {
					note("serving loop: %v: disk reads are the device's, other processes' included", err)
				} else {
					rep.IOFrom = ioFromCgroup
				}
			}
			if err := g.Remove(); err != nil {
				return rep, err
			}
		}
	} else {
		rep.NoCgroup = "no limit asked for"
	}
	canMount := daemonproc.CanMount()
	for _, g := range sc.Geometries {
		dir := dirs[g.DirName()]
		m, err := backing.Load(dir, backing.DefaultTablePattern)
		if err != nil {
			return rep, err
		}
		for _, ranks := range sc.Ranks {
			run, err := newServeRun(cfg, g, dir, m, ranks)
			if err != nil {
				return rep, err
			}
			rep.Runs = append(rep.Runs, run)
			for _, p := range sc.Paths {
				if p.mounts() && canMount != nil {
					run.Paths = append(run.Paths, &ServePath{Path: p, Label: p.Label(), Skipped: "no FUSE (needs root and /dev/fuse)"})
					continue
				}
				sp, err := servePath(ctx, cfg, run, m, p, flags, rep, drop, prog)
				if ctx.Err() != nil {
					return rep, ctx.Err()
				}
				if err != nil {
					first, _, _ := strings.Cut(err.Error(), "\n")
					prog.printf("serving loop %s ×%d %s FAILED: %v", g.Name, ranks, p, err)
					note("serving loop %s ×%d %s failed: %s (the whole error is in the JSON report)", g.Name, ranks, p, first)
					sp = &ServePath{Path: p, Label: p.Label(), Failed: err.Error()}
				}
				sp.finish(run, rep.Floor)
				run.Paths = append(run.Paths, sp)
			}
		}
	}
	if err := floor("end"); err != nil {
		return rep, err
	}
	for _, run := range rep.Runs {
		for _, p := range run.Paths {
			p.finish(run, rep.Floor)
		}
	}
	return rep, nil
}

// cgroupPrefix names the bench's memory cgroups (PREFIX-PID-N).
const cgroupPrefix = "engramfs-bench"

// stepNewReads counts every rank's plan into mount and shard in the order
// servePath runs them (request by request: every rank's chunks, then every
// rank's steps, in lockstep) and returns the mean reads a step (all ranks)
// of pages nothing named before it, in each layout.
func stepNewReads(m *backing.Model, plans [][]ServeRequest, mount, shard *PageCounter) (newMount, newShard float64) {
	add := func(rows [][]uint64) (mr, sr int) {
		for j, rs := range rows {
			_, a := mount.AddReads(m.Layers[j], rs)
			_, b := shard.AddReads(m.Layers[j], rs)
			mr, sr = mr+a, sr+b
		}
		return mr, sr
	}
	steps, nm, ns := 0, 0, 0
	for i := 0; len(plans) > 0 && i < len(plans[0]); i++ {
		for k := range plans[0][i].Chunks {
			for _, plan := range plans {
				add(plan[i].Chunks[k])
			}
		}
		for s := range plans[0][i].Steps {
			for _, plan := range plans {
				a, b := add(plan[i].Steps[s])
				nm, ns = nm+a, ns+b
			}
			steps++
		}
	}
	if steps == 0 {
		return 0, 0
	}
	return float64(nm) / float64(steps), float64(ns) / float64(steps)
}

// What counted a serving path's disk reads (ServeReport.IOFrom).
const (
	ioFromCgroup = "cgroup"
	ioFromDevice = "device"
)

// newServeRun draws every rank's plan to count the pages they ask for.
func newServeRun(cfg *Config, g Geometry, dir string, m *backing.Model, ranks int) (*ServeRun, error) {
	var layerRows []uint64
	for _, l := range m.Layers {
		n, _ := m.LayerRows(l)
		layerRows = append(layerRows, n)
	}
	run := &ServeRun{Geometry: g, ModelDir: dir, Ranks: ranks, Align: 1}
	plans := make([][]ServeRequest, ranks)
	for rk := range ranks {
		plan, err := ServePlan(cfg.Seed, rk, layerRows, cfg.Serve.Spec)
		if err != nil {
			return nil, err
		}
		plans[rk] = plan
	}
	run.Shape = Shape(plans[0])
	mount, shard := NewPageCounter(m), NewShardPageCounter(m)
	run.StepNewMount, run.StepNewShard = stepNewReads(m, plans, mount, shard)
	if len(m.Shards) > 0 {
		if f, align, _, err := backing.OpenDirect(m.Shards[0].Path, 0); err == nil {
			f.Close()
			run.Align = align
		}
	}
	run.MountPages, run.ShardPages, run.MountReadOnce = mount.Len(), shard.Len(), mount.ReadOnceBytes(run.Align)
	return run, nil
}

// finish computes what a path's figures give with the floor and the
// run's distinct pages.
func (p *ServePath) finish(run *ServeRun, floor *BurstFloor) {
	if !p.measured() {
		return
	}
	p.NewReads = run.StepNewShard
	if p.Path.mounts() {
		p.NewReads = run.StepNewMount
	}
	if steps := len(p.StepReads); steps > 0 {
		p.ColdReads = float64(p.DecodeDisk.Reads) / float64(steps)
		floors := make([]time.Duration, steps)
		for i, n := range p.StepReads {
			floors[i] = floor.At(float64(n))
		}
		p.Floor = Percentile(floors, 50)
	}
	var bytes uint64
	pages := run.ShardPages
	readOnce := uint64(run.ShardPages) * backing.PageSize
	if p.Path.mounts() {
		pages, readOnce = run.MountPages, run.MountReadOnce
		if p.Daemon != nil {
			bytes = p.Daemon.Stats.BackingBytes
		}
	} else {
		bytes = p.Disk.Bytes
	}
	p.BytesPerDistinct = ratio(float64(bytes), float64(pages)*backing.PageSize)
	p.ReadOnce = ratio(float64(bytes), float64(readOnce))
	switch {
	case p.Path.mounts() && p.Daemon != nil:
		p.Reread = float64(p.Daemon.Stats.BackingAgain)
	case p.Memory != nil:
		p.Reread = float64(p.Memory.Refaults)
	}
}

// servePath runs one path of the serving loop: caches dropped, a memory
// cgroup, the daemon (mount paths) and the rank processes in it, then
// every request in lockstep.
func servePath(ctx context.Context, cfg *Config, run *ServeRun, m *backing.Model, p PathID, flags []string, rep *ServeReport, drop *dropper, prog *progress) (sp *ServePath, err error) {
	sc := &cfg.Serve
	sp = &ServePath{Path: p, Label: p.Label()}
	name := fmt.Sprintf("serving loop %s ×%d %s", run.Geometry.Name, run.Ranks, p.Label())
	prog.setPhase("%s: dropping caches", name)
	var files []string
	for _, sh := range m.Shards {
		files = append(files, sh.Path)
	}
	if _, err := drop.drop(files); err != nil {
		return nil, err
	}
	var wrapper []string
	var group *memcg.Group
	if rep.Cgroup != "" {
		if group, err = memcg.New(cgroupPrefix, sc.MemLimit); err != nil {
			return nil, err
		}
		defer func() { err = errors.Join(err, group.Remove()) }()
		if rep.IOFrom == ioFromCgroup {
			if err := group.CountIO(rep.Device.Major, rep.Device.Minor); err != nil {
				return nil, err
			}
		}
		wrapper = group.Wrapper()
	}
	var d *daemonproc.Daemon
	mountpoint := ""
	if p.mounts() {
		d, err = daemonproc.Start(ctx, daemonproc.Options{
			Binary: cfg.Binary, ModelDir: run.ModelDir, MountDir: cfg.MountDir, Wrapper: wrapper, Env: daemonEnv(cfg),
			Flags: append([]string{"--log-format", "json"}, withFlag(flags, "--cache-size", sc.CacheSize)...),
		})
		if err != nil {
			return nil, err
		}
		// Stop the daemon after the ranks (deferred later, run first): they
		// map its files.
		defer func() {
			if serr := d.Stop(); serr != nil {
				err = errors.Join(err, fmt.Errorf("%s: stopping the daemon: %w", name, serr))
			}
		}()
		mountpoint = d.Mountpoint
	}
	ranks, err := startRanks(ctx, wrapper, run.Ranks, rankConfig{
		ModelDir: run.ModelDir, Mountpoint: mountpoint, Path: p, Seed: cfg.Seed, Spec: sc.Spec,
		GatherWorkers: sc.GatherWorkers, PrefetchThreads: sc.PrefetchThreads, PrefetchTaskRows: sc.PrefetchTaskRows,
		VerifySample: sc.VerifySample, DecodeOverlap: sc.DecodeOverlap, DecodePerLayer: sc.DecodePerLayer,
		DecodeWrites: sc.DecodeWrites, PrefillGatherFirst: sc.PrefillGatherFirst,
	}, sc.CommandTimeout)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, ranks.stop()) }()

	// io reads the device's counters and the counts the path is judged
	// on (ServeReport.IOFrom).
	io := func() (DevCounters, memcg.IOCounters, error) {
		if rep.Device == nil {
			return DevCounters{}, memcg.IOCounters{}, nil
		}
		dc, err := rep.Device.Read()
		if err != nil || rep.IOFrom != ioFromCgroup {
			return dc, memcg.IOCounters{Reads: dc.Reads, Bytes: dc.Bytes()}, err
		}
		own, err := group.IO()
		return dc, own, err
	}
	start := time.Now()
	dev0, own0, err := io()
	if err != nil {
		return nil, err
	}
	mark, err := markDaemon(d)
	if err != nil {
		return nil, err
	}
	sleep := func(dur time.Duration) error {
		select {
		case <-time.After(dur):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	var steps, hintTimes, stepGathers, chunks, waits, gathers []time.Duration
	var decBar, preBar hints.Status
	barriers := false
	for i := range sc.Spec.Requests {
		// Chunk k's prefetch runs during the compute before it (chunk
		// k-1's; for the first, the prompt's), then chunk k waits for it
		// and gathers.
		for k := range sc.Spec.Chunks {
			prog.setPhase("%s: request %d/%d, chunk %d/%d", name, i+1, sc.Spec.Requests, k+1, sc.Spec.Chunks)
			if _, err := ranks.all(ctx, rankCmd{Op: "prefetch", Req: i, Chunk: k}); err != nil {
				return nil, err
			}
			if err := sleep(sc.Compute); err != nil {
				return nil, err
			}
			reps, err := ranks.all(ctx, rankCmd{Op: "chunk", Req: i, Chunk: k})
			if err != nil {
				return nil, err
			}
			var total, wait, gather time.Duration
			for _, r := range reps {
				total, wait, gather = max(total, r.Wait+r.Gather), max(wait, r.Wait), max(gather, r.Gather)
				sp.Verified += int64(r.Verified)
				if r.Status != nil {
					addStatus(&preBar, *r.Status)
					barriers = true
				}
			}
			chunks, waits, gathers = append(chunks, total), append(waits, wait), append(gathers, gather)
		}
		if err := sleep(sc.Compute); err != nil { // the last chunk's compute
			return nil, err
		}
		for s := range sc.Spec.Steps {
			prog.update("request %d/%d, step %d/%d", i+1, sc.Spec.Requests, s+1, sc.Spec.Steps)
			_, before, err := io()
			if err != nil {
				return nil, err
			}
			reps, err := ranks.all(ctx, rankCmd{Op: "step", Req: i, Step: s})
			if err != nil {
				return nil, err
			}
			_, after, err := io()
			if err != nil {
				return nil, err
			}
			sp.StepReads = append(sp.StepReads, after.Reads-before.Reads)
			sp.DecodeDisk.Reads += after.Reads - before.Reads
			sp.DecodeDisk.Bytes += after.Bytes - before.Bytes
			var step, hint, gather time.Duration
			for _, r := range reps {
				step, hint, gather = max(step, r.Step), max(hint, r.Hint), max(gather, r.Step-r.Hint)
				sp.StepPages += int64(r.Pages)
				sp.StepResident += int64(r.Resident)
				sp.StepFaults += r.Faults
				sp.Verified += int64(r.Verified)
				if r.Status != nil {
					addStatus(&decBar, *r.Status)
				}
			}
			steps = append(steps, step)
			if p == PathHints || p.willneed() {
				hintTimes = append(hintTimes, hint)
				stepGathers = append(stepGathers, gather)
			}
			if err := sleep(sc.DecodeCompute); err != nil {
				return nil, err
			}
		}
	}
	dev1, own1, err := io()
	if err != nil {
		return nil, err
	}
	sp.Elapsed = time.Since(start)
	sp.Device = dev1.Sub(dev0)
	sp.Disk = memcg.IOCounters{Reads: own1.Reads - own0.Reads, Bytes: own1.Bytes - own0.Bytes}
	if group != nil {
		u, err := group.Usage()
		if err != nil {
			return nil, err
		}
		sp.Memory = &u
	}
	sp.Decode, sp.Chunk, sp.ChunkWait, sp.ChunkGather = Summarize(steps), Summarize(chunks), Summarize(waits), Summarize(gathers)
	sp.Steps, sp.Chunks = steps, chunks
	if hintTimes != nil {
		h, g := Summarize(hintTimes), Summarize(stepGathers)
		sp.Hint, sp.DecodeGather = &h, &g
	}
	if p == PathHints {
		sp.DecodeBarrier = &decBar
		if barriers {
			sp.PrefillBarrier = &preBar
		}
	}
	if d != nil {
		use, err := mark.since(d)
		if err != nil {
			return nil, err
		}
		dd := &ServeDaemon{CPU: use.cpu, Stats: use.stats, CPUPerPage: use.cpuPerPage(), SwitchesPerPage: use.switchesPerPage()}
		for _, l := range dd.Stats.Layers {
			dd.Refaulted += l.Refaulted
		}
		if dd.Mem, err = d.Mem(); err != nil {
			return nil, err
		}
		sp.Daemon = dd
	}
	if sp.RankCPU, err = ranks.end(ctx); err != nil {
		return nil, err
	}
	return sp, nil
}

// addStatus adds every count of s to sum, those a later daemon's barrier
// adds to hints.Status included.
func addStatus(sum *hints.Status, s hints.Status) {
	sv, ov := reflect.ValueOf(s), reflect.ValueOf(sum).Elem()
	for i := range ov.NumField() {
		if f := ov.Field(i); f.Kind() == reflect.Uint64 {
			f.SetUint(f.Uint() + sv.Field(i).Uint())
		}
	}
}

// withFlag is flags with flag set to value (replacing it if there), or
// without it when value is empty.
func withFlag(flags []string, flag, value string) []string {
	out := make([]string, 0, len(flags)+2)
	for i := 0; i < len(flags); i++ {
		if flags[i] == flag {
			i++ // and its value
			continue
		}
		out = append(out, flags[i])
	}
	if value != "" {
		out = append(out, flag, value)
	}
	return out
}

// rankSet is the rank processes of one path, stepped in lockstep.
type rankSet struct {
	procs   []*rankProc
	timeout time.Duration
}

// rankProc is one rank process: its commands go to stdin, its answers come
// from stdout (read by one goroutine into replies), its stderr to a file.
type rankProc struct {
	cmd     *exec.Cmd
	stdin   interface{ Close() error }
	enc     *json.Encoder
	replies chan rankReply
	log     *os.File
}

// startRanks starts n ranks (this executable, as a rank) inside the
// memory cgroup of wrapper, and waits for each to be ready.
func startRanks(ctx context.Context, wrapper []string, n int, cfg rankConfig, timeout time.Duration) (*rankSet, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	rs := &rankSet{timeout: timeout}
	for i := range n {
		args := append(slices.Clone(wrapper), exe)
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), serveRankEnv+"=1")
		// Its own process group: a Ctrl-C reaches the bench alone, which
		// ends its ranks before it stops the daemon they map. If the bench
		// dies, its ranks die with it.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		log, err := os.CreateTemp("", "engramfs-bench-rank-*.log")
		if err != nil {
			rs.stop()
			return nil, err
		}
		cmd.Stderr = log
		stdin, err := cmd.StdinPipe()
		if err != nil {
			log.Close()
			rs.stop()
			return nil, err
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			log.Close()
			rs.stop()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			log.Close()
			rs.stop()
			return nil, fmt.Errorf("rank %d: %w", i, err)
		}
		rp := &rankProc{cmd: cmd, stdin: stdin, enc: json.NewEncoder(stdin), replies: make(chan rankReply, 1), log: log}
		go func() {
			dec := json.NewDecoder(bufio.NewReader(stdout))
			for {
				var r rankReply
				if err := dec.Decode(&r); err != nil {
					close(rp.replies)
					return
				}
				rp.replies <- r
			}
		}()
		rs.procs = append(rs.procs, rp)
		c := cfg
		c.Rank = i
		if err := rp.enc.Encode(c); err != nil {
			rs.stop()
			return nil, fmt.Errorf("rank %d: %w", i, err)
		}
	}
	if _, err := rs.collect(ctx, "start"); err != nil {
		rs.stop()
		return nil, err
	}
	return rs, nil
}

// all sends c to every rank, then waits for every answer.
func (rs *rankSet) all(ctx context.Context, c rankCmd) ([]rankReply, error) {
	for i, rp := range rs.procs {
		if err := rp.enc.Encode(c); err != nil {
			return nil, fmt.Errorf("rank %d: %s: %w%s", i, c.Op, err, rp.tail())
		}
	}
	return rs.collect(ctx, c.Op)
}

// collect takes one answer from every rank, failing on an error answer, a
// rank that exits, the timeout or ctx.
func (rs *rankSet) collect(ctx context.Context, what string) ([]rankReply, error) {
	out := make([]rankReply, len(rs.procs))
	timer := time.NewTimer(rs.timeout)
	defer timer.Stop()
	for i, rp := range rs.procs {
		select {
		case r, ok := <-rp.replies:
			if !ok {
				return nil, fmt.Errorf("rank %d exited during %s%s", i, what, rp.tail())
			}
			if r.Err != "" {
				return nil, fmt.Errorf("%s%s", r.Err, rp.tail())
			}
			out[i] = r
		case <-timer.C:
			return nil, fmt.Errorf("rank %d: no answer to %s within %v (a hung daemon?)", i, what, rs.timeout)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return out, nil
}

// end asks every rank for its CPU time and lets it exit.
func (rs *rankSet) end(ctx context.Context) (time.Duration, error) {
	reps, err := rs.all(ctx, rankCmd{Op: "end"})
	if err != nil {
		return 0, err
	}
	var cpu time.Duration
	for _, r := range reps {
		cpu += r.CPU
	}
	return cpu, nil
}

// stop ends every rank: stdin closed (a rank exits at its end), then
// killed if it has not exited within 10 s; it waits for each. A rank that
// exited badly is an error with its log.
func (rs *rankSet) stop() error {
	var errs []error
	for i, rp := range rs.procs {
		rp.stdin.Close()
		done := make(chan error, 1)
		go func() { done <- rp.cmd.Wait() }()
		var err error
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			_ = rp.cmd.Process.Kill()
			err = fmt.Errorf("did not exit within 10 s of its stdin closing: killed (%v)", <-done)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w%s", i, err, rp.tail()))
		}
		rp.log.Close()
		os.Remove(rp.log.Name())
	}
	rs.procs = nil
	return errors.Join(errs...)
}

// tail is the end of the rank's stderr, for an error.
func (rp *rankProc) tail() string {
	b, err := os.ReadFile(rp.log.Name())
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return "\nrank stderr:\n" + string(b)
}

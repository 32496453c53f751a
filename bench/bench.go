// Package bench measures how engram rows are gathered today (pread, mmap,
// mmap+willneed on the shard files) against engramfs with and without
// hints, and against the disk's own limit and fio's CPU per read, in one run
// on the same data: the body of cmd/engramfs-bench (`engramfs bench` and
// `engramfs demo` hand over to it).
//
// A run generates (or reuses) a synthetic model per geometry big enough to
// be cold, measures 4 KiB O_DIRECT random reads on its shards (and, when fio
// is on PATH, fio's CPU per such read with io_uring at QD64), then for
// every path drops the page cache and runs the decode workload (steps of
// Zipf-popular rows, timed one by one), drops it again and runs the prefill
// workload (chunks of unique rows, each gather timed). The engramfs paths
// run the daemon as a child process (Config.Binary's `mount`), so
// its CPU time and memory come from /proc and its backing I/O from
// .engramfs/stats; the other paths' backing I/O comes from /proc/self/io.
//
// Then the serving loop (serve.go): requests of prefill chunks and decode
// steps served by rank processes (serverank.go) in lockstep on one mount,
// inside a memory cgroup several times smaller than the tables, every
// path on the same plan (serveplan.go), judged against v3 on the shards
// and against each step's floor (floor.go).
package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
)

// Run measures what cfg asks for. On error (an interrupt included) it also
// returns what was measured so far, with every mount it made gone.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	start := time.Now()
	prog := newProgress(cfg.Progress, cfg.ProgressTTY)
	defer prog.done()
	rep := &Report{
		Started: start,
		Machine: describeMachine(cfg.ModelRoot),
		Settings: Settings{
			DecodeSteps: cfg.Decode.Steps, DecodeRows: cfg.Decode.RowsPerStep, ZipfS: cfg.Decode.S,
			Chunks: cfg.Prefill.Chunks, ChunkTokens: cfg.Prefill.ChunkTokens, Compute: cfg.Compute,
			PreadWorkers: cfg.PreadWorkers, PreadTaskRows: cfg.PreadTaskRows, MmapWorkers: cfg.MmapWorkers,
			QueueDepth: cfg.QueueDepth, Drop: cfg.Drop,
		},
	}
	defer func() { rep.Elapsed = time.Since(start) }()
	rep.Machine.Load = []string{"before the run: " + loadNow()}
	busy0, total0, cpuErr := procfs.MachineCPU()
	own0 := ownCPU()
	note := func(format string, a ...any) {
		n := fmt.Sprintf(format, a...)
		rep.Notes = append(rep.Notes, n)
		prog.printf("note: %s", n)
	}

	paths := cfg.Paths
	if cfg.Serve.Only {
		paths = nil
	}
	if cfg.needsMount() {
		if err := daemonproc.CanMount(); err != nil {
			note("engramfs paths skipped: %v", err)
			paths = nil
			for _, p := range cfg.Paths {
				if !p.mounts() {
					paths = append(paths, p)
				}
			}
		} else {
			flags, err := daemonFlags(&cfg, note)
			if err != nil {
				return nil, err
			}
			rep.Settings.DaemonFlags = flags
			rep.Settings.DaemonEnv = daemonEnv(&cfg)
		}
	}

	// Every model first: the disk limit is measured over all their shards.
	// The serving loop's models are the first ones of their size (the
	// issue's ~3 GB of tables) or the paths' (--quick).
	var models []Geometry
	if !cfg.Serve.Only {
		models = cfg.Geometries
	}
	main := len(models)
	if !cfg.Serve.Skip {
		for _, g := range cfg.Serve.Geometries {
			if !slices.ContainsFunc(models, func(h Geometry) bool { return h.DirName() == g.DirName() }) {
				models = append(models, g)
			}
		}
	}
	dirs := make([]string, len(models))
	modelDirs := map[string]string{} // by Geometry.DirName
	var shards []string
	for i, g := range models {
		prog.setPhase("%s: model", g.Name)
		t0 := time.Now()
		dir, generated, err := EnsureModel(ctx, cfg.ModelRoot, g, cfg.Seed, func(done, total int64) {
			prog.update("generating %s of %s", fmtBytes(float64(done)), fmtBytes(float64(total)))
		})
		if err != nil {
			return rep, err
		}
		dirs[i], modelDirs[g.DirName()] = dir, dir
		if !cfg.TemporaryModels {
			rep.ModelRoot = cfg.ModelRoot
			rep.Models = append(rep.Models, ModelFiles{Dir: dir, Bytes: dirBytes(dir)})
		}
		gr := &GeometryReport{Geometry: g, ModelDir: dir}
		if generated {
			gr.Generated = time.Since(t0)
			prog.printf("generated %s in %v", dir, gr.Generated.Round(time.Second))
		}
		if i < main {
			rep.Geometries = append(rep.Geometries, gr)
		}
		ents, err := filepath.Glob(filepath.Join(dir, "model-*.safetensors"))
		if err != nil {
			return rep, err
		}
		shards = append(shards, ents...)
	}

	measureDisk := func(when string) error {
		d, err := MeasureDisk(ctx, shards, cfg.DiskTime, cfg.DiskQDs, func(s string) { prog.setPhase("%s (%s)", s, when) })
		if err != nil {
			return err
		}
		rep.DiskRuns = append(rep.DiskRuns, d)
		rep.Disk = bestDisk(rep.DiskRuns)
		return nil
	}
	if err := measureDisk("start"); err != nil {
		return rep, err
	}
	// fio once, on one shard: the CPU floor of a 4 KiB read on this machine.
	prog.setPhase("fio floor: 4 KiB random reads, io_uring, QD%d, %v", fioQueueDepth, cfg.FioRuntime)
	rep.Fio = MeasureFio(ctx, largestFile(shards), cfg.FioRuntime)
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	// A missing floor is said by the report's fio line and its targets' n/a
	// line: no note a third time.

	drop := &dropper{mode: cfg.Drop}
	var transports []string // the FUSE transports the daemons used, for the notes
	for i, gr := range rep.Geometries {
		g := gr.Geometry
		run, err := newGeomRun(&cfg, g, dirs[i], drop, prog, rep.Settings.DaemonFlags)
		if err != nil {
			return rep, err
		}
		gr.ChunkRows, gr.ChunkPages = run.chunkRows, run.chunkPages
		for _, p := range paths {
			res, warm, err := run.run(ctx, p)
			if drop.fellBack != "" && !drop.noted {
				drop.noted = true
				note("could not drop the page cache (%s): dropped the files' caches with fadvise(DONTNEED) instead", drop.fellBack)
			}
			if err != nil {
				if ctx.Err() != nil {
					rep.finish(cfg.QueueDepth)
					return rep, ctx.Err()
				}
				// One path failing (a daemon crash, say) is a result too:
				// report it and measure the others.
				gr.Paths = append(gr.Paths, &PathResult{Path: p, Label: p.Label(), Failed: err.Error()})
				prog.printf("%s %s FAILED: %v", g.Name, p, err)
				first, _, _ := strings.Cut(err.Error(), "\n")
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s %s failed: %s (the whole error, with the daemon's log, is in the JSON report and was printed when it happened)", g.Name, p, first))
				continue
			}
			gr.Paths = append(gr.Paths, res)
			if d := res.Daemon; d != nil && d.FuseTransport != "" && !slices.Contains(transports, d.FuseTransport) {
				transports = append(transports, d.FuseTransport)
				note("FUSE requests reached the daemon through %s (fuse_transport)", d.FuseTransport)
			}
			if warm != nil {
				gr.Paths = append(gr.Paths, warm)
			}
		}
		for _, p := range cfg.Paths {
			if p.mounts() && !contains(paths, p) {
				gr.Paths = append(gr.Paths, &PathResult{Path: p, Label: p.Label(), Skipped: "no FUSE (needs root and /dev/fuse)"})
			}
		}
		if g.Name == GeometryBig && rep.ObjectStore == nil {
			if rep.ObjectStore, err = run.objectStore(ctx); err != nil {
				rep.finish(cfg.QueueDepth)
				return rep, err
			}
		}
	}
	if rep.ObjectStore == nil && !cfg.ObjectStore.Skip && !cfg.Serve.Only {
		rep.ObjectStore = &ObjectStoreReport{Skipped: "the big geometry was not measured"}
	}
	if !cfg.Serve.Skip {
		var err error
		rep.Serve, err = serveRun(ctx, &cfg, modelDirs, rep.Settings.DaemonFlags, drop, prog, note)
		if err != nil {
			rep.finish(cfg.QueueDepth)
			return rep, err
		}
	}
	if err := measureDisk("end"); err != nil {
		return rep, err
	}
	if busy1, total1, err := procfs.MachineCPU(); err == nil && cpuErr == nil && total1 > total0 {
		rep.Machine.Load = append(rep.Machine.Load, fmt.Sprintf("during the run: CPUs %.0f%% busy (%.0f of %.0f CPU-s), of which this bench and its daemons %.0f CPU-s",
			100*(busy1-busy0).Seconds()/(total1-total0).Seconds(), (busy1-busy0).Seconds(), (total1-total0).Seconds(), (ownCPU()-own0).Seconds()))
	}
	rep.finish(cfg.QueueDepth)
	return rep, nil
}

// loadNow is the load average and the CPU and I/O pressure (10 s averages).
func loadNow() string {
	s := "load average ?"
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			s = "load average " + strings.Join(f[:3], " ")
		}
	}
	for _, res := range []string{"cpu", "io"} {
		b, err := os.ReadFile("/proc/pressure/" + res)
		if err != nil {
			continue
		}
		line, _, _ := strings.Cut(string(b), "\n") // "some avg10=1.23 ..."
		if f := strings.Fields(line); len(f) >= 2 {
			s += fmt.Sprintf(", %s pressure %s", res, strings.TrimPrefix(f[1], "avg10="))
		}
	}
	return s + " (pressure: % of the last 10 s some task waited for it)"
}

func contains(ps []PathID, p PathID) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// daemonFlags builds the flags of `engramfs mount` from cfg, passing the
// optional ones only when the daemon lists them.
func daemonFlags(cfg *Config, note func(string, ...any)) ([]string, error) {
	known, err := DaemonFlags(cfg.Binary)
	if err != nil {
		return nil, err
	}
	flags := []string{"--queue-depth", strconv.Itoa(cfg.QueueDepth), "--backing-io", cfg.BackingIO}
	if cfg.PrefetchQueue > 0 {
		flags = append(flags, "--prefetch-queue", strconv.Itoa(cfg.PrefetchQueue))
	}
	if cfg.CacheSize != "" {
		if known["cache-size"] {
			flags = append(flags, "--cache-size", cfg.CacheSize)
		} else {
			note("this engramfs mount has no --cache-size (no hot tier yet): ran without it")
		}
	}
	// A choice between implementations goes to the daemon when it lists
	// the flag; an older daemon runs its only one (only), noted unless
	// that is what was asked for or auto.
	choice := func(name, value, only, without string) {
		switch {
		case value == "":
		case known[name]:
			flags = append(flags, "--"+name, value)
		case value != "auto" && value != only:
			note("this engramfs mount has no --%s: ran %s, not %s", name, without, value)
		}
	}
	choice("read-engine", cfg.ReadEngine, "auto", "with its only engine")
	choice("fuse-transport", cfg.FuseTransport, "dev", "on /dev/fuse")
	return flags, nil
}

// describeMachine names the CPUs, memory, kernel and the disk under dir.
func describeMachine(dir string) Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version()}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		m.MemBytes = int64(si.Totalram) * int64(si.Unit)
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	m.Disk = describeDisk(dir)
	return m
}

// describeDisk finds the mount holding dir (the longest mountpoint that is a
// prefix of it) and says its filesystem, device and the device's size.
func describeDisk(dir string) string {
	for dir != "/" {
		if _, err := os.Stat(dir); err == nil {
			break
		}
		dir = filepath.Dir(dir)
	}
	m, ok := mountOf(dir)
	if !ok {
		return "unknown disk"
	}
	desc := fmt.Sprintf("%s on %s", m.FSType, m.Source)
	if sz, err := os.ReadFile("/sys/class/block/" + filepath.Base(m.Source) + "/size"); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(sz)), 10, 64); err == nil {
			desc += fmt.Sprintf(" (%s)", fmtBytes(float64(n*512)))
		}
	}
	return desc
}

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/docker/go-units"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/bench"
)

func runBench(args []string) error {
	fl := newFlagSet("bench", "[flags]", `
Measures, in one run on the same data and the same disk, how engram rows are
gathered today and with engramfs:

  1  pread              the shards, FADV_RANDOM, a pool of 32 goroutines × 16 rows
  2  mmap               the shards mapped with MADV_RANDOM (decode: one thread;
                        prefill: 96 goroutines); 2' the same without MADV_RANDOM
  3  mmap+willneed      the engines' v3 path: as 2, after fadvise(WILLNEED) on
                        every row's range, then the gather on one thread
  4  engramfs           the mount's table files mapped as in 2, no hints
  4' engramfs+willneed  path 3's code on the mount's table files, no hints
  5  engramfs+hints     as 4, with a decode hint and barrier before each decode
                        step (the control handle's read barrier, or fsync on a
                        daemon without it), and each prefill chunk's hints sent
                        while the previous chunk computes (--compute)

against the disk's own limit (4 KiB O_DIRECT random reads at QD1, 32, 64) and,
when fio is on PATH, fio's CPU per 4 KiB random read (io_uring, QD64, O_DIRECT,
on a shard, --fio-time), on two geometries (4096/128-byte and 256/8-byte
rows). Each path runs from a cold page cache (dropped as root before each path
and phase). Decode: steps of 72 Zipf-popular rows per layer; prefill: chunks of
8192 tokens hashed to ~31K unique rows per layer. For the daemon's paths it
reports its CPU per 4 KiB backing page per phase and its read engine; then
the targets (each a ratio of two figures of this run, its bound, met or missed).

Then the serving loop (--serve runs it alone; --no-serve leaves it out):
requests of prefill chunks (the next chunk prefetched while this one computes)
and decode steps (rows known only at the step), served by 1 and 4 rank
processes (each its own rows and handles, in lockstep) on one mount, on ~3 GB
of tables (its own models) inside a memory cgroup of 1.25 GiB holding the
ranks and the daemon (--cache-size 512MiB), on four paths, each the same plan
from the same cold start: mmap (the shards, MADV_RANDOM), v3 on the shards
(fadvise(WILLNEED) per row then one gather; its prefetch pool of 32 threads
for the next chunk), v3 on the mount, engramfs+hints (a prefill hint for the
next chunk; a decode hint and barrier per step). Per path: decode p50/p99, the
step's floor (its cold reads as one burst of 4 KiB O_DIRECT reads, measured in
the same run), prefill chunk time, the block device's bytes and reads, cold
reads a decode step, backing bytes per distinct page, daemon CPU per page, the
hot tier's bytes, the cgroup's peak and refaults; and the serving targets.
bench/README.md, "The serving loop", says how and why it is fair.

The models (8.2 GiB each by default, 2.8 GiB each for the serving loop) are
generated once into --model-dir and kept (the report ends with their sizes;
--remove-models removes them). On a 2-CPU VM the full run takes several
minutes after generation (about 30 s per model) and the serving loop about 12
more; --quick a few (8 on a busy one, the serving loop 3 of them). Needs root and
/dev/fuse for paths 4, 4' and 5 (skipped otherwise). bench/README.md explains
every column and target.`)
	quick := fl.Bool("quick", false, "a short run (1.1 GiB models, fewer steps and chunks): a few minutes")
	cfg := bench.DefaultConfig()
	geometries := fl.String("geometry", "big,flash", "geometries to measure: big (4096+128-byte rows), flash (256+8-byte rows)")
	pathList := fl.String("paths", "", "paths to measure, comma-separated (default all): "+joinPaths())
	rows := fl.Uint64("rows", 0, "rows per table of the big geometry (default 1048576, --quick 131072)")
	flashRows := fl.Uint64("flash-rows", 0, "rows per table of the flash geometry (default 16777216, --quick 2097152)")
	layers := fl.Int("layers", 2, "engram layers")
	fl.StringVar(&cfg.ModelRoot, "model-dir", cfg.ModelRoot, "where generated models are kept between runs (one directory per geometry and row count; the report ends with their sizes)")
	removeModels := fl.Bool("remove-models", false, "remove the models generated under --model-dir (only directories holding nothing but a model's files) and exit")
	steps := fl.Int("steps", 0, "decode steps per path (default 300, --quick 100)")
	fl.IntVar(&cfg.Decode.RowsPerStep, "decode-rows", cfg.Decode.RowsPerStep, "row lookups per layer per decode step")
	fl.Float64Var(&cfg.Decode.S, "zipf", cfg.Decode.S, "Zipf exponent of decode row popularity")
	chunks := fl.Int("chunks", 0, "prefill chunks per path (default 6, --quick 2)")
	fl.IntVar(&cfg.Prefill.ChunkTokens, "chunk-tokens", cfg.Prefill.ChunkTokens, "tokens per prefill chunk")
	compute := fl.Duration("compute", 0, "compute time per prefill chunk, during which path 5 prefetches the next (default 1s, --quick 500ms)")
	diskTime := fl.Duration("disk-time", 0, "time per disk-limit measurement (default 3s, --quick 1s)")
	drop := fl.String("drop-caches", string(cfg.Drop), "how to make caches cold: system (drop_caches, root), files (fadvise DONTNEED on the files read), auto (system when possible)")
	fl.IntVar(&cfg.QueueDepth, "queue-depth", cfg.QueueDepth, "daemon: backing reads in flight (engramfs mount --queue-depth)")
	fl.StringVar(&cfg.BackingIO, "backing-io", cfg.BackingIO, "daemon: engramfs mount --backing-io")
	fl.IntVar(&cfg.PrefetchQueue, "prefetch-queue", 0, "daemon: engramfs mount --prefetch-queue (default: the daemon's)")
	fl.StringVar(&cfg.CacheSize, "cache-size", "", "daemon: engramfs mount --cache-size, when the daemon has it (default: the daemon's)")
	fl.StringVar(&cfg.ReadEngine, "read-engine", cfg.ReadEngine, "daemon: engramfs mount --read-engine auto|io_uring|pread, when the daemon has it")
	fl.StringVar(&cfg.FuseTransport, "fuse-transport", cfg.FuseTransport, "daemon: engramfs mount --fuse-transport dev|uring|auto, when the daemon has it (the one in use is in the notes and the JSON's fuse_transport)")
	fl.DurationVar(&cfg.FioRuntime, "fio-time", cfg.FioRuntime, "how long fio's 4 KiB random-read job (the CPU floor of a read) runs, whole seconds; 0 skips it")
	fl.IntVar(&cfg.DaemonGOMAXPROCS, "daemon-gomaxprocs", 0, "daemon: run it with GOMAXPROCS=N (default: unset; the daemon then runs with the CPU count + 2)")
	fl.BoolVar(&cfg.ObjectStore.Skip, "no-s3", false, "skip the object-store run (the big model in versitygw behind a first-byte latency proxy; skipped anyway without versitygw)")
	fl.DurationVar(&cfg.ObjectStore.FirstByte, "s3-first-byte", cfg.ObjectStore.FirstByte, "object-store run: the injected time to first byte")
	fl.DurationVar(&cfg.ObjectStore.SlowFirstByte, "s3-slow-first-byte", cfg.ObjectStore.SlowFirstByte, "object-store run: the time to first byte of the slow responses")
	fl.Float64Var(&cfg.ObjectStore.SlowFraction, "s3-slow-fraction", cfg.ObjectStore.SlowFraction, "object-store run: the fraction of responses that are slow")
	fl.IntVar(&cfg.ObjectStore.QueueDepth, "s3-queue-depth", cfg.ObjectStore.QueueDepth, "object-store run: the daemon's --queue-depth (GETs in flight)")
	fl.IntVar(&cfg.ObjectStore.PrefillRows, "s3-prefill-rows", cfg.ObjectStore.PrefillRows, "object-store run: rows per layer of the prefill chunk hinted ahead of its deadline (0: the whole chunk)")
	fl.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the tables and workloads")
	serveOnly := fl.Bool("serve", false, "run the serving loop alone (its models, the disk limit, fio's floor and the step floor; no paths 1-5, no object store)")
	fl.BoolVar(&cfg.Serve.Skip, "no-serve", false, "leave the serving loop out of the run")
	serveRows := fl.Uint64("serve-rows", 0, "serving loop: rows per table of its big model (default 360448: 3.0 GB of tables; --quick 131072)")
	serveFlashRows := fl.Uint64("serve-flash-rows", 0, "serving loop: rows per table of its flash model (default 5767168, as many bytes; --quick 2097152)")
	serveRanks := fl.String("serve-ranks", "1,4", "serving loop: rank process counts, each a run of its own (comma-separated)")
	servePaths := fl.String("serve-paths", "", "serving loop: paths, comma-separated (default mmap,mmap-willneed,engramfs-willneed,engramfs-hints; engramfs, the mount without hints, too)")
	serveLimit := fl.String("serve-mem-limit", "", "serving loop: the memory cgroup's limit over the ranks and the daemon, e.g. 1.25GiB; 0: no cgroup (default 1.25GiB, --quick 464MiB)")
	fl.StringVar(&cfg.Serve.CacheSize, "serve-cache-size", cfg.Serve.CacheSize, "serving loop: the daemon's --cache-size, its pinned hot tier inside the limit (--quick 192MiB)")
	fl.IntVar(&cfg.Serve.Spec.Requests, "serve-requests", cfg.Serve.Spec.Requests, "serving loop: requests (--quick 3)")
	fl.IntVar(&cfg.Serve.Spec.Chunks, "serve-chunks", cfg.Serve.Spec.Chunks, "serving loop: prefill chunks a request")
	fl.IntVar(&cfg.Serve.Spec.ChunkRows, "serve-chunk-rows", cfg.Serve.Spec.ChunkRows, "serving loop: unique rows a layer a prefill chunk")
	fl.Float64Var(&cfg.Serve.Spec.RareFraction, "serve-tail", cfg.Serve.Spec.RareFraction, "serving loop: fraction of a chunk's rows drawn from the far tail (rows no other chunk or step names; the Zipf-drawn rest has a tail of its own, and the report gives the share named once)")
	fl.IntVar(&cfg.Serve.Spec.Steps, "serve-steps", cfg.Serve.Spec.Steps, "serving loop: decode steps a request (--quick 16)")
	fl.DurationVar(&cfg.Serve.Compute, "serve-compute", cfg.Serve.Compute, "serving loop: compute a prefill chunk, during which the next chunk is prefetched")
	fl.DurationVar(&cfg.Serve.DecodeCompute, "serve-decode-compute", cfg.Serve.DecodeCompute, "serving loop: compute after each decode step")
	fl.BoolVar(&cfg.Serve.DecodePerLayer, "serve-decode-per-layer", cfg.Serve.DecodePerLayer, "serving loop: engramfs+hints sends a decode step's hints on a control handle per layer and reads each layer's barrier right before that layer's gather")
	fl.BoolVar(&cfg.Serve.PrefillGatherFirst, "serve-prefill-gather-first", false, "serving loop: engramfs+hints gathers each prefill chunk without waiting for its prefill hints (pages not pushed yet are faults that join their reads), then reads the prefill barrier for the counts")
	fl.BoolVar(&cfg.Serve.DecodeWrites, "serve-decode-writes", false, "serving loop: engramfs+hints sends each decode step's hints as a write a layer, then reads the barrier, instead of one step ioctl (the frames and the barrier in one request)")
	fl.BoolVar(&cfg.Serve.DecodeOverlap, "serve-decode-overlap", false, "serving loop: engramfs+hints gathers each decode step right after its hints, the barrier after the gather (its faults join the reads in flight)")
	engramfs := engramfsFlag(fl)
	jsonOut := fl.String("json", "", "also write the full report as JSON to `FILE`")
	plotOut := fl.String("plot", "", "also draw the results as a PNG chart to `FILE`")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 0 {
		return usagef("takes no arguments, got %q", fl.Args())
	}
	if *removeModels {
		removed, err := bench.RemoveModels(cfg.ModelRoot)
		for _, m := range removed {
			fmt.Printf("removed %s (%s)\n", m.Dir, units.BytesSize(float64(m.Bytes)))
		}
		if len(removed) == 0 && err == nil {
			fmt.Printf("no models under %s\n", cfg.ModelRoot)
		}
		return err
	}
	set := map[string]bool{}
	fl.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *quick {
		q := bench.QuickConfig()
		cfg.Geometries, cfg.Decode.Steps, cfg.Prefill.Chunks, cfg.Compute, cfg.DiskTime = q.Geometries, q.Decode.Steps, q.Prefill.Chunks, q.Compute, q.DiskTime
		cfg.Serve.Geometries, cfg.Serve.MemLimit, cfg.Serve.BurstRuns = q.Serve.Geometries, q.Serve.MemLimit, q.Serve.BurstRuns
		if !set["serve-requests"] {
			cfg.Serve.Spec.Requests = q.Serve.Spec.Requests
		}
		if !set["serve-steps"] {
			cfg.Serve.Spec.Steps = q.Serve.Spec.Steps
		}
		if !set["serve-cache-size"] {
			cfg.Serve.CacheSize = q.Serve.CacheSize
		}
	}
	cfg.Serve.Only = *serveOnly
	cfg.Serve.Spec.StepRows, cfg.Serve.Spec.S = cfg.Decode.RowsPerStep, cfg.Decode.S
	if *serveOnly && cfg.Serve.Skip {
		return usagef("--serve and --no-serve: nothing to run")
	}
	setIf := func(dst *int, v int) {
		if v != 0 {
			*dst = v
		}
	}
	setIf(&cfg.Decode.Steps, *steps)
	setIf(&cfg.Prefill.Chunks, *chunks)
	if *compute != 0 {
		cfg.Compute = *compute
	}
	if *diskTime != 0 {
		cfg.DiskTime = *diskTime
	}
	var err error
	if cfg.Geometries, err = parseGeometries(*geometries, *layers, cfg.Geometries, *rows, *flashRows); err != nil {
		return usageError{Err: err}
	}
	if cfg.Serve.Geometries, err = parseGeometries(*geometries, *layers, cfg.Serve.Geometries, *serveRows, *serveFlashRows); err != nil {
		return usageError{Err: err}
	}
	if *serveLimit != "" {
		if cfg.Serve.MemLimit, err = units.RAMInBytes(*serveLimit); err != nil || cfg.Serve.MemLimit < 0 {
			return usagef("--serve-mem-limit %q: want a size such as 1.25GiB, or 0", *serveLimit)
		}
	}
	if cfg.Serve.Ranks, err = parseInts(*serveRanks); err != nil {
		return usagef("--serve-ranks: %v", err)
	}
	if *servePaths != "" {
		cfg.Serve.Paths = nil
		for _, s := range strings.Split(*servePaths, ",") {
			p, err := bench.ParsePath(strings.TrimSpace(s))
			if err != nil || !slices.Contains(bench.ServePaths, p) {
				return usagef("--serve-paths: %q: want some of %v", s, bench.ServePaths)
			}
			cfg.Serve.Paths = append(cfg.Serve.Paths, p)
		}
	}
	if *pathList != "" {
		cfg.Paths = nil
		for _, s := range strings.Split(*pathList, ",") {
			p, err := bench.ParsePath(strings.TrimSpace(s))
			if err != nil {
				return usageError{Err: err}
			}
			cfg.Paths = append(cfg.Paths, p)
		}
	}
	if cfg.Drop, err = bench.ParseDropMode(*drop); err != nil {
		return usageError{Err: err}
	}
	if cfg.ReadEngine, err = bench.ParseReadEngine(cfg.ReadEngine); err != nil {
		return usageError{Err: fmt.Errorf("--read-engine: %w", err)}
	}
	if cfg.Binary, err = findEngramfs(*engramfs); err != nil {
		return err
	}
	cfg.Progress, cfg.ProgressTTY = os.Stderr, isTerminal(os.Stderr)
	_, err = runAndReport(cfg, *jsonOut, *plotOut)
	return err
}

// runAndReport runs cfg until done or interrupted (SIGINT/SIGTERM: every
// mount is stopped and removed before returning), then prints the table and
// writes the JSON and plot.
func runAndReport(cfg bench.Config, jsonOut, plotOut string) (*bench.Report, error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	rep, err := bench.Run(ctx, cfg)
	if ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "interrupted: stopped the daemon and removed its mount")
		if rep != nil && len(rep.Geometries) > 0 {
			fmt.Fprintln(os.Stderr, "measured before the interrupt:")
			rep.WriteTable(os.Stderr)
		}
		return nil, errors.New("interrupted")
	}
	if err != nil {
		return nil, err
	}
	rep.WriteTable(os.Stdout)
	fmt.Printf("total %v\n", rep.Elapsed.Round(time.Second))
	if jsonOut != "" {
		if err := rep.WriteJSON(jsonOut); err != nil {
			return nil, err
		}
	}
	if plotOut != "" {
		if err := rep.Plot(plotOut); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

func parseGeometries(list string, layers int, defaults []bench.Geometry, rows, flashRows uint64) ([]bench.Geometry, error) {
	def := map[string]uint64{}
	for _, g := range defaults {
		def[g.Name] = g.Rows
	}
	if rows != 0 {
		def[bench.GeometryBig] = rows
	}
	if flashRows != 0 {
		def[bench.GeometryFlash] = flashRows
	}
	var out []bench.Geometry
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		g, err := bench.NewGeometry(name, layers, def[name])
		if err != nil {
			return nil, fmt.Errorf("--geometry: %w", err)
		}
		out = append(out, g)
	}
	return out, nil
}

func parseInts(list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

func joinPaths() string {
	var s []string
	for _, p := range bench.AllPaths {
		s = append(s, string(p))
	}
	return strings.Join(s, ", ")
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

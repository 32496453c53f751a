package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

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

The models (8.2 GiB each by default) are generated once into --model-dir and
reused. On a 2-CPU VM the full run takes several minutes after generation
(about 30 s per model); --quick a few (5 on a busy one). Needs root and
/dev/fuse for paths 4, 4' and 5 (skipped otherwise). bench/README.md explains
every column and target.`)
	quick := fl.Bool("quick", false, "a short run (1.1 GiB models, fewer steps and chunks): a few minutes")
	cfg := bench.DefaultConfig()
	geometries := fl.String("geometry", "big,flash", "geometries to measure: big (4096+128-byte rows), flash (256+8-byte rows)")
	pathList := fl.String("paths", "", "paths to measure, comma-separated (default all): "+joinPaths())
	rows := fl.Uint64("rows", 0, "rows per table of the big geometry (default 1048576, --quick 131072)")
	flashRows := fl.Uint64("flash-rows", 0, "rows per table of the flash geometry (default 16777216, --quick 2097152)")
	layers := fl.Int("layers", 2, "engram layers")
	fl.StringVar(&cfg.ModelRoot, "model-dir", cfg.ModelRoot, "where generated models are kept between runs (one directory per geometry and row count)")
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
	fl.DurationVar(&cfg.FioRuntime, "fio-time", cfg.FioRuntime, "how long fio's 4 KiB random-read job (the CPU floor of a read) runs, whole seconds; 0 skips it")
	fl.IntVar(&cfg.DaemonGOMAXPROCS, "daemon-gomaxprocs", 0, "daemon: run it with GOMAXPROCS=N (default: unset; the daemon then runs with the CPU count + 2)")
	fl.BoolVar(&cfg.ObjectStore.Skip, "no-s3", false, "skip the object-store run (the big model in versitygw behind a first-byte latency proxy; skipped anyway without versitygw)")
	fl.DurationVar(&cfg.ObjectStore.FirstByte, "s3-first-byte", cfg.ObjectStore.FirstByte, "object-store run: the injected time to first byte")
	fl.DurationVar(&cfg.ObjectStore.SlowFirstByte, "s3-slow-first-byte", cfg.ObjectStore.SlowFirstByte, "object-store run: the time to first byte of the slow responses")
	fl.Float64Var(&cfg.ObjectStore.SlowFraction, "s3-slow-fraction", cfg.ObjectStore.SlowFraction, "object-store run: the fraction of responses that are slow")
	fl.IntVar(&cfg.ObjectStore.QueueDepth, "s3-queue-depth", cfg.ObjectStore.QueueDepth, "object-store run: the daemon's --queue-depth (GETs in flight)")
	fl.IntVar(&cfg.ObjectStore.PrefillRows, "s3-prefill-rows", cfg.ObjectStore.PrefillRows, "object-store run: rows per layer of the prefill chunk hinted ahead of its deadline (0: the whole chunk)")
	fl.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the tables and workloads")
	engramfs := engramfsFlag(fl)
	jsonOut := fl.String("json", "", "also write the full report as JSON to `FILE`")
	plotOut := fl.String("plot", "", "also draw the results as a PNG chart to `FILE`")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 0 {
		return usagef("takes no arguments, got %q", fl.Args())
	}
	if *quick {
		q := bench.QuickConfig()
		cfg.Geometries, cfg.Decode.Steps, cfg.Prefill.Chunks, cfg.Compute, cfg.DiskTime = q.Geometries, q.Decode.Steps, q.Prefill.Chunks, q.Compute, q.DiskTime
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
	return runAndReport(cfg, *jsonOut, *plotOut)
}

// runAndReport runs cfg until done or interrupted (SIGINT/SIGTERM: every
// mount is stopped and removed before returning), then prints the table and
// writes the JSON and plot.
func runAndReport(cfg bench.Config, jsonOut, plotOut string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	rep, err := bench.Run(ctx, cfg)
	if ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "interrupted: stopped the daemon and removed its mount")
		if rep != nil && len(rep.Geometries) > 0 {
			fmt.Fprintln(os.Stderr, "measured before the interrupt:")
			rep.WriteTable(os.Stderr)
		}
		return errors.New("interrupted")
	}
	if err != nil {
		return err
	}
	rep.WriteTable(os.Stdout)
	fmt.Printf("total %v\n", rep.Elapsed.Round(time.Second))
	if jsonOut != "" {
		if err := rep.WriteJSON(jsonOut); err != nil {
			return err
		}
	}
	if plotOut != "" {
		if err := rep.Plot(plotOut); err != nil {
			return err
		}
	}
	return nil
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

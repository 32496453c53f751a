package main

import (
	"fmt"
	"os"
	"time"

	"github.com/engramfs/engramfs/bench"
	"github.com/engramfs/engramfs/internal/daemonproc"
)

func runDemo(args []string) error {
	fl := newFlagSet("demo", "[flags]", `
Generates a small synthetic model (2 engram layers of 65536 rows of 4096 +
128 bytes, 528 MiB) in a temporary directory, mounts it with engramfs, and
compares gathering its rows by mmap of the shard files (what engines do
today), through the mount, and through the mount with hints: a short decode
(100 steps of 72 Zipf-popular rows a layer, one thread) and prefill (two
4096-token chunks, 1 s of compute each) run each, from a cold page cache.
Prints the table and, last, the result in one line; unmounts and removes
everything, in under a minute. Needs root and /dev/fuse (engramfs mounts
FUSE directly).

'engramfs bench' is the full comparison (every path, both row geometries,
tables large enough to be cold, the disk's limit).`)
	keep := fl.Bool("keep", false, "keep the temporary model directory (its path is printed)")
	plotOut := fl.String("plot", "", "also draw the results as a PNG chart to `FILE`")
	engramfs := engramfsFlag(fl)
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 0 {
		return usagef("takes no arguments, got %q", fl.Args())
	}
	bin, err := findEngramfs(*engramfs)
	if err != nil {
		return err
	}
	if err := daemonproc.CanMount(); err != nil {
		return fmt.Errorf(`needs root and /dev/fuse to mount engramfs: %v.
Run it as root (sudo engramfs demo) on a machine whose kernel has FUSE
(modprobe fuse; in a container: --device /dev/fuse --cap-add SYS_ADMIN)`, err)
	}
	dir, err := os.MkdirTemp("", "engramfs-demo-")
	if err != nil {
		return err
	}
	if *keep {
		fmt.Fprintf(os.Stderr, "model directory: %s (kept)\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}

	cfg := bench.DefaultConfig()
	g, err := bench.NewGeometry(bench.GeometryBig, 2, 64<<10)
	if err != nil {
		return err
	}
	cfg.Geometries = []bench.Geometry{g}
	cfg.Paths = []bench.PathID{bench.PathMmap, bench.PathEngramfs, bench.PathHints}
	cfg.ModelRoot, cfg.TemporaryModels = dir, !*keep
	cfg.Decode.Steps = 100
	cfg.Prefill.Chunks = 2
	cfg.Prefill.ChunkTokens = 4096
	cfg.Compute = time.Second
	cfg.DiskTime = 500 * time.Millisecond
	cfg.DiskQDs = []int{cfg.QueueDepth}
	cfg.FioRuntime = 0 // no fio floor: the demo stays short
	cfg.Serve.Skip = true
	// Only the demo's own files: a demo must not empty the machine's page cache.
	cfg.Drop = bench.DropFiles
	cfg.Binary = bin
	cfg.Progress, cfg.ProgressTTY = os.Stderr, isTerminal(os.Stderr)
	rep, err := runAndReport(cfg, "", *plotOut)
	if err != nil {
		return err
	}
	fmt.Println("\n'engramfs bench --quick' compares every path on both row geometries; 'engramfs bench' is the full run.")
	// The result last, where the eye lands when the demo ends.
	if h := rep.Headline(); h != "" {
		fmt.Printf("\nresult: %s\n", h)
	}
	return nil
}

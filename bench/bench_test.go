package bench

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/testenv"
)

// tinyConfig is a whole bench run small enough for a test: 8 and 4 MiB
// models, a few steps and one short chunk, caches dropped per file (a test
// must not empty the machine's page cache).
func tinyConfig(t *testing.T) Config {
	t.Helper()
	big, _ := NewGeometry(GeometryBig, 2, 1024)
	flash, _ := NewGeometry(GeometryFlash, 2, 8192)
	c := DefaultConfig()
	c.Binary = testenv.Binary(t)
	c.ModelRoot = t.TempDir()
	c.MountDir = testenv.PrivateTempDir(t)
	c.Geometries = []Geometry{big, flash}
	c.Decode.Steps = 8
	c.Prefill = DefaultPrefill(2)
	c.Prefill.ChunkTokens = 512
	c.Compute = 50 * time.Millisecond
	c.DiskTime = 100 * time.Millisecond
	c.DiskQDs = []int{4}
	c.FioRuntime = time.Second // when fio is on PATH
	c.QueueDepth = 4
	c.MmapWorkers = 8
	c.PreadWorkers = 4
	c.Drop = DropFiles
	c.ObjectStore.Skip = true // TestObjectStoreRunTiny runs it
	c.Serve.Skip = true       // TestServeTiny runs it
	return c
}

// noMountsLeft fails t if anything is still mounted under dir (the run's
// MountDir, a directory of this test's own: other runs' mounts do not
// count), or a mountpoint is left there.
func noMountsLeft(t *testing.T, dir string) {
	t.Helper()
	left, err := procfs.MountsUnder(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, mp := range left {
		t.Errorf("left mounted: %s", mp)
	}
	if ents, err := os.ReadDir(dir); err != nil || len(ents) > 0 {
		t.Errorf("mountpoints left behind in %s: %v %v", dir, ents, err)
	}
}

// runTiny runs cfg, failing t with the progress lines on an error, and
// checks that nothing is left mounted.
func runTiny(t *testing.T, cfg Config) *Report {
	t.Helper()
	var progress bytes.Buffer
	cfg.Progress = &progress
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("%v\nprogress:\n%s", err, progress.String())
	}
	noMountsLeft(t, cfg.MountDir)
	return rep
}

// TestRunTiny runs every path on both geometries against a real mount and
// checks that each measured what it claims: rows gathered (and verified
// against the model's bytes), backing I/O seen, hints taken, the daemon's
// CPU and memory read, and nothing left mounted.
func TestRunTiny(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyConfig(t)
	rep := runTiny(t, cfg)
	if len(rep.Geometries) != 2 || len(rep.DiskRuns) != 2 || rep.Disk.QD1.N == 0 || rep.Disk.IOPS[4] <= 0 {
		t.Fatalf("report lacks geometries or the disk limit: %+v", rep)
	}
	for _, g := range rep.Geometries {
		if len(g.Paths) != len(AllPaths)+1 {
			t.Errorf("%s: %d path results, want %d (every path and the warm reference)", g.Geometry.Name, len(g.Paths), len(AllPaths)+1)
		}
		for _, p := range g.Paths {
			if p.Skipped != "" {
				t.Errorf("%s %s skipped: %s", g.Geometry.Name, p.Path, p.Skipped)
				continue
			}
			for name, ph := range map[string]*Phase{"decode": p.Decode, "prefill": p.Prefill} {
				if ph == nil || ph.Times.N == 0 || ph.Rows == 0 {
					t.Errorf("%s %s %s: nothing measured", g.Geometry.Name, p.Path, name)
					continue
				}
				// Every measured path read its rows from backing at least once
				// (the tables are dropped before each phase); the warm one never.
				if p.Path != PathWarm && ph.BackingBytes == 0 {
					t.Errorf("%s %s %s: no backing I/O seen from cold caches (%s)", g.Geometry.Name, p.Path, name, ph.BackingFrom)
				}
			}
			if p.Path.mounts() {
				if p.Daemon == nil || p.Daemon.CPU <= 0 || p.Daemon.Mem.HWM <= 0 {
					t.Errorf("%s %s: daemon usage not measured: %+v", g.Geometry.Name, p.Path, p.Daemon)
				}
				if p.Decode.Stats == nil || p.Prefill.Stats == nil {
					t.Fatalf("%s %s: no .engramfs/stats deltas", g.Geometry.Name, p.Path)
				}
				if p.Decode.DaemonCPUPerPage <= 0 && p.Decode.DaemonCPU > 0 || p.Prefill.DaemonCPUPerPage <= 0 && p.Prefill.DaemonCPU > 0 {
					t.Errorf("%s %s: daemon CPU a backing page not computed: decode %v, prefill %v", g.Geometry.Name, p.Path, p.Decode.DaemonCPUPerPage, p.Prefill.DaemonCPUPerPage)
				}
				if p.Daemon.ReadEngine == "" {
					t.Errorf("%s %s: no read engine", g.Geometry.Name, p.Path)
				}
				if p.Daemon.FuseTransport == "" {
					t.Errorf("%s %s: no FUSE transport", g.Geometry.Name, p.Path)
				}
			}
		}
		eng, engWill, hints := g.path(PathEngramfs), g.path(PathEngramfsWillneed), g.path(PathHints)
		if engWill.Decode.Stats.FuseReads == 0 || engWill.Decode.Stats.HintFrames != 0 {
			t.Errorf("%s engramfs+willneed: %d FUSE reads and %d hint frames, want reads and no hints", g.Geometry.Name, engWill.Decode.Stats.FuseReads, engWill.Decode.Stats.HintFrames)
		}
		for _, ph := range []*Phase{hints.Decode, hints.Prefill} {
			if ph.Barrier != BarrierRead && ph.Barrier != BarrierFsync || ph.BarrierHow == "" {
				t.Errorf("%s engramfs+hints: barrier %q (%q)", g.Geometry.Name, ph.Barrier, ph.BarrierHow)
			}
		}
		if eng.Decode.Stats.FuseReads == 0 || eng.Decode.Stats.HintFrames != 0 {
			t.Errorf("%s engramfs: %d FUSE reads and %d hint frames, want faults and no hints", g.Geometry.Name, eng.Decode.Stats.FuseReads, eng.Decode.Stats.HintFrames)
		}
		// 2 layers a step, plus the split of nothing: one frame per layer.
		if got := hints.Decode.Stats.HintFrames; got != uint64(2*cfg.Decode.Steps) {
			t.Errorf("%s engramfs+hints decode: %d hint frames, want %d", g.Geometry.Name, got, 2*cfg.Decode.Steps)
		}
		if hints.Decode.Hint == nil || hints.Decode.Hint.N != cfg.Decode.Steps {
			t.Errorf("%s engramfs+hints decode: hint and barrier not timed per step", g.Geometry.Name)
		}
		pf := hints.Prefill.Prefetch
		if pf == nil || pf.Times.N != cfg.Prefill.Chunks || pf.Pages == 0 || pf.Failed != 0 {
			t.Errorf("%s engramfs+hints prefill: prefetch %+v, want %d chunks of stored pages, none failed", g.Geometry.Name, pf, cfg.Prefill.Chunks)
		}
		// The chunk prefetched alone has rows no other phase read: every
		// one needs a page read, and each read stores its page.
		// (CPU time comes in 10 ms ticks: a tiny phase may count none.)
		if a := hints.PrefetchAlone; a == nil || a.Prefetch == nil || a.Prefetch.Pages == 0 || a.Prefetch.Reads == 0 || a.Prefetch.PagesPerSec <= 0 ||
			a.Stats == nil || a.Stats.HintFrames == 0 || a.DaemonCPU > 0 && a.DaemonCPUPerPage <= 0 {
			t.Errorf("%s engramfs+hints: prefetch alone %+v, want stored pages, their reads and the daemon's CPU a page", g.Geometry.Name, a)
		}
	}
	if len(rep.Targets) == 0 {
		t.Error("no target judged")
	}
	if rep.Fio == nil || rep.Fio.Missing == "" && rep.Fio.CPUPerRead <= 0 {
		t.Errorf("fio floor: %+v, want figures or why there are none", rep.Fio)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	if !strings.Contains(table.String(), "5 engramfs+hints") {
		t.Errorf("table:\n%s", table.String())
	}
	if err := rep.Plot(filepath.Join(t.TempDir(), "p.png")); err != nil {
		t.Error(err)
	}

	// A second run reuses the models.
	cfg.Paths = []PathID{PathMmap}
	cfg.Geometries = cfg.Geometries[:1]
	rep2, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep2.Geometries[0].Generated != 0 {
		t.Error("the second run generated the model again")
	}
}

// cancelOn cancels when a progress line contains a string.
type cancelOn struct {
	mu     sync.Mutex
	when   string
	cancel func()
	buf    bytes.Buffer
}

func (c *cancelOn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.buf.Write(p)
	if strings.Contains(c.buf.String(), c.when) {
		c.cancel()
	}
	return len(p), nil
}

// TestRunInterrupted cancels a run while a daemon is mounted (what Ctrl-C
// does): Run must return promptly with the cancellation, the mount gone.
func TestRunInterrupted(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyConfig(t)
	cfg.Geometries = cfg.Geometries[:1]
	cfg.Paths = []PathID{PathHints}
	cfg.Compute = 10 * time.Second // the cancel lands in the compute sleep, or in a step
	runCanceled(t, cfg, PathHints.Label()+": prefill", cfg.Compute)
}

// runCanceled runs cfg and cancels it once a progress line says when, in
// or before a compute of sleep: Run must return the cancellation well
// before that sleep is over, with nothing left mounted.
func runCanceled(t *testing.T, cfg Config, when string, sleep time.Duration) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg.Progress = &cancelOn{when: when, cancel: cancel}
	start := time.Now()
	_, err := Run(ctx, cfg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want the cancellation", err)
	}
	if d := time.Since(start); d > sleep*9/10 {
		t.Errorf("Run took %v to notice the cancellation", d)
	}
	noMountsLeft(t, cfg.MountDir)
}

// TestDaemonFailsToMount: a daemon that cannot mount (no such model) is an
// error that says why, with nothing left behind.
func TestDaemonFailsToMount(t *testing.T) {
	testenv.RequireFUSE(t)
	dir := testenv.PrivateTempDir(t)
	_, err := startDaemon(context.Background(), testenv.Binary(t), dir, nil, nil, filepath.Join(t.TempDir(), "no-model"))
	if err == nil || !strings.Contains(err.Error(), "exited before mounting") || !strings.Contains(err.Error(), "no-model") {
		t.Fatalf("got %v, want an error naming the missing model", err)
	}
	noMountsLeft(t, dir)
}

// TestRunGoesOnAfterAPathFails: a daemon that dies is reported as that
// path's failure, with its output, and the other paths are still measured.
func TestRunGoesOnAfterAPathFails(t *testing.T) {
	testenv.RequireFUSE(t)
	cfg := tinyConfig(t)
	cfg.Geometries = cfg.Geometries[:1]
	cfg.Paths = []PathID{PathEngramfs, PathMmap}
	// A "daemon" that lists the flags the bench looks for, then dies.
	cfg.Binary = filepath.Join(t.TempDir(), "engramfs")
	script := "#!/bin/sh\nif [ \"$2\" = --help ]; then echo '  -queue-depth int'; exit 0; fi\necho 'fatal error: out of luck' >&2\nexit 2\n"
	if err := os.WriteFile(cfg.Binary, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	g := rep.Geometries[0]
	if len(g.Paths) != 2 || g.Paths[0].Failed == "" || !strings.Contains(g.Paths[0].Failed, "out of luck") {
		t.Fatalf("engramfs path: %+v, want it failed with the daemon's output", g.Paths[0])
	}
	if g.path(PathMmap) == nil || g.path(PathEngramfs) != nil {
		t.Error("the failed path counts as measured, or mmap was not measured after it")
	}
	var b bytes.Buffer
	rep.WriteTable(&b)
	if !strings.Contains(b.String(), "FAILED") {
		t.Errorf("table hides the failure:\n%s", b.String())
	}
	noMountsLeft(t, cfg.MountDir)
}

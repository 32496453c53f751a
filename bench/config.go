package bench

import (
	"fmt"
	"github.com/engramfs/engramfs/fs/uring"
	"io"
	"slices"
	"time"
)

// PathID names a way of gathering rows.
type PathID string

// The gather paths, in report order.
const (
	PathPread            PathID = "pread"             // 1: shards, FADV_RANDOM, a pool of preads
	PathMmap             PathID = "mmap"              // 2: shards mapped with MADV_RANDOM
	PathMmapRA           PathID = "mmap-readahead"    // 2': shards mapped without MADV_RANDOM (kernel readahead)
	PathMmapWillneed     PathID = "mmap-willneed"     // 3: as 2, after fadvise(WILLNEED) on every row (the engines' v3 path)
	PathEngramfs         PathID = "engramfs"          // 4: the mount's table files mapped as in 2, no hints
	PathEngramfsWillneed PathID = "engramfs-willneed" // 4': path 3's code on the mount's table files, no hints
	PathHints            PathID = "engramfs-hints"    // 5: as 4, with decode and prefill hints
	PathWarm             PathID = "warm"              // reference: path 4's gather again through a fresh mapping, every row in the page cache
)

// AllPaths is every measured path, in report order (the warm reference is
// measured inside PathEngramfs).
var AllPaths = []PathID{PathPread, PathMmap, PathMmapRA, PathMmapWillneed, PathEngramfs, PathEngramfsWillneed, PathHints}

// Label is the path's name in tables: its number (bench/README.md) and what it does.
func (p PathID) Label() string {
	switch p {
	case PathPread:
		return "1 pread"
	case PathMmap:
		return "2 mmap"
	case PathMmapRA:
		return "2' mmap, readahead"
	case PathMmapWillneed:
		return "3 mmap+willneed"
	case PathEngramfs:
		return "4 engramfs"
	case PathEngramfsWillneed:
		return "4' engramfs+willneed"
	case PathHints:
		return "5 engramfs+hints"
	case PathWarm:
		return "  warm page cache"
	}
	return string(p)
}

// mounts reports whether the path reads through an engramfs mount.
func (p PathID) mounts() bool {
	return p == PathEngramfs || p == PathEngramfsWillneed || p == PathHints
}

// willneed reports whether the path is the engines' v3 code: fadvise(WILLNEED)
// on every row's range, then the gather on one thread (path 3 on the shards,
// path 4' on the mount).
func (p PathID) willneed() bool { return p == PathMmapWillneed || p == PathEngramfsWillneed }

// ParsePath checks a path name.
func ParsePath(s string) (PathID, error) {
	for _, p := range AllPaths {
		if string(p) == s {
			return p, nil
		}
	}
	return "", fmt.Errorf("path %q: want one of %v", s, AllPaths)
}

// Config is one bench run. Every field's default is in DefaultConfig.
type Config struct {
	// Binary is the engramfs executable the daemon runs from (`Binary mount`).
	Binary string
	// MountDir is where the daemon's mountpoints are made, one per mounted
	// path, each removed when the path is done (default: empty, the
	// system's temporary directory).
	MountDir string
	// ModelRoot holds the generated models, one directory per geometry and
	// row count (<ModelRoot>/<geometry>-<rows>), kept between runs (the
	// report says where and how big, and how to remove them: RemoveModels)
	// unless TemporaryModels: the caller removes ModelRoot itself.
	ModelRoot       string
	TemporaryModels bool
	// Geometries are measured in order.
	Geometries []Geometry
	// Paths are measured in order, for every geometry.
	Paths []PathID
	// Seed of the table bytes and of the workloads.
	Seed uint64

	Decode  DecodeSpec
	Prefill PrefillSpec
	// Compute is how long a prefill chunk "computes" after its gather; path 5
	// sends the next chunk's hints meanwhile. The other paths do not hint,
	// so they skip it.
	Compute time.Duration

	PreadWorkers  int // path 1's pool (32)
	PreadTaskRows int // rows per task of path 1's pool, and of the mmap pools (16)
	MmapWorkers   int // prefill pool of paths 2, 4 and 5 (96)

	// DiskTime is how long each point of the disk limit (QD1, 32, 64) runs.
	DiskTime time.Duration
	// DiskQDs are the queue depths whose IOPS are measured (32 and 64).
	DiskQDs []int

	// Drop is how caches are made cold before each path and phase.
	Drop DropMode

	// FioRuntime is how long fio's 4 KiB random-read job (the CPU floor of
	// a read) runs, once at the start; 0 skips it. fio must be on PATH.
	FioRuntime time.Duration

	// Daemon flags: passed to `engramfs mount` (CacheSize only when the
	// daemon lists --cache-size, and when not empty; ReadEngine only when
	// it lists --read-engine).
	QueueDepth    int
	BackingIO     string
	PrefetchQueue int // 0: the daemon's default
	CacheSize     string
	ReadEngine    string // auto, io_uring or pread
	FuseTransport string // auto, uring or dev (--fuse-transport, when the daemon lists it)
	// ObjectStore is the object-store run on the big geometry.
	ObjectStore ObjectStoreConfig
	// Serve is the serving loop: requests served by rank processes under a
	// memory limit, on models of its own.
	Serve ServeConfig

	// DaemonGOMAXPROCS, if > 0, runs the daemon with GOMAXPROCS set to it
	// (an experiment: the daemon's blocking preads and FUSE reads each hold
	// one of GOMAXPROCS Ps until the runtime hands it off).
	DaemonGOMAXPROCS int

	// Progress receives the live progress line (nil: none). ProgressTTY
	// updates one line in place; otherwise a line is printed per phase.
	Progress    io.Writer
	ProgressTTY bool
}

// DefaultConfig is the full run: both geometries at 8.2 GiB each, so the
// rows a run touches are nearly all distinct and cold.
func DefaultConfig() Config {
	big, _ := NewGeometry(GeometryBig, 2, 1<<20)
	flash, _ := NewGeometry(GeometryFlash, 2, 16<<20)
	return Config{
		ModelRoot:     "/var/tmp/engramfs-bench",
		Geometries:    []Geometry{big, flash},
		Paths:         AllPaths,
		Seed:          1,
		Decode:        DecodeSpec{Steps: 300, RowsPerStep: 72, S: 0.9},
		Prefill:       DefaultPrefill(6),
		Compute:       time.Second,
		PreadWorkers:  32,
		PreadTaskRows: 16,
		MmapWorkers:   96,
		DiskTime:      3 * time.Second,
		DiskQDs:       []int{32, 64},
		FioRuntime:    5 * time.Second,
		Drop:          DropAuto,
		QueueDepth:    64,
		BackingIO:     "auto",
		ReadEngine:    "auto",
		FuseTransport: "dev",
		ObjectStore:   DefaultObjectStore(),
		Serve:         DefaultServe(),
	}
}

// QuickConfig is a run of well under two minutes, generation included:
// 1.1 GiB per geometry, fewer steps and chunks, shorter compute.
func QuickConfig() Config {
	c := DefaultConfig()
	big, _ := NewGeometry(GeometryBig, 2, 128<<10)
	flash, _ := NewGeometry(GeometryFlash, 2, 2<<20)
	c.Geometries = []Geometry{big, flash}
	c.Decode.Steps = 100
	c.Prefill.Chunks = 2
	c.Compute = 500 * time.Millisecond
	c.DiskTime = time.Second
	c.Serve = QuickServe()
	return c
}

func (c *Config) check() error {
	switch {
	case c.Binary == "" && c.needsMount():
		return fmt.Errorf("bench: no engramfs binary for the daemon")
	case !c.Serve.Only && (len(c.Geometries) == 0 || len(c.Paths) == 0):
		return fmt.Errorf("bench: nothing to measure")
	case c.Serve.Only && c.Serve.Skip:
		return fmt.Errorf("bench: the serving loop alone, and skipped")
	case c.Decode.Steps < 1 || c.Decode.RowsPerStep < 1 || c.Decode.S <= 0:
		return fmt.Errorf("bench: decode needs steps >= 1, rows per step >= 1, Zipf s > 0")
	case c.Prefill.Chunks < 1 || c.Prefill.ChunkTokens < 1 || len(c.Prefill.Orders) == 0 || c.Prefill.Heads < 1:
		return fmt.Errorf("bench: prefill needs chunks >= 1, tokens >= 1, n-gram orders and heads")
	case c.PreadWorkers < 1 || c.PreadTaskRows < 1 || c.MmapWorkers < 1:
		return fmt.Errorf("bench: worker pools need at least one worker and one row a task")
	case c.DiskTime <= 0:
		return fmt.Errorf("bench: disk time must be positive")
	}
	if _, err := ParseReadEngine(c.ReadEngine); err != nil {
		return err
	}
	if c.FuseTransport != "" {
		if _, err := uring.ParseMode(c.FuseTransport); err != nil {
			return err
		}
	}
	return c.Serve.check()
}

func (c *Config) needsMount() bool {
	if !c.Serve.Skip && c.Serve.needsMount() {
		return true
	}
	return !c.Serve.Only && slices.ContainsFunc(c.Paths, PathID.mounts)
}

// ReadEngines are the values of the daemon's --read-engine.
var ReadEngines = []string{"auto", "io_uring", "pread"}

// ParseReadEngine checks a --read-engine value ("" is auto).
func ParseReadEngine(s string) (string, error) {
	if s == "" {
		return "auto", nil
	}
	for _, e := range ReadEngines {
		if s == e {
			return s, nil
		}
	}
	return "", fmt.Errorf("read engine %q: want one of %v", s, ReadEngines)
}

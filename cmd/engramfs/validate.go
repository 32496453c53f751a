package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	units "github.com/docker/go-units"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/procfs"
)

// Mistakes in the flags of a mount, caught before anything is built or
// mounted, with a message (issue 22): each of these was accepted silently
// and showed only later, or never.

// checkMountFlags checks the flags of engramfs mount that fl parsed into
// mf (checkMountValues), and prepares the state file's directory.
func checkMountFlags(fl *flag.FlagSet, mf *mountFlags) error {
	if err := checkMountValues(fl, mf); err != nil {
		return err
	}
	if mf.stateFile != "" {
		return prepareStateDir(mf.stateFile)
	}
	return nil
}

// checkMountValues checks the counts and sizes among the flags fl parsed
// into mf, with no side effect (the mount(8) helper checks them before it
// starts the daemon); the flags fl saw set are the ones given, which a
// default of 0 (--queue-depth: the default for the source) cannot tell
// apart otherwise.
func checkMountValues(fl *flag.FlagSet, mf *mountFlags) error {
	given := map[string]bool{}
	fl.Visit(func(f *flag.Flag) { given[f.Name] = true })
	// Counts: 0 was replaced by the default, silently (--queue-depth=0).
	counts := []struct {
		name     string
		v, least int
	}{
		{"queue-depth", mf.queueDepth, 1},
		{"prefetch-queue", mf.prefillQueue, 1},
		{"decode-queue", mf.decodeQueue, cache.MaxRunPages}, // one run's pages: a frame of one row needs them
	}
	for _, c := range counts {
		if given[c.name] && c.v < c.least {
			return usagef("--%s %d: want at least %d", c.name, c.v, c.least)
		}
	}
	if mf.monitorSlack < 0 || mf.monitorSlack > time.Second {
		return usagef("--monitor-slack %v: want 0 (off) to 1s", mf.monitorSlack)
	}
	// Sizes: "4" was 4 bytes, which turned the tier off.
	for _, s := range []struct{ name, v string }{
		{"cache-size", mf.cacheSize}, {"s3-mirror-size", mf.s3MirrorSize}, {"s3-fill-rate", mf.s3FillRate},
	} {
		if s.v == "" {
			continue
		}
		if _, err := parseSize(s.v); err != nil {
			return usagef("--%s %q: %v", s.name, s.v, err)
		}
	}
	return nil
}

// parseSize parses a size such as 512MiB, 4G or 100k (docker/go-units,
// binary multiples), and refuses a number without a unit, except 0: 4 is
// more likely 4G with the unit forgotten than 4 bytes. "4b" says bytes.
func parseSize(v string) (int64, error) {
	v = strings.TrimSpace(v)
	n, err := units.RAMInBytes(v)
	switch {
	case strings.HasPrefix(v, "-"):
		return 0, errors.New("a size cannot be negative")
	case err != nil:
		return 0, errors.New("want a size such as 512MiB or 4G, or 0")
	case n < 0:
		return 0, errors.New("a size cannot be negative")
	case n != 0 && v[len(v)-1] >= '0' && v[len(v)-1] <= '9':
		return 0, fmt.Errorf("a size needs a unit: %sMiB? %sGiB? (0 alone needs none)", v, v)
	}
	return n, nil
}

// defaultStateDir is where the documented --state-file lives
// (deploy/fstab.example; the unit's StateDirectory=engramfs). Only the unit
// makes it, so a mount from fstab failed to save its hot set at every stop,
// with one log line: it is made here instead.
const defaultStateDir = "/var/lib/engramfs"

// prepareStateDir makes sure the state file can be written at stop: its
// directory exists (made when it is defaultStateDir) and is writable, and
// the path is not a directory.
func prepareStateDir(path string) error {
	dir := filepath.Dir(path)
	if filepath.Clean(dir) == defaultStateDir {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("--state-file %s: making its directory: %w", path, err)
		}
	}
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return usagef("--state-file %s: its directory %s does not exist: create it, or the hot set cannot be saved at stop", path, dir)
	case err != nil:
		return fmt.Errorf("--state-file %s: %w", path, err)
	case !fi.IsDir():
		return usagef("--state-file %s: %s is not a directory", path, dir)
	}
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return fmt.Errorf("--state-file %s: cannot write in %s (%w): the hot set could not be saved at stop", path, dir, err)
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return usagef("--state-file %s: is a directory; name a file in it", path)
	}
	return nil
}

// warnCacheSize warns when the hot tier's budget is more than the memory
// available: pinned pages cannot be reclaimed, so a full tier takes that
// memory from everything else on the node. (A memory cgroup's limit, which
// may clamp the tier, is another check.)
func warnCacheSize(capacity int64, log *zap.Logger) {
	if capacity <= 0 {
		return
	}
	avail, err := procfs.FileKB(procfs.Root+"/meminfo", "MemAvailable")
	if err != nil {
		return
	}
	total, _ := procfs.FileKB(procfs.Root+"/meminfo", "MemTotal")
	if capacity <= avail {
		return
	}
	log.Warn("--cache-size is more than the memory available: pinned pages cannot be reclaimed, so a full tier takes it from everything else",
		zap.String("cache_size", units.BytesSize(float64(capacity))),
		zap.String("mem_available", units.BytesSize(float64(avail))), zap.String("mem_total", units.BytesSize(float64(total))))
}

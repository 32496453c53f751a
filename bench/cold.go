package bench

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// DropMode says how the page cache is made cold before each path and phase.
type DropMode string

const (
	// DropAuto drops the whole page cache when it can (root), else every
	// file the bench reads.
	DropAuto DropMode = "auto"
	// DropSystem runs `sync; echo 3 > /proc/sys/vm/drop_caches` (root only):
	// every clean page goes, the mount's included, except pages someone has
	// mlocked (the daemon's hot tier, which is the point of it).
	DropSystem DropMode = "system"
	// DropFiles calls fadvise(DONTNEED) on every shard and mounted table file:
	// the same effect on the files that matter (clean, unmapped, unlocked
	// pages go), without emptying the rest of the machine's page cache.
	DropFiles DropMode = "files"
)

// ParseDropMode checks a --drop-caches value.
func ParseDropMode(s string) (DropMode, error) {
	switch m := DropMode(s); m {
	case DropAuto, DropSystem, DropFiles:
		return m, nil
	}
	return "", fmt.Errorf("drop mode %q: want auto, system or files", s)
}

// dropper empties the page cache between measurements and remembers how.
type dropper struct {
	mode     DropMode
	fellBack string // why DropAuto could not drop the system's caches, once it could not
	noted    bool   // the fallback is in the report
}

// drop makes files (and with DropSystem the whole page cache) cold. It
// returns how, for the report.
func (d *dropper) drop(files []string) (string, error) {
	if d.mode == DropSystem || (d.mode == DropAuto && d.fellBack == "") {
		err := dropSystem()
		if err == nil {
			return "drop_caches", nil
		}
		if d.mode == DropSystem {
			return "", err
		}
		d.fellBack = err.Error()
	}
	unix.Sync() // DONTNEED skips dirty pages: a freshly generated shard must be written first
	for _, f := range files {
		if err := dropFile(f); err != nil {
			return "", err
		}
	}
	return "fadvise(DONTNEED)", nil
}

func dropSystem() error {
	if os.Geteuid() != 0 {
		return errors.New("dropping the page cache needs root")
	}
	unix.Sync() // dirty pages cannot be dropped: write them first
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
		return fmt.Errorf("drop caches: %w", err)
	}
	return nil
}

func dropFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("drop cache of %s: %w", path, err)
	}
	defer f.Close()
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("drop cache of %s: %w", path, err)
	}
	return nil
}

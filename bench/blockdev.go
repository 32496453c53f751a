package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
)

// BlockDev is the block device under a directory: its own counters
// (/sys/dev/block/MAJ:MIN/stat) count every read the disk was asked for,
// readahead, fadvise(WILLNEED) and O_DIRECT alike, whichever process
// issued it: the one figure all paths can be compared on.
type BlockDev struct {
	Name         string `json:"name"`      // e.g. vda, nvme0n1p2, dm-0
	StatPath     string `json:"stat_path"` // its stat file
	Major, Minor uint32 `json:"-"`
}

// DevCounters are the read fields of a block device's stat file
// (Documentation/block/stat.rst).
type DevCounters struct {
	Reads       uint64 `json:"reads"`        // read requests completed (after merging)
	ReadMerges  uint64 `json:"read_merges"`  // reads merged into another request
	ReadSectors uint64 `json:"read_sectors"` // 512-byte sectors read
}

// Bytes is the bytes those sectors hold.
func (c DevCounters) Bytes() uint64 { return c.ReadSectors * 512 }

// Sub is c - before.
func (c DevCounters) Sub(before DevCounters) DevCounters {
	return DevCounters{Reads: c.Reads - before.Reads, ReadMerges: c.ReadMerges - before.ReadMerges, ReadSectors: c.ReadSectors - before.ReadSectors}
}

// FindBlockDev finds the block device holding dir: the device number of
// dir's filesystem, else (a filesystem with an anonymous device number,
// btrfs say) the device its mount names. A partition's own counters are
// used: they count only its reads.
func FindBlockDev(dir string) (*BlockDev, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return nil, fmt.Errorf("block device of %s: %w", dir, err)
	}
	sys := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	if real, err := filepath.EvalSymlinks(sys); err == nil {
		return &BlockDev{Name: filepath.Base(real), StatPath: filepath.Join(real, "stat"), Major: unix.Major(st.Dev), Minor: unix.Minor(st.Dev)}, nil
	}
	if m, ok := mountOf(dir); ok && strings.HasPrefix(m.Source, "/dev/") {
		var ds unix.Stat_t
		if real, err := filepath.EvalSymlinks(m.Source); err == nil && unix.Stat(real, &ds) == nil {
			stat := filepath.Join("/sys/class/block", filepath.Base(real), "stat")
			if _, err := os.Stat(stat); err == nil {
				return &BlockDev{Name: filepath.Base(real), StatPath: stat, Major: unix.Major(ds.Rdev), Minor: unix.Minor(ds.Rdev)}, nil
			}
		}
	}
	return nil, fmt.Errorf("block device of %s: device %d:%d has no /sys/dev/block entry and its mount names no block device (a network or union filesystem?)",
		dir, unix.Major(st.Dev), unix.Minor(st.Dev))
}

// mountOf is the mount holding dir: the longest mountpoint that is dir or
// a parent of it.
func mountOf(dir string) (procfs.Mount, bool) {
	mounts, err := procfs.Mounts()
	if err != nil {
		return procfs.Mount{}, false
	}
	var best procfs.Mount
	found := false
	for _, m := range mounts {
		mp := m.Point
		if (dir == mp || strings.HasPrefix(dir, strings.TrimSuffix(mp, "/")+"/")) && (!found || len(mp) > len(best.Point)) {
			best, found = m, true
		}
	}
	return best, found
}

// Read reads the device's counters now.
func (b *BlockDev) Read() (DevCounters, error) {
	raw, err := os.ReadFile(b.StatPath)
	if err != nil {
		return DevCounters{}, err
	}
	return parseDevStat(raw)
}

// parseDevStat reads the first fields of a block device's stat file: reads
// completed, merged, sectors read, ms reading, then the writes'.
func parseDevStat(b []byte) (DevCounters, error) {
	f := strings.Fields(string(b))
	if len(f) < 11 {
		return DevCounters{}, fmt.Errorf("block device stat %q: want at least 11 fields", strings.TrimSpace(string(b)))
	}
	var v [3]uint64
	for i := range v {
		n, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return DevCounters{}, fmt.Errorf("block device stat field %d: %w", i+1, err)
		}
		v[i] = n
	}
	return DevCounters{Reads: v[0], ReadMerges: v[1], ReadSectors: v[2]}, nil
}

package memcg

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/engramfs/engramfs/internal/procfs"
)

// Self is the memory cgroup this process runs in, where the kernel charges
// the memory it allocates (its heap, and the page cache its own reads and
// NOTIFY_STOREs bring in). It only reads the cgroup filesystem: the daemon
// finds its own limit with it, and which groups its pinned pages may be
// charged to.
type Self struct {
	Version int    // 1 or 2
	Dir     string // this process's group in the cgroup filesystem
	Root    string // where its hierarchy is mounted: Dir and its ancestors up to here
}

// Limit is the tightest memory limit on a group and its ancestors: what its
// processes' memory may reach before the kernel reclaims from them (and
// stalls them while it does), then kills one.
type Limit struct {
	Bytes int64  // 0: no limit
	Dir   string // the group that sets it
	File  string // memory.max, memory.high (v2) or memory.limit_in_bytes (v1)
}

// noLimit is where a limit means none: v1 writes "no limit" as
// PAGE_COUNTER_MAX pages (9223372036854771712 bytes), v2 as "max".
const noLimit = 1 << 62

// Own finds the memory cgroup of this process; the error says why there
// is none (no cgroup filesystem with the memory controller: no limit either).
func Own() (Self, error) {
	mounts, err := procfs.Mounts()
	if err != nil {
		return Self{}, fmt.Errorf("memory cgroup: %w", err)
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return Self{}, fmt.Errorf("memory cgroup: %w", err)
	}
	return own(mounts, string(self))
}

// own is Own from the mount table and the text of /proc/self/cgroup: the
// v2 hierarchy when the memory controller is bound to it (its root lists
// it in cgroup.controllers), else the v1 memory hierarchy. Unlike find it
// enables nothing.
func own(mounts []procfs.Mount, self string) (Self, error) {
	for _, m := range mounts {
		if m.FSType != "cgroup2" {
			continue
		}
		ctl, err := os.ReadFile(filepath.Join(m.Point, "cgroup.controllers"))
		if err != nil || !slices.Contains(strings.Fields(string(ctl)), "memory") {
			continue // a hybrid setup's unified hierarchy: memory is in v1
		}
		if path, ok := cgroupPath(self, ""); ok {
			return Self{Version: 2, Dir: under(m, path), Root: m.Point}, nil
		}
	}
	for _, m := range mounts {
		if m.FSType != "cgroup" || !slices.Contains(strings.Split(m.Options, ","), "memory") {
			continue
		}
		if path, ok := cgroupPath(self, "memory"); ok {
			return Self{Version: 1, Dir: under(m, path), Root: m.Point}, nil
		}
	}
	return Self{}, errors.New("no memory cgroup: no cgroup filesystem with the memory controller holds this process")
}

// Groups lists s's group and its ancestors up to the hierarchy's root,
// nearest first.
func (s Self) Groups() []string {
	var out []string
	for dir := filepath.Clean(s.Dir); ; dir = filepath.Dir(dir) {
		out = append(out, dir)
		if dir == filepath.Clean(s.Root) || !strings.HasPrefix(dir, filepath.Clean(s.Root)+"/") {
			return out
		}
	}
}

// Limit reads the tightest memory limit on s's group and its ancestors (a
// limit on a parent holds its children too): v2's memory.max and
// memory.high (above it the kernel throttles the group's allocations in
// reclaim: a stall, not a kill), v1's memory.limit_in_bytes. A group
// without the file (v2's root) sets none.
func (s Self) Limit() (Limit, error) {
	files := []string{"memory.max", "memory.high"}
	if s.Version == 1 {
		files = []string{"memory.limit_in_bytes"}
	}
	var l Limit
	for _, dir := range s.Groups() {
		for _, name := range files {
			n, err := readLimit(filepath.Join(dir, name))
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				return Limit{}, err
			}
			if n > 0 && (l.Bytes == 0 || n < l.Bytes) {
				l = Limit{Bytes: n, Dir: dir, File: name}
			}
		}
	}
	return l, nil
}

// readLimit reads a limit file: bytes, or 0 for none ("max", or v1's
// page-counter maximum).
func readLimit(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("memory cgroup limit %s: %q: %w", path, s, err)
	}
	if n >= noLimit {
		return 0, nil
	}
	return n, nil
}

// Inodes are the inode numbers of s's group and its ancestors: how
// /proc/kpagecgroup names the memory cgroup a page is charged to.
func (s Self) Inodes() ([]uint64, error) {
	var out []uint64
	for _, dir := range s.Groups() {
		var st syscall.Stat_t
		if err := syscall.Stat(dir, &st); err != nil {
			return nil, fmt.Errorf("memory cgroup: %w", err)
		}
		out = append(out, st.Ino)
	}
	return out, nil
}

// String is e.g. "cgroup v1 /sys/fs/cgroup/memory/system.slice/engramfs.service".
func (s Self) String() string { return fmt.Sprintf("cgroup v%d %s", s.Version, s.Dir) }

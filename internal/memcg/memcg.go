// Package memcg makes a memory cgroup that holds a set of processes under a
// memory limit, and reads what they use: the bench's serving loop runs its
// rank processes and the daemon in one, so that the tables are several
// times larger than the memory the serving processes may use, as on an
// inference node. cgroup v2 where its memory controller is enabled for the
// children of this process's cgroup, else the v1 memory controller. It
// writes cgroup files and nothing else.
//
// A group is made below the cgroup this process runs in and named
// PREFIX-PID-N; New first removes the empty groups of that prefix whose
// process is gone (a run killed before its cleanup).
package memcg

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/engramfs/engramfs/internal/procfs"
)

// Group is a memory cgroup this process made. Remove it when done.
type Group struct {
	Dir     string // its directory in the cgroup filesystem
	Version int    // 1 or 2
	Limit   int64  // the limit asked for, in bytes
	parent  string // the cgroup this process was in: where leftover processes go on Remove
	// io is where the group's block I/O is counted, once CountIO has
	// made it: Dir itself (v2's io.stat), or a v1 blkio group of the same
	// name; ioParent as parent; ioDev the device's "MAJ:MIN".
	io, ioParent, ioDev string
	ioVersion           int
	prefix              string
}

// IOCounters are the reads a group's processes made of one block device:
// counted where the block layer charges a bio to its cgroup (every read
// of the page cache's readahead, fadvise(WILLNEED) and O_DIRECT alike,
// before the device merges adjacent ones), and no other process's.
type IOCounters struct {
	Reads uint64 `json:"reads"` // bios (v1 blkio.throttle.io_serviced) or I/Os (v2 io.stat rios)
	Bytes uint64 `json:"bytes"`
}

// Usage is what the processes of a group use now and used at most.
type Usage struct {
	Current int64 `json:"current_bytes"` // v1 memory.usage_in_bytes, v2 memory.current
	Peak    int64 `json:"peak_bytes"`    // v1 memory.max_usage_in_bytes, v2 memory.peak (0: the kernel has none)
	Limit   int64 `json:"limit_bytes"`   // as the kernel holds it (rounded to pages)
	// From memory.stat: page cache, anonymous memory, and unevictable
	// pages (mlocked: the hot tier's pins).
	File        int64 `json:"file_bytes"`
	Anon        int64 `json:"anon_bytes"`
	Unevictable int64 `json:"unevictable_bytes"`
	// Refaults (memory.stat workingset_refault_file) counts file pages
	// read into the page cache again after the group's own reclaim evicted
	// them: pages read twice because memory ran short (thrash).
	Refaults int64 `json:"refaults"`
}

// hierarchy is where this process's cgroup is, in one cgroup version.
type hierarchy struct {
	version int
	dir     string // this process's cgroup
}

var seq atomic.Int64

// New makes a memory cgroup below the one this process runs in, limited to
// limit bytes of memory (no swap where the kernel lets that be said). Its
// error says in one sentence why there can be none here.
func New(prefix string, limit int64) (*Group, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("memory cgroup: limit %d: must be positive", limit)
	}
	mounts, err := procfs.Mounts()
	if err != nil {
		return nil, fmt.Errorf("memory cgroup: %w", err)
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("memory cgroup: %w", err)
	}
	h, err := find(mounts, string(self), "memory", "memory")
	if err != nil {
		return nil, fmt.Errorf("no memory cgroup: %w", err)
	}
	removeStale(h.dir, prefix)
	g := &Group{Dir: filepath.Join(h.dir, fmt.Sprintf("%s-%d-%d", prefix, os.Getpid(), seq.Add(1)-1)),
		Version: h.version, Limit: limit, parent: h.dir, prefix: prefix}
	if err := os.Mkdir(g.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("memory cgroup v%d: %w", g.Version, err)
	}
	limits := [][2]string{{"memory.max", ""}, {"memory.swap.max", "0"}}
	if g.Version == 1 {
		// memsw (memory + swap) may not be set below the memory limit: after it.
		limits = [][2]string{{"memory.limit_in_bytes", ""}, {"memory.memsw.limit_in_bytes", ""}}
	}
	for i, l := range limits {
		v := l[1]
		if v == "" {
			v = strconv.FormatInt(limit, 10)
		}
		if i > 0 && !g.has(l[0]) {
			continue // no swap accounting: the memory limit is all there is
		}
		if err := g.write(l[0], v); err != nil {
			g.Remove()
			return nil, err
		}
	}
	return g, nil
}

// find picks the hierarchy of a controller (v2's name, v1's name): v2
// where this cgroup's children can have it, else v1's.
func find(mounts []procfs.Mount, self, v2, v1 string) (hierarchy, error) {
	var why []string
	for _, m := range mounts {
		if m.FSType != "cgroup2" {
			continue
		}
		path, ok := cgroupPath(self, "")
		if !ok {
			break
		}
		dir := under(m, path)
		if err := enableController(dir, v2); err != nil {
			why = append(why, fmt.Sprintf("cgroup v2 at %s: %v", m.Point, err))
			break
		}
		return hierarchy{version: 2, dir: dir}, nil
	}
	for _, m := range mounts {
		if m.FSType != "cgroup" || !slices.Contains(strings.Split(m.Options, ","), v1) {
			continue
		}
		path, ok := cgroupPath(self, v1)
		if !ok {
			why = append(why, fmt.Sprintf("cgroup v1: /proc/self/cgroup names no %s cgroup", v1))
			break
		}
		return hierarchy{version: 1, dir: under(m, path)}, nil
	}
	if len(why) == 0 {
		why = append(why, fmt.Sprintf("no cgroup filesystem with the %s controller is mounted", v1))
	}
	return hierarchy{}, errors.New(strings.Join(why, "; "))
}

// cgroupPath is this process's cgroup in the hierarchy of controller ("":
// the v2 one) from the text of /proc/self/cgroup ("ID:CONTROLLERS:PATH").
func cgroupPath(self, controller string) (string, bool) {
	for _, line := range strings.Split(self, "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		if controller == "" && f[0] == "0" && f[1] == "" || controller != "" && slices.Contains(strings.Split(f[1], ","), controller) {
			return f[2], true
		}
	}
	return "", false
}

// under is the directory of cgroup path in mount m (whose root may be a
// part of the hierarchy: a cgroup namespace's).
func under(m procfs.Mount, path string) string {
	rel := path
	if m.Root != "" && m.Root != "/" {
		rel = strings.TrimPrefix(path, m.Root)
	}
	return filepath.Join(m.Point, rel)
}

// enableController makes sure the children of the v2 cgroup dir get the
// controller. Enabling it fails in a cgroup that holds processes (v2's
// rule: no process in a cgroup whose controllers its children share),
// unless it is the root.
func enableController(dir, name string) error {
	ctl, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	if err != nil {
		return err
	}
	if !slices.Contains(strings.Fields(string(ctl)), name) {
		return fmt.Errorf("the %s controller is not available here", name)
	}
	sub, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
	if err != nil {
		return err
	}
	if slices.Contains(strings.Fields(string(sub)), name) {
		return nil
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+"+name), 0); err != nil {
		return fmt.Errorf("cannot enable the %s controller for the children of %s: %w", name, dir, err)
	}
	return nil
}

// Owned lists the groups named prefix that this process made and that are
// still there, in the memory and block I/O hierarchies it is in: what a run
// left behind.
func Owned(prefix string) ([]string, error) {
	mounts, err := procfs.Mounts()
	if err != nil {
		return nil, err
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, c := range [][2]string{{"memory", "memory"}, {"io", "blkio"}} {
		h, err := find(mounts, string(self), c[0], c[1])
		if err != nil {
			continue
		}
		m, _ := filepath.Glob(filepath.Join(h.dir, fmt.Sprintf("%s-%d-*", prefix, os.Getpid())))
		for _, d := range m {
			if !slices.Contains(out, d) {
				out = append(out, d)
			}
		}
	}
	return out, nil
}

// removeStale removes the empty groups named prefix-PID-N below dir whose
// PID is gone: a run killed before it could remove its own.
func removeStale(dir, prefix string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), prefix+"-")
		if !e.IsDir() || !ok {
			continue
		}
		pidText, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid == os.Getpid() || procfs.Alive(pid) {
			continue
		}
		_ = syscall.Rmdir(filepath.Join(dir, e.Name())) // fails while it holds a process: then it is not stale
	}
}

// Wrapper is a command prefix that runs a command inside g: the shell
// moves itself into g, then execs the command appended to it, which so
// starts inside g and keeps the shell's pid. Memory is charged to the
// cgroup a process is in when it is allocated, so a process moved in
// later leaves its first pages charged outside.
func (g *Group) Wrapper() []string {
	script := `echo $$ > '` + filepath.Join(g.Dir, "cgroup.procs") + `'`
	if g.io != "" && g.io != g.Dir {
		script += ` && echo $$ > '` + filepath.Join(g.io, "cgroup.procs") + `'`
	}
	return []string{"/bin/sh", "-c", script + ` && exec "$@"`, "sh"}
}

// CountIO counts the block I/O of g's processes on the device major:minor
// from now on (IO): v2's io.stat where the io controller can be had for
// g, else a v1 blkio group of g's name. v1 counts a group's bios
// (blkio.throttle.io_serviced) only on a device where some group has a
// throttle rule (measured here: 0 reads counted without one, every one
// with), so the group gets one that no device reaches, a petabyte a
// second. Call it before any process is in g (Wrapper puts them in both).
func (g *Group) CountIO(major, minor uint32) error {
	mounts, err := procfs.Mounts()
	if err != nil {
		return err
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return err
	}
	h, err := find(mounts, string(self), "io", "blkio")
	if err != nil {
		return fmt.Errorf("no block I/O cgroup: %w", err)
	}
	dev := fmt.Sprintf("%d:%d", major, minor)
	if h.version == 2 {
		if g.Version != 2 {
			return errors.New("no block I/O cgroup: the io controller is in v2, the memory group in v1")
		}
		g.io, g.ioParent, g.ioDev, g.ioVersion = g.Dir, g.parent, dev, 2
		return nil
	}
	dir := filepath.Join(h.dir, filepath.Base(g.Dir))
	removeStale(h.dir, g.prefix)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return fmt.Errorf("blkio cgroup: %w", err)
	}
	g.io, g.ioParent, g.ioDev, g.ioVersion = dir, h.dir, dev, 1
	if err := os.WriteFile(filepath.Join(dir, "blkio.throttle.read_bps_device"), []byte(dev+" 1000000000000000"), 0); err != nil {
		return fmt.Errorf("blkio cgroup %s: a rule for %s: %w", dir, dev, err)
	}
	return nil
}

// IO is what g's processes read of the device since CountIO.
func (g *Group) IO() (IOCounters, error) {
	var c IOCounters
	if g.io == "" {
		return c, errors.New("block I/O not counted (no CountIO)")
	}
	if g.ioVersion == 2 {
		b, err := os.ReadFile(filepath.Join(g.io, "io.stat"))
		if err != nil {
			return c, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != g.ioDev {
				continue
			}
			for _, kv := range f[1:] {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseUint(v, 10, 64)
				switch k {
				case "rios":
					c.Reads = n
				case "rbytes":
					c.Bytes = n
				}
			}
		}
		return c, nil
	}
	for _, f := range []struct {
		name string
		dst  *uint64
	}{{"blkio.throttle.io_serviced", &c.Reads}, {"blkio.throttle.io_service_bytes", &c.Bytes}} {
		b, err := os.ReadFile(filepath.Join(g.io, f.name))
		if err != nil {
			return c, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, g.ioDev+" Read "); ok {
				*f.dst, _ = strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			}
		}
	}
	return c, nil
}

// Add moves process pid (all its threads) into g.
func (g *Group) Add(pid int) error { return g.write("cgroup.procs", strconv.Itoa(pid)) }

// Procs lists the processes in g.
func (g *Group) Procs() ([]int, error) { return readProcs(g.Dir) }

func readProcs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// Usage reads what g's processes use.
func (g *Group) Usage() (Usage, error) {
	names := [3]string{"memory.current", "memory.peak", "memory.max"}
	if g.Version == 1 {
		names = [3]string{"memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.limit_in_bytes"}
	}
	var u Usage
	var err error
	if u.Current, err = g.readInt(names[0]); err != nil {
		return u, err
	}
	if g.has(names[1]) {
		if u.Peak, err = g.readInt(names[1]); err != nil {
			return u, err
		}
	}
	if u.Limit, err = g.readInt(names[2]); err != nil {
		return u, err
	}
	st, err := g.keyed("memory.stat")
	if err != nil {
		return u, err
	}
	u.Unevictable, u.Refaults = st["unevictable"], st["workingset_refault_file"]
	if g.Version == 1 {
		u.File, u.Anon = st["cache"], st["rss"]
	} else {
		u.File, u.Anon = st["file"], st["anon"]
	}
	return u, nil
}

// Remove moves the processes still in g back to the cgroup this process
// was in and removes g (and its blkio group). A process that has just
// exited keeps a cgroup busy for a moment: it tries again for up to 5 s.
func (g *Group) Remove() error {
	err := removeGroup(g.Dir, g.parent)
	if g.io != "" && g.io != g.Dir {
		err = errors.Join(err, removeGroup(g.io, g.ioParent))
	}
	return err
}

func removeGroup(dir, parent string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		pids, err := readProcs(dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		for _, pid := range pids {
			_ = os.WriteFile(filepath.Join(parent, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
		}
		err = syscall.Rmdir(dir)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s: remove: %w (processes: %v)", dir, err, pids)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// String is e.g. "cgroup v1 memory limit 1.25 GiB (/sys/fs/cgroup/memory/engramfs-bench-42-0)".
func (g *Group) String() string {
	return fmt.Sprintf("cgroup v%d memory limit %.2f GiB (%s)", g.Version, float64(g.Limit)/(1<<30), g.Dir)
}

func (g *Group) has(name string) bool {
	_, err := os.Stat(filepath.Join(g.Dir, name))
	return err == nil
}

func (g *Group) write(name, value string) error {
	if err := os.WriteFile(filepath.Join(g.Dir, name), []byte(value), 0); err != nil {
		return fmt.Errorf("memory cgroup %s: write %s: %w", g.Dir, name, err)
	}
	return nil
}

// readInt reads a file holding one number ("max": no limit, as MaxInt64).
func (g *Group) readInt(name string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(g.Dir, name))
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 1<<63 - 1, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("memory cgroup %s: %s: %w", g.Dir, name, err)
	}
	return n, nil
}

// keyed reads a file of "key value" lines (memory.stat).
func (g *Group) keyed(name string) (map[string]int64, error) {
	b, err := os.ReadFile(filepath.Join(g.Dir, name))
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				out[k] = n
			}
		}
	}
	return out, nil
}

// Package procfs is the one reader of /proc for engramfs's tools and tests:
// the "Key: N kB" lines of status and smaps_rollup, a process's CPU time,
// the mount table (mount IDs, stacked mounts), the processes that map files
// under a directory (maps), and the kernel's vmstat counters. It parses text only;
// what a number means for engramfs is the caller's business.
package procfs

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Root is where proc is mounted.
const Root = "/proc"

// clockTick is USER_HZ, the unit of /proc/PID/stat and /proc/stat times: 100
// on every Linux architecture Go supports (the kernel fixes it for
// userspace, whatever HZ is).
const clockTick = 100

// PidPath is /proc/PID/file.
func PidPath(pid int, file string) string {
	return Root + "/" + strconv.Itoa(pid) + "/" + file
}

// ParseKB parses the value of a "Key:   12345 kB" line ("12345 kB") into
// bytes.
func ParseKB(v string) (int64, error) {
	f := strings.Fields(v)
	if len(f) != 2 || f[1] != "kB" {
		return 0, fmt.Errorf("%q is not a kB value", strings.TrimSpace(v))
	}
	n, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, err
	}
	return n << 10, nil
}

// KB finds the line "key: N kB" in b (the text of a status or smaps_rollup
// file) and returns N in bytes; ok is false when there is no such line.
func KB(b []byte, key string) (n int64, ok bool, err error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, found := strings.Cut(sc.Text(), ":")
		if !found || k != key {
			continue
		}
		n, err := ParseKB(v)
		if err != nil {
			return 0, true, fmt.Errorf("%s: %w", key, err)
		}
		return n, true, nil
	}
	return 0, false, nil
}

// FileKB reads one "key: N kB" line of the file at path, in bytes.
func FileKB(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	n, ok, err := KB(b, key)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	if !ok {
		return 0, fmt.Errorf("%s has no %s", path, key)
	}
	return n, nil
}

// PidKB reads one "key: N kB" line of /proc/PID/file (status,
// smaps_rollup), in bytes.
func PidKB(pid int, file, key string) (int64, error) { return FileKB(PidPath(pid, file), key) }

// StatusField is the value of one line of /proc/PID/status, without its key
// and surrounding blanks (e.g. "0000000000000000" for CapEff).
func StatusField(pid int, key string) (string, error) {
	p := PidPath(pid, "status")
	b, err := os.ReadFile(p)
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("%s has no %s", p, key)
}

// Mem is a process's resident memory from /proc/PID/status.
type Mem struct {
	RSS  int64 `json:"rss_bytes"`      // VmRSS: resident now
	HWM  int64 `json:"hwm_bytes"`      // VmHWM: the peak of VmRSS
	Anon int64 `json:"rss_anon_bytes"` // RssAnon: heap and stacks, now
	File int64 `json:"rss_file_bytes"` // RssFile: mapped file pages now (the hot tier's pinned table pages)
}

// ReadMem reads the resident memory of pid.
func ReadMem(pid int) (Mem, error) {
	b, err := os.ReadFile(PidPath(pid, "status"))
	if err != nil {
		return Mem{}, err
	}
	return ParseStatusMem(b)
}

// ParseStatusMem reads Mem from the text of a /proc/PID/status file. VmRSS
// and VmHWM must be there (a kernel thread has neither).
func ParseStatusMem(b []byte) (Mem, error) {
	var m Mem
	for _, f := range []struct {
		key      string
		dst      *int64
		required bool
	}{{"VmRSS", &m.RSS, true}, {"VmHWM", &m.HWM, true}, {"RssAnon", &m.Anon, false}, {"RssFile", &m.File, false}} {
		n, ok, err := KB(b, f.key)
		if err != nil {
			return Mem{}, fmt.Errorf("/proc status: %w", err)
		}
		if !ok && f.required {
			return Mem{}, fmt.Errorf("/proc status: no %s (a kernel thread?)", f.key)
		}
		*f.dst = n
	}
	return m, nil
}

// LockedBytes is the memory pid has locked and resident: "Locked" of its
// smaps_rollup (VmLck counts whole MLOCK_ONFAULT mappings, touched or not).
func LockedBytes(pid int) (int64, error) { return PidKB(pid, "smaps_rollup", "Locked") }

// CPU is the CPU time (user + system, all threads, in 10 ms ticks) a
// process has used, from /proc/PID/stat.
func CPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(PidPath(pid, "stat"))
	if err != nil {
		return 0, err
	}
	return ParseStatCPU(b)
}

// Switches is the context switches of every thread of process pid so far,
// voluntary and not: the sum over /proc/PID/task/*/status. A thread that
// has exited is no longer counted.
func Switches(pid int) (uint64, error) {
	var n uint64
	err := eachTask(pid, "status", func(b []byte) error {
		n += ParseSwitches(b)
		return nil
	})
	return n, err
}

// eachTask calls fn with /proc/PID/task/TID/file of every thread of pid,
// skipping a thread that exits meanwhile, and stops at fn's first error.
func eachTask(pid int, file string, fn func([]byte) error) error {
	tasks, err := os.ReadDir(PidPath(pid, "task"))
	if err != nil {
		return err
	}
	for _, t := range tasks {
		b, err := os.ReadFile(PidPath(pid, "task/"+t.Name()+"/"+file))
		if err != nil {
			continue // the thread exited meanwhile
		}
		if err := fn(b); err != nil {
			return err
		}
	}
	return nil
}

// ParseSwitches adds voluntary_ctxt_switches and nonvoluntary_ctxt_switches
// of a /proc status file.
func ParseSwitches(b []byte) uint64 {
	var n uint64
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "voluntary_ctxt_switches" && k != "nonvoluntary_ctxt_switches") {
			continue
		}
		if x, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			n += x
		}
	}
	return n
}

// statFields returns the fields of a /proc/PID/stat line after the command
// name: f[0] is field 3 (state), so field k is f[k-3]. The command name
// (field 2) may hold spaces and parentheses, so the fields are counted from
// its closing parenthesis, the last one of the line.
func statFields(b []byte) ([]string, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc stat: no command name")
	}
	return strings.Fields(string(b[i+1:])), nil
}

// ParseStatCPU reads utime and stime (fields 14 and 15) of a /proc/PID/stat
// line.
func ParseStatCPU(b []byte) (time.Duration, error) {
	f, err := statFields(b)
	if err != nil {
		return 0, err
	}
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc stat: %d fields after the command name", len(f))
	}
	var ticks uint64
	for _, s := range f[11:13] {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc stat: %w", err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / clockTick, nil
}

// ThreadStates lists pid's threads as "TID STATE WCHAN" (from each
// thread's stat and wchan), for the report of a process that will not
// exit: a thread in D names what it waits for.
func ThreadStates(pid int) (string, error) {
	var out []string
	err := eachTask(pid, "stat", func(b []byte) error {
		tid, _, _ := strings.Cut(string(b), " ")
		state := "?"
		if f, err := statFields(b); err == nil && len(f) > 0 {
			state = f[0]
		}
		wchan, _ := os.ReadFile(PidPath(pid, "task/"+tid+"/wchan"))
		out = append(out, tid+" "+state+" "+string(wchan))
		return nil
	})
	return strings.Join(out, ", "), err
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) bool {
	b, err := os.ReadFile(PidPath(pid, "stat"))
	if err != nil {
		return false
	}
	f, err := statFields(b)
	return err == nil && len(f) > 0 && f[0] != "Z"
}

// SchedCPU is the CPU time the live threads of pid have used, from each
// thread's schedstat: nanoseconds, where /proc/PID/stat counts 10 ms ticks.
// Threads that have exited are not counted.
func SchedCPU(pid int) (time.Duration, error) {
	var ns int64
	err := eachTask(pid, "schedstat", func(b []byte) error {
		f := strings.Fields(string(b))
		if len(f) < 1 {
			return nil
		}
		v, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return fmt.Errorf("schedstat %q: %w", b, err)
		}
		ns += v
		return nil
	})
	if err != nil {
		return 0, err
	}
	return time.Duration(ns), nil
}

// SelfReadBytes is read_bytes of /proc/self/io: bytes this process (all its
// threads) caused to be read from block devices. It is counted where the
// block I/O is submitted, so it includes readahead and fadvise(WILLNEED)
// reads started by its faults and calls, and excludes page cache hits.
func SelfReadBytes() (uint64, error) {
	b, err := os.ReadFile(Root + "/self/io")
	if err != nil {
		return 0, err
	}
	return ParseIOReadBytes(b)
}

// ParseIOReadBytes reads read_bytes of the text of a /proc/PID/io file.
func ParseIOReadBytes(b []byte) (uint64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "read_bytes:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc io: no read_bytes")
}

// MachineCPU is the CPU time all CPUs spent busy and in total since boot,
// from the first line of /proc/stat.
func MachineCPU() (busy, total time.Duration, err error) {
	b, err := os.ReadFile(Root + "/stat")
	if err != nil {
		return 0, 0, err
	}
	return ParseMachineCPU(b)
}

// ParseMachineCPU reads busy and total CPU time from the text of /proc/stat.
func ParseMachineCPU(b []byte) (busy, total time.Duration, err error) {
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var v [8]uint64 // user nice system idle iowait irq softirq steal
	for i := range v {
		if v[i], err = strconv.ParseUint(f[i+1], 10, 64); err != nil {
			return 0, 0, fmt.Errorf("/proc/stat: %w", err)
		}
	}
	b64 := v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
	t64 := b64 + v[3] + v[4]
	return time.Duration(b64) * time.Second / clockTick, time.Duration(t64) * time.Second / clockTick, nil
}

// VMStat reads the counters of /proc/vmstat (e.g. "pgmajfault",
// "workingset_refault_file").
func VMStat() (map[string]uint64, error) {
	b, err := os.ReadFile(Root + "/vmstat")
	if err != nil {
		return nil, err
	}
	return ParseVMStat(b)
}

// ParseVMStat reads the "name value" lines of /proc/vmstat.
func ParseVMStat(b []byte) (map[string]uint64, error) {
	m := map[string]uint64{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) != 2 {
			return nil, fmt.Errorf("/proc/vmstat: line %q", line)
		}
		v, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("/proc/vmstat: %s: %w", f[0], err)
		}
		m[f[0]] = v
	}
	return m, nil
}

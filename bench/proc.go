package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// clockTick is USER_HZ, the unit of /proc/PID/stat times: 100 on every Linux
// architecture Go supports (the kernel fixes it for userspace, whatever HZ is).
const clockTick = 100

// ProcCPU is the CPU time (user + system, all threads) a process has used,
// from /proc/PID/stat.
func ProcCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseStatCPU(b)
}

// parseStatCPU reads utime and stime (fields 14 and 15) of a /proc/PID/stat
// line. The command name (field 2) may hold spaces and parentheses, so the
// fields are counted from its closing parenthesis, the last one of the line.
func parseStatCPU(b []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc stat: no command name")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state), so field k is f[k-3].
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

// ProcMem is a process's resident memory from /proc/PID/status.
type ProcMem struct {
	RSS  int64 `json:"rss_bytes"`      // VmRSS: resident now
	HWM  int64 `json:"hwm_bytes"`      // VmHWM: the peak of VmRSS
	Anon int64 `json:"rss_anon_bytes"` // RssAnon: heap and stacks, now
	File int64 `json:"rss_file_bytes"` // RssFile: mapped file pages now (the hot tier's pinned table pages)
}

// ReadProcMem reads VmRSS and VmHWM of pid.
func ReadProcMem(pid int) (ProcMem, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ProcMem{}, err
	}
	return parseStatusMem(b)
}

func parseStatusMem(b []byte) (ProcMem, error) {
	var m ProcMem
	found := 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		var dst *int64
		switch k {
		case "VmRSS":
			dst = &m.RSS
		case "VmHWM":
			dst = &m.HWM
		case "RssAnon":
			dst = &m.Anon
		case "RssFile":
			dst = &m.File
		}
		if !ok || dst == nil {
			continue
		}
		f := strings.Fields(v) // "12345 kB"
		if len(f) != 2 || f[1] != "kB" {
			return ProcMem{}, fmt.Errorf("/proc status: %s: %q", k, v)
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return ProcMem{}, fmt.Errorf("/proc status: %s: %w", k, err)
		}
		*dst = n << 10
		if k == "VmRSS" || k == "VmHWM" {
			found++
		}
	}
	if found != 2 {
		return ProcMem{}, fmt.Errorf("/proc status: no VmRSS or VmHWM (a kernel thread?)")
	}
	return m, nil
}

// SelfReadBytes is read_bytes of /proc/self/io: bytes this process (all its
// threads) caused to be read from block devices. It is counted where the
// block I/O is submitted, so it includes readahead and fadvise(WILLNEED)
// reads started by our faults and calls, and excludes page cache hits: the
// backing I/O of the paths that read the shards themselves.
func SelfReadBytes() (uint64, error) {
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0, err
	}
	return parseIOReadBytes(b)
}

func parseIOReadBytes(b []byte) (uint64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "read_bytes:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc/self/io: no read_bytes")
}

// selfCPU is this process's CPU time (user + system, all threads).
func selfCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineCPU is the CPU time all CPUs spent busy and in total since boot,
// from the first line of /proc/stat.
func machineCPU() (busy, total time.Duration, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
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

// ownCPU is the CPU time of this process and of its children that have
// exited (the daemons the bench started and stopped).
func ownCPU() time.Duration {
	var self, kids unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &self) != nil || unix.Getrusage(unix.RUSAGE_CHILDREN, &kids) != nil {
		return 0
	}
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}

// Package sysmon quiets the Go runtime's monitor thread (sysmon).
//
// sysmon sleeps 20 µs at a time for a millisecond or more whenever the
// process wakes from idle (any system call after an idle spell resets it),
// then doubles its sleep up to 10 ms. A daemon woken by every decode step
// therefore runs ~50 sysmon wake-ups a step: in the serving loop 45% of the
// daemon's context switches and 18% of its CPU (2026-12-06, 2 vCPUs, where
// a wake-up costs ~20 µs of CPU). A timer slack on that one thread lets the
// kernel coalesce its sleeps, so it polls about once per slack. What sysmon
// does on those polls (handing the Ps of threads blocked in system calls to
// runnable goroutines, preempting long-running ones) then waits up to the
// slack; the daemon runs with spare Ps so that a runnable goroutine rarely
// needs a retake.
//
// The runtime starts sysmon before any other thread (runtime.main, before
// the package inits), so it is the process's first thread after the main
// one. Thread IDs come from one counter that wraps at pid_max, so the first
// thread created after the main one is the TID closest above the PID,
// modulo pid_max.
package sysmon

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/engramfs/engramfs/internal/procfs"
)

// Thread returns the TID of this process's runtime monitor thread.
func Thread() (int, error) { return ThreadOf(os.Getpid()) }

// ThreadOf returns the TID of the runtime monitor thread of Go process pid.
func ThreadOf(pid int) (int, error) {
	ents, err := os.ReadDir(procfs.PidPath(pid, "task"))
	if err != nil {
		return 0, err
	}
	pidMax := 1 << 22 // the kernel's limit; /proc/sys/kernel/pid_max says the value in force
	if b, err := os.ReadFile(procfs.Root + "/sys/kernel/pid_max"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v > 0 {
			pidMax = v
		}
	}
	var tids []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	tid := firstAfter(pid, tids, pidMax)
	if tid == 0 {
		return 0, errors.New("sysmon: the process has one thread")
	}
	return tid, nil
}

// firstAfter is the thread of tids created first after pid's main thread:
// the closest above pid, counting modulo pidMax. 0 when there is none.
func firstAfter(pid int, tids []int, pidMax int) int {
	best, bestDist := 0, 0
	for _, tid := range tids {
		if tid == pid {
			continue
		}
		d := ((tid-pid)%pidMax + pidMax) % pidMax
		if best == 0 || d < bestDist {
			best, bestDist = tid, d
		}
	}
	return best
}

// SetSlack sets thread tid's timer slack (the kernel's default is 50 µs);
// another thread's needs CAP_SYS_NICE.
func SetSlack(tid int, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("sysmon: timer slack %v: must be positive", d)
	}
	return os.WriteFile(procfs.PidPath(tid, "timerslack_ns"), []byte(strconv.FormatInt(d.Nanoseconds(), 10)), 0)
}

// Slack reads thread tid's timer slack.
func Slack(tid int) (time.Duration, error) {
	b, err := os.ReadFile(procfs.PidPath(tid, "timerslack_ns"))
	if err != nil {
		return 0, err
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("sysmon: timerslack_ns of %d: %w", tid, err)
	}
	return time.Duration(ns), nil
}

// Quiet sets the monitor thread's timer slack to d and returns its TID.
func Quiet(d time.Duration) (int, error) {
	tid, err := Thread()
	if err != nil {
		return 0, err
	}
	return tid, SetSlack(tid, d)
}

package sysmon

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestFirstAfterCountsModuloPidMax(t *testing.T) {
	for _, c := range []struct {
		pid    int
		tids   []int
		pidMax int
		want   int
	}{
		{100, []int{100, 101, 105, 130}, 1 << 22, 101},
		{100, []int{130, 100, 105}, 1 << 22, 105},
		// The counter wrapped after the monitor was made: 4,194,303 is
		// older than 301.
		{4194300, []int{4194300, 301, 4194303, 900}, 1 << 22, 4194303},
		// It wrapped before: 2 is the first after 4,194,303.
		{4194303, []int{4194303, 40, 2, 7}, 1 << 22, 2},
		{100, []int{100}, 1 << 22, 0},
	} {
		if got := firstAfter(c.pid, c.tids, c.pidMax); got != c.want {
			t.Errorf("firstAfter(%d, %v, %d) = %d, want %d", c.pid, c.tids, c.pidMax, got, c.want)
		}
	}
}

// TestThreadIsTheMonitor: while a goroutine keeps a P busy, the monitor
// never sleeps deeply; it sleeps in nanosleep(2), which no other thread of
// this process calls. The thread Thread names must be seen there.
func TestThreadIsTheMonitor(t *testing.T) {
	tid, err := Thread()
	if err != nil {
		t.Fatal(err)
	}
	if tid == os.Getpid() {
		t.Fatalf("Thread() = %d, the main thread", tid)
	}
	var stop atomic.Bool
	done := make(chan struct{})
	go func() { // a P that never goes idle
		defer close(done)
		for !stop.Load() {
			runtime.Gosched()
		}
	}()
	defer func() { stop.Store(true); <-done }()
	seen := map[string]int{}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && seen["35"] == 0 {
		b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/syscall")
		if err != nil {
			t.Fatal(err)
		}
		seen[strings.Fields(string(b) + " x")[0]]++
	}
	if seen["35"] == 0 { // __NR_nanosleep on amd64 and the runtime's usleep
		t.Fatalf("thread %d never seen in nanosleep(2) in 5 s while a P was busy (system calls seen: %v): not the runtime's monitor", tid, seen)
	}
}

func TestQuietSetsTheMonitorsSlack(t *testing.T) {
	tid, err := Thread()
	if err != nil {
		t.Fatal(err)
	}
	was, err := Slack(tid)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Quiet(time.Millisecond)
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("setting another thread's timer slack needs CAP_SYS_NICE: %v", err)
		}
		t.Fatal(err)
	}
	defer SetSlack(tid, was)
	if got != tid {
		t.Errorf("Quiet set thread %d, Thread() is %d", got, tid)
	}
	if s, err := Slack(tid); err != nil || s != time.Millisecond {
		t.Errorf("slack after Quiet(1ms): %v, %v", s, err)
	}
	if err := SetSlack(tid, 0); err == nil {
		t.Error("SetSlack(0) accepted: the kernel would take 0 as the thread's default")
	}
}

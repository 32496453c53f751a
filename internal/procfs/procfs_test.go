package procfs

import (
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParseStatCPU(t *testing.T) {
	// The command name may hold spaces and parentheses.
	stat := []byte("1234 (engram fs) (x)) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 8 0 100 0 0\n")
	cpu, err := ParseStatCPU(stat)
	if err != nil || cpu != 3250*time.Millisecond {
		t.Errorf("cpu = %v, %v; want 325 ticks = 3.25s", cpu, err)
	}
	if _, err := ParseStatCPU([]byte("1234 (x) S 1 2\n")); err == nil {
		t.Error("a short stat line parsed")
	}
	if _, err := CPU(os.Getpid()); err != nil {
		t.Errorf("reading our own /proc stat: %v", err)
	}
	if !Alive(os.Getpid()) {
		t.Error("this process is not alive")
	}
}

func TestKB(t *testing.T) {
	status := []byte("Name:\tengramfs\nVmPeak:\t  9999 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nRssAnon:\t     256 kB\nRssFile:\t     768 kB\nThreads:\t8\n")
	m, err := ParseStatusMem(status)
	if err != nil || m.RSS != 1<<20 || m.HWM != 2<<20 || m.Anon != 256<<10 || m.File != 768<<10 {
		t.Errorf("mem = %+v, %v", m, err)
	}
	if _, err := ParseStatusMem([]byte("Name:\tkthreadd\n")); err == nil {
		t.Error("a status without VmRSS parsed")
	}
	// A key is a whole key: VmHWM is not found as HWM, Threads is no kB line.
	if _, ok, _ := KB(status, "HWM"); ok {
		t.Error("found HWM inside VmHWM")
	}
	if _, _, err := KB(status, "Threads"); err == nil {
		t.Error("Threads parsed as kB")
	}
	if n, err := PidKB(os.Getpid(), "status", "VmRSS"); err != nil || n <= 0 {
		t.Errorf("our own VmRSS = %d, %v", n, err)
	}
	if _, err := PidKB(os.Getpid(), "status", "NoSuchKey"); err == nil {
		t.Error("a missing key read")
	}
	if v, err := StatusField(os.Getpid(), "Name"); err != nil || v == "" {
		t.Errorf("our own Name = %q, %v", v, err)
	}
}

// TestLockedBytes locks a page and sees it in Locked (root or a memlock
// limit of a page allows that).
func TestLockedBytes(t *testing.T) {
	before, err := LockedBytes(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(-1, 0, 64<<10, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	if err := unix.Mlock(b); err != nil {
		t.Skipf("mlock: %v", err)
	}
	after, err := LockedBytes(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after-before < 64<<10 {
		t.Errorf("Locked grew by %d B after locking 64 KiB", after-before)
	}
}

func TestSchedCPU(t *testing.T) {
	a, err := SchedCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	spin := time.Now()
	for time.Since(spin) < 20*time.Millisecond {
	}
	b, err := SchedCPU(os.Getpid())
	if err != nil || b <= a {
		t.Errorf("schedstat CPU went from %v to %v (%v) over a 20 ms spin", a, b, err)
	}
}

func TestIOAndMachine(t *testing.T) {
	io := []byte("rchar: 1\nwchar: 2\nsyscr: 3\nsyscw: 4\nread_bytes: 8192\nwrite_bytes: 0\n")
	if n, err := ParseIOReadBytes(io); err != nil || n != 8192 {
		t.Errorf("read_bytes = %d, %v", n, err)
	}
	if _, err := SelfReadBytes(); err != nil {
		t.Errorf("reading our own /proc/self/io: %v", err)
	}
	busy, total, err := ParseMachineCPU([]byte("cpu  100 1 50 1000 10 2 3 4 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n"))
	if err != nil || busy != 1600*time.Millisecond || total != 11700*time.Millisecond {
		t.Errorf("busy %v total %v, %v; want 1.6s of 11.7s", busy, total, err)
	}
	if _, _, err := MachineCPU(); err != nil {
		t.Error(err)
	}
}

func TestVMStat(t *testing.T) {
	m, err := ParseVMStat([]byte("nr_free_pages 123\npgmajfault 45\n"))
	if err != nil || m["nr_free_pages"] != 123 || m["pgmajfault"] != 45 || len(m) != 2 {
		t.Errorf("vmstat = %v, %v", m, err)
	}
	if _, err := ParseVMStat([]byte("pgmajfault x\n")); err == nil {
		t.Error("a bad counter parsed")
	}
	live, err := VMStat()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := live["pgfault"]; !ok {
		t.Error("/proc/vmstat has no pgfault")
	}
}

func TestMountinfo(t *testing.T) {
	info := []byte(`22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
35 22 0:31 / /tmp/a\040b rw,nosuid master:3 shared:9 - fuse.engramfs engramfs rw,user_id=0
36 22 0:32 / /tmp/a\040bc rw - tmpfs tmpfs rw
36 22 0:33 /process_api /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
`)
	ms := ParseMountinfo(info)
	want := []Mount{
		{ID: 22, Parent: 1, Dev: "253:1", Point: "/", FSType: "ext4", Source: "/dev/vda", Root: "/", Options: "rw"},
		{ID: 35, Parent: 22, Dev: "0:31", Point: "/tmp/a b", FSType: "fuse.engramfs", Source: "engramfs", Root: "/", Options: "rw,user_id=0"},
		{ID: 36, Parent: 22, Dev: "0:32", Point: "/tmp/a bc", FSType: "tmpfs", Source: "tmpfs", Root: "/", Options: "rw"},
		{ID: 36, Parent: 22, Dev: "0:33", Point: "/sys/fs/cgroup/memory", FSType: "cgroup", Source: "cgroup", Root: "/process_api", Options: "rw,memory"},
	}
	if len(ms) != len(want) {
		t.Fatalf("mounts = %+v", ms)
	}
	for i := range want {
		if ms[i] != want[i] {
			t.Errorf("mount %d = %+v, want %+v", i, ms[i], want[i])
		}
	}
	if got := unescape(`a\134b\0`); got != `a\b\0` {
		t.Errorf("unescape = %q", got)
	}
	if !Mounted("/") {
		t.Error("/ is not mounted")
	}
	// A directory of our own has no mounts under it, whatever is mounted
	// elsewhere, until we mount one there (as root).
	dir := t.TempDir()
	if m, err := MountsUnder(dir); err != nil || len(m) != 0 {
		t.Fatalf("mounts under a fresh dir: %v, %v", m, err)
	}
	if os.Geteuid() != 0 {
		return
	}
	mp := filepath.Join(dir, "m")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	defer unix.Unmount(mp, unix.MNT_DETACH)
	if m, err := MountsUnder(dir); err != nil || len(m) != 1 || m[0] != mp || !Mounted(mp) {
		t.Errorf("mounts under %s = %v, %v; Mounted %v", dir, m, err, Mounted(mp))
	}
	if m, _ := MountsUnder(dir + "x"); len(m) != 0 {
		t.Errorf("a sibling's mounts count: %v", m)
	}
}

func TestParseSwitches(t *testing.T) {
	b := []byte("Name:\tx\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t7\nVmRSS:\t 10 kB\n")
	if got := ParseSwitches(b); got != 127 {
		t.Errorf("ParseSwitches = %d, want 127", got)
	}
}

// TestSwitchesCountsEveryThread: a thread of ours that sleeps and wakes
// shows in the process's count, not only the main thread's.
func TestSwitchesCountsEveryThread(t *testing.T) {
	// Two goroutines hold a thread each until the count is read (a thread
	// that exited is not counted); at most one of them is the main thread,
	// whose switches /proc/PID/status alone would show. The other sleeps.
	type locked struct {
		tid   int
		sleep chan struct{}
	}
	ready, slept, exit := make(chan locked), make(chan struct{}), make(chan struct{})
	defer close(exit)
	for range 2 {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			l := locked{tid: unix.Gettid(), sleep: make(chan struct{})}
			ready <- l
			select {
			case <-l.sleep:
				for range 50 {
					time.Sleep(100 * time.Microsecond)
				}
				slept <- struct{}{}
			case <-exit:
				return
			}
			<-exit
		}()
	}
	a, b := <-ready, <-ready
	sleeper := a
	if a.tid == os.Getpid() {
		sleeper = b
	}
	before, err := Switches(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	close(sleeper.sleep)
	<-slept
	after, err := Switches(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after < before+50 {
		t.Errorf("switches %d -> %d, want at least 50 more (thread %d, not the main one, slept 50 times)", before, after, sleeper.tid)
	}
}

func TestMappedUnder(t *testing.T) {
	maps := []byte(`55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 123 /usr/bin/python3
7f0000000000-7f0000100000 r--s 00000000 00:3a 7 /mnt/engram/layers/0/weight.safetensors
7f0000100000-7f0000200000 r--s 00100000 00:3a 7 /mnt/engram/layers/0/weight.safetensors
7f0000200000-7f0000300000 r--s 00000000 00:3a 9 /mnt/engram/layers/1/a b.safetensors
7f0000300000-7f0000400000 r--s 00000000 00:3b 4 /mnt/engramx/layers/0/weight.safetensors
7f0000400000-7f0000500000 rw-p 00000000 00:00 0 
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
`)
	got := MappedUnder(maps, "/mnt/engram/")
	want := []string{"/mnt/engram/layers/0/weight.safetensors", "/mnt/engram/layers/1/a b.safetensors"}
	if !slices.Equal(got, want) {
		t.Errorf("MappedUnder = %q, want %q", got, want)
	}
}

// TestMappers finds this process by a file it maps under a directory, and
// nobody under a sibling directory whose name extends it.
func TestMappers(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "table")
	if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	ms, err := Mappers(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 1 || ms[0].Pid != os.Getpid() || !slices.Equal(ms[0].Files, []string{p}) || ms[0].Comm == "" {
		t.Errorf("Mappers(%s) = %+v, want this process (%d) mapping %s", dir, ms, os.Getpid(), p)
	}
	if ms, _ := Mappers(dir[:len(dir)-1]); len(ms) != 0 {
		t.Errorf("Mappers of a prefix of the directory's name = %+v, want none", ms)
	}
}

func TestTopAndCovering(t *testing.T) {
	info := []byte(`22 1 0:21 / / rw - ext4 /dev/vda rw
40 22 0:40 / /mnt/engram rw,nosuid,nodev - fuse.engramfs /models/m rw,user_id=0
41 40 0:41 / /mnt/engram rw - tmpfs tmpfs rw
42 22 0:42 / /mnt/other rw - tmpfs tmpfs rw
`)
	ms := ParseMountinfo(info)
	if top, ok := Top(ms, "/mnt/engram"); !ok || top.ID != 41 || top.FSType != "tmpfs" {
		t.Errorf("Top(/mnt/engram) = %+v, %v; want the tmpfs (41) stacked on engramfs", top, ok)
	}
	eng, ok := ByID(ms, 40)
	if !ok || eng.Parent != 22 || eng.Dev != "0:40" || eng.FSType != "fuse.engramfs" {
		t.Fatalf("ByID(40) = %+v, %v", eng, ok)
	}
	if c, ok := Covering(ms, eng); !ok || c.ID != 41 {
		t.Errorf("Covering(engramfs) = %+v, %v; want 41", c, ok)
	}
	if _, ok := Covering(ms, ms[3]); ok {
		t.Error("an uncovered mount is covered")
	}
	if _, ok := Top(ms, "/mnt/none"); ok {
		t.Error("Top found a mount where there is none")
	}
	if _, ok := ByID(ms, 99); ok {
		t.Error("ByID found a mount that is gone")
	}
}

// ThreadStates lists every thread of a live process with its state.
func TestThreadStates(t *testing.T) {
	s, err := ThreadStates(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(s, ", ")
	me := strconv.Itoa(os.Getpid())
	for _, th := range got {
		f := strings.Fields(th)
		if len(f) < 2 || len(f[1]) != 1 || !strings.Contains("RSDTtZXIKWP", f[1]) {
			t.Fatalf("thread %q of %q: want TID STATE [WCHAN]", th, s)
		}
		if f[0] == me {
			return
		}
	}
	t.Fatalf("ThreadStates %q does not list the main thread %s", s, me)
}

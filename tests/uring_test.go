package tests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/testenv"
)

// Tests of the FUSE-over-io_uring transport (fs/uring). They need a kernel
// with the fuse module's enable_uring parameter and root to set it; they
// set it for the test and put the old value back (setting it only lets new
// mounts ask for rings). Elsewhere they skip, saying why.

const enableUringParam = "/sys/module/fuse/parameters/enable_uring"

// setEnableUring sets the fuse module's enable_uring to on for the rest of
// the test, or skips the test where that cannot be done.
func setEnableUring(t testing.TB, on bool) {
	t.Helper()
	RequireFUSE(t)
	old, err := os.ReadFile(enableUringParam)
	if err != nil {
		t.Skipf("FUSE over io_uring unavailable: %v (Linux 6.14+ with CONFIG_FUSE_IO_URING)", err)
	}
	want := "N"
	if on {
		want = "Y"
	}
	if strings.TrimSpace(string(old)) == want {
		return
	}
	if err := os.WriteFile(enableUringParam, []byte(want), 0); err != nil {
		t.Skipf("cannot set %s (root only): %v", enableUringParam, err)
	}
	t.Cleanup(func() {
		if err := os.WriteFile(enableUringParam, old, 0); err != nil {
			t.Errorf("restoring %s: %v", enableUringParam, err)
		}
	})
}

// coreMountTests are the mount tests TestMountSuiteOnBothTransports runs
// again on the rings: bytes through
// read(2) and mmap, one page per cold fault, hints and barriers, several
// processes, backing errors, a killed daemon.
var coreMountTests = []struct {
	name string
	run  func(*testing.T)
}{
	{"EveryByteMatchesTheShards", TestEveryByteMatchesTheShards},
	{"MmapOnColdMountMatches", TestMmapOnColdMountMatches},
	{"ColdFaultCostsOnePage", TestColdFaultCostsOnePage},
	{"DecodeHintThenBarrierMakesRowsResident", TestDecodeHintThenBarrierMakesRowsResident},
	{"StepMakesRowsResident", TestStepMakesRowsResident},
	{"PrefillHintBecomesResidentWithoutWait", TestPrefillHintBecomesResidentWithoutWait},
	{"SeveralProcessesHintAtOnce", TestSeveralProcessesHintAtOnce},
	{"ReadBarrierIsNotHeldUpByAnotherProcess", TestReadBarrierIsNotHeldUpByAnotherProcess},
	{"BackingEIOFailsOnlyBadPages", TestBackingEIOFailsOnlyBadPages},
	{"RecoverAfterSIGKILL", TestRecoverAfterSIGKILL},
}

// TestMountSuiteOnBothTransports runs the core mount tests again on the
// rings (the rest of the suite runs on the default, /dev/fuse), setting
// enable_uring for the run where it is off.
func TestMountSuiteOnBothTransports(t *testing.T) {
	if fuseTransport != "" {
		t.Skipf("the whole suite runs on --fuse-transport %s (ENGRAMFS_FUSE_TRANSPORT)", fuseTransport)
	}
	setEnableUring(t, true)
	fuseTransport = "uring"
	t.Cleanup(func() { fuseTransport = "" })
	for _, c := range coreMountTests {
		t.Run("uring/"+c.name, c.run)
	}
}

// uringModel is a small model for the transport's own tests.
func uringModel(t *testing.T) string {
	spec := backing.DefaultSynth()
	spec.Rows = 1500
	return Synth(t, spec)
}

// TestUringServesAndSaysSo: with the rings on, the mount says so in stats,
// and what it serves is the shards' bytes, through read(2) and mmap, from
// threads on every CPU (a request goes to its CPU's queue).
func TestUringServesAndSaysSo(t *testing.T) {
	setEnableUring(t, true)
	d := Mount(t, uringModel(t), "--fuse-transport", "uring", "--cache-size", "0")
	if got := d.Stats(t).FuseTransport; got != "uring" {
		t.Fatalf("fuse_transport %q, want uring", got)
	}
	checkFromEveryCPU(t, d)
}

// checkFromEveryCPU reads every table of d, page by page, from one thread
// pinned to each CPU at a time, and compares with the shards.
func checkFromEveryCPU(t *testing.T, d *Daemon) {
	t.Helper()
	m := Model(t, d.ModelDir)
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, runtime.NumCPU()*len(m.Tables))
	var wg sync.WaitGroup
	for cpu := 0; cpu < 1024; cpu++ {
		if !set.IsSet(cpu) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var one unix.CPUSet
			one.Set(cpu)
			if err := unix.SchedSetaffinity(0, &one); err != nil {
				errs <- err
				return
			}
			for i, tb := range m.Tables {
				if i%set.Count() != cpu%set.Count() {
					continue // each CPU reads its share cold
				}
				errs <- readTableByPages(d, tb, ShardTable(t, d.ModelDir, tb.Name))
			}
		}()
	}
	waitOrFail(t, "reads from every CPU", &wg, 2*time.Minute)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// readTableByPages reads tb's data page by page with pread and compares.
func readTableByPages(d *Daemon, tb *backing.Table, want []byte) error {
	f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
	if err != nil {
		return err
	}
	defer f.Close()
	data := int64(len(tb.FileHeader))
	buf := make([]byte, 4096)
	for off := int64(0); off < int64(len(want)); off += 4096 {
		n, err := f.ReadAt(buf, data+off)
		if err != nil && n < len(want[off:min(off+4096, int64(len(want)))]) {
			return fmt.Errorf("%s at %d: %w", tb.Path(), off, err)
		}
		if w := want[off:min(off+4096, int64(len(want)))]; !bytes.Equal(buf[:len(w)], w) {
			return fmt.Errorf("%s: page at %d differs from the shard", tb.Path(), off)
		}
	}
	return nil
}

// waitOrFail waits for wg, failing t after d.
func waitOrFail(t *testing.T, what string, wg *sync.WaitGroup, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: not done after %v", what, d)
	}
}

// TestUringFallsBackToDev: where the rings cannot be had, auto serves from
// /dev/fuse and says why in stats and the log, and uring refuses to mount.
// The second case gets past INIT with FUSE_OVER_IO_URING negotiated (the
// kernel then holds every request until every queue registers) and fails
// each queue's registration: the daemon must make the kernel give the
// rings up before it reports the mount up, or the mount would hang.
func TestUringFallsBackToDev(t *testing.T) {
	t.Run("enable_uring off", func(t *testing.T) {
		setEnableUring(t, false)
		dir := uringModel(t)
		d := Mount(t, dir, "--fuse-transport", "auto", "--cache-size", "0")
		if got := d.Stats(t).FuseTransport; !strings.HasPrefix(got, "dev: ") || !strings.Contains(got, "enable_uring") {
			t.Errorf("fuse_transport %q, want dev: and the reason (enable_uring)", got)
		}
		checkFromEveryCPU(t, d)
		refusedMount(t, dir, "enable_uring")
	})
	t.Run("registration refused", func(t *testing.T) {
		setEnableUring(t, true)
		d := MountWrapped(t, testenv.Refusing(t, "io_uring_register"), uringModel(t), "--fuse-transport", "auto", "--cache-size", "0")
		if got := d.Stats(t).FuseTransport; !strings.HasPrefix(got, "dev: ") || !strings.Contains(got, "io_uring_register") {
			t.Errorf("fuse_transport %q, want dev: and the reason (io_uring_register refused)", got)
		}
		if !strings.Contains(d.Log(), "not io_uring") {
			t.Errorf("no log line says the rings are not used:\n%s", d.Log())
		}
		checkFromEveryCPU(t, d)
	})
}

// refusedMount runs `engramfs mount --fuse-transport uring` where the rings
// cannot be had: it must exit with an error naming why, leaving nothing
// mounted.
func refusedMount(t *testing.T, dir, why string) {
	t.Helper()
	mp := testenv.PrivateTempDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, Binary(t), "mount", "--fuse-transport", "uring", "--cache-size", "0", dir, mp).CombinedOutput()
	if err == nil || ctx.Err() != nil {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
		t.Fatalf("mount --fuse-transport uring without rings: err %v, ctx %v, want a failure\n%s", err, ctx.Err(), out)
	}
	if !strings.Contains(string(out), why) {
		t.Errorf("the refusal does not say why (%s):\n%s", why, out)
	}
	if Mounted(mp) {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
		t.Errorf("a refused mount left %s mounted", mp)
	}
}

// TestUringInterruptEndsABarrier: a signal ends a read barrier served on
// a ring with EINTR. The kernel sends the INTERRUPT through /dev/fuse,
// whatever served the request; the daemon must find the request there.
func TestUringInterruptEndsABarrier(t *testing.T) {
	setEnableUring(t, true)
	// Every backing read takes 5 s: the barrier waits that long unless
	// interrupted.
	d := Mount(t, uringModel(t), "--fuse-transport", "uring", "--cache-size", "0", "--inject-faults", "latency=5s")
	script := `
import os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
os.write(fd, b"prefill 0 1 2 3\n")
class Interrupted(Exception): pass
def handler(*_): raise Interrupted()
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.3)
start = time.monotonic()
try:
    os.read(fd, 4096)
    print("returned after %.2fs" % (time.monotonic() - start))
except Interrupted:
    print("interrupted after %.2fs" % (time.monotonic() - start))
`
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "python3", "-c", script, filepath.Join(d.Mountpoint, ".engramfs", "control")).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	var after float64
	if _, err := fmt.Sscanf(strings.TrimPrefix(string(out), "interrupted after "), "%fs", &after); err != nil || !strings.HasPrefix(string(out), "interrupted") {
		t.Fatalf("barrier not interrupted: %s", out)
	}
	// Not a timing assertion on the machine's speed: without the
	// interrupt the read returns only once the 5 s reads are done.
	if after >= 4.5 {
		t.Fatalf("barrier interrupted only after %.2fs: the interrupt was lost and the read waited for the backing", after)
	}
}

// slowModel mounts a small model on the rings with every backing read
// taking latency.
func slowMount(t *testing.T, latency string) (*Daemon, *backing.Model) {
	t.Helper()
	setEnableUring(t, true)
	d := Mount(t, uringModel(t), "--fuse-transport", "uring", "--cache-size", "0", "--inject-faults", "latency="+latency)
	return d, Model(t, d.ModelDir)
}

// TestUringUnmountWithReadsInFlight: the daemon stops (SIGTERM: unmount)
// while readers on every CPU wait for slow pages. Nothing hangs: the daemon
// exits, the mount is gone (the harness checks both), and every read
// either fails or returns the shards' bytes.
func TestUringUnmountWithReadsInFlight(t *testing.T) {
	d, m := slowMount(t, "300ms")
	tb := m.Tables[0]
	want := ShardTable(t, d.ModelDir, tb.Name)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
			if err != nil {
				return // the mount went first
			}
			defer f.Close()
			off := int64(i) * 4096
			buf := make([]byte, 4096)
			if _, err := f.ReadAt(buf, int64(len(tb.FileHeader))+off); err == nil && !bytes.Equal(buf, want[off:off+4096]) {
				errs <- fmt.Errorf("page %d: wrong bytes during unmount", i)
			}
		}()
	}
	time.Sleep(100 * time.Millisecond) // the reads are in flight: each takes 300 ms
	d.Stop(t)
	waitOrFail(t, "readers of an unmounted mount", &wg, time.Minute)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestUringReaderKilledMidRequest: a reader killed while its READ waits on
// a ring leaves the queue serving: the same page, and others, read right
// afterwards from the same CPU.
func TestUringReaderKilledMidRequest(t *testing.T) {
	d, m := slowMount(t, "500ms")
	tb := m.Tables[0]
	path := filepath.Join(d.Mountpoint, tb.Path())
	for i := range 4 {
		cmd := exec.Command("dd", "if="+path, "of=/dev/null", "bs=4096", "count=1", fmt.Sprintf("skip=%d", 1+i))
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		_ = cmd.Process.Kill()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatal("a reader killed mid-request did not die")
		}
	}
	if err := readTableByPages(d, tb, ShardTable(t, d.ModelDir, tb.Name)[:8*4096]); err != nil {
		t.Fatal(err)
	}
}

// TestUringQueueThreadDescheduled: with every CPU busy with a spinning
// process, the queues' threads get the CPU only in turns; reads from every
// CPU still complete with the right bytes.
func TestUringQueueThreadDescheduled(t *testing.T) {
	setEnableUring(t, true)
	d := Mount(t, uringModel(t), "--fuse-transport", "uring", "--cache-size", "0")
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	for cpu := 0; cpu < 1024; cpu++ {
		if !set.IsSet(cpu) {
			continue
		}
		spin := exec.Command("sh", "-c", "while :; do :; done")
		if err := spin.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = spin.Process.Kill(); _ = spin.Wait() })
		var one unix.CPUSet
		one.Set(cpu)
		if err := unix.SchedSetaffinity(spin.Process.Pid, &one); err != nil {
			t.Fatal(err)
		}
	}
	checkFromEveryCPU(t, d)
}

// TestIdleUringMountIsNotIOWait: an idle mount on the rings must not count
// as iowait. Every queue thread sleeps in io_uring_enter beside its fetch
// commands, requests in flight for the kernel's accounting: before
// IORING_ENTER_NO_IOWAIT, an idle daemon on 2 CPUs put 129 threads in
// iowait (vmstat's "b" at 129, "wa" at 100%, the node's I/O pressure at
// 100%) for as long as it ran. Which threads sleep as iowait is not
// readable per thread here, so this compares the system's count of them
// (procs_blocked) with the daemon running idle and stopped (SIGSTOP takes
// its threads out of the wait), a few times in turn, so that the other
// I/O of the machine is in both.
func TestIdleUringMountIsNotIOWait(t *testing.T) {
	setEnableUring(t, true)
	d := Mount(t, uringModel(t), "--fuse-transport", "uring", "--cache-size", "0")
	tb := Model(t, d.ModelDir).Tables[0]
	if err := readTableByPages(d, tb, ShardTable(t, d.ModelDir, tb.Name)); err != nil {
		t.Fatal(err)
	}
	pid := d.Pid()
	t.Cleanup(func() { _ = unix.Kill(pid, unix.SIGCONT) })
	blocked := func() int {
		sum := 0
		for range 5 {
			b, err := os.ReadFile("/proc/stat")
			if err != nil {
				t.Fatal(err)
			}
			_, rest, _ := strings.Cut(string(b), "procs_blocked ")
			var n int
			fmt.Sscan(rest, &n)
			sum += n
			time.Sleep(20 * time.Millisecond)
		}
		return sum / 5
	}
	var diffs []int
	for range 5 {
		time.Sleep(200 * time.Millisecond) // asleep again after SIGCONT
		running := blocked()
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
		stopped := blocked()
		if err := unix.Kill(pid, unix.SIGCONT); err != nil {
			t.Fatal(err)
		}
		diffs = append(diffs, running-stopped)
	}
	slices.Sort(diffs)
	t.Logf("tasks in iowait, the daemon running idle less stopped: %v", diffs)
	if med := diffs[len(diffs)/2]; med >= 8 {
		t.Errorf("an idle daemon on the rings keeps %d threads in iowait (median of %v)", med, diffs)
	}
	// Still serving after the stops.
	if err := readTableByPages(d, tb, ShardTable(t, d.ModelDir, tb.Name)); err != nil {
		t.Fatal(err)
	}
}

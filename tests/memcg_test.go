package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/memcg"
	"github.com/engramfs/engramfs/internal/testenv"
)

// Memory cgroups around the daemon and its readers (issue 24). Each test
// makes its group below the test's own (internal/memcg) and starts the
// process to hold inside it through the group's wrapper, so its memory is
// charged there from its first page.

const memcgPrefix = "engramfs-memcg-e2e"

// newMemcg makes a memory cgroup of limit bytes for t; where the machine has
// none it skips (a failure under ENGRAMFS_REQUIRE_FUSE=1, like a missing
// FUSE: these tests are the only proof of the behaviour).
func newMemcg(t *testing.T, limit int64) *memcg.Group { return newMemcgB(t, limit) }

// newMemcgB is newMemcg for a test or a benchmark.
func newMemcgB(t testing.TB, limit int64) *memcg.Group {
	t.Helper()
	RequireFUSE(t)
	g, err := memcg.New(memcgPrefix, limit)
	if err != nil {
		if os.Getenv("ENGRAMFS_REQUIRE_FUSE") == "1" {
			t.Fatalf("no memory cgroup: %v", err)
		}
		t.Skipf("no memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		if err := g.Remove(); err != nil {
			t.Error(err)
		}
	})
	return g
}

// bigModel is a one-layer model of page-sized rows whose weight table is
// mib MiB (larger than the groups these tests run in); it returns the
// model's directory and its weight table.
func bigModel(t testing.TB, mib uint64) (string, *backing.Table) {
	t.Helper()
	spec := backing.DefaultSynth()
	spec.Layers, spec.Rows = 1, mib<<20/uint64(spec.WeightRow)
	dir := Synth(t, spec)
	for _, tb := range Model(t, dir).Tables {
		if tb.Kind == "weight" {
			return dir, tb
		}
	}
	t.Fatalf("no weight table in %s", dir)
	return "", nil
}

// TestMemcgDaemonTierFitsItsCgroup: the daemon in a 256 MiB memory cgroup
// with the default 1 GiB tier. Hinted pages are stored by the daemon, so
// they are charged to its group, and pinning them filled it with locked
// pages until every thread of the daemon sat in the group's reclaim (on
// v2: the whole mount stalled, ~500x slower, no kill, no log; here, on
// v1, the kernel killed the daemon at step 48 with 230 MiB locked, and the
// mount was left dead). Now the daemon
// reads its group's limit at start and clamps the tier to fit with
// headroom: 160 decode steps of 1,024 new rows each (640 MiB of pages,
// 2.5x the group) complete within a deadline that a stall misses by far,
// and the stats say the budget in force.
func TestMemcgDaemonTierFitsItsCgroup(t *testing.T) {
	const limit = 256 << 20
	g := newMemcg(t, limit)
	dir, weight := bigModel(t, 768)
	d := MountWrapped(t, g.Wrapper(), dir) // the default --cache-size, 1 GiB

	const steps, rowsPerStep = 160, 1024
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			h, err := client.Open(d.Mountpoint)
			if err != nil {
				return err
			}
			defer h.Close()
			f, err := os.Open(filepath.Join(d.Mountpoint, weight.Path()))
			if err != nil {
				return err
			}
			defer f.Close()
			rng := rand.New(rand.NewPCG(24, 1))
			perm := rng.Perm(int(weight.Rows))
			buf := make([]byte, weight.RowBytes)
			for s := range steps {
				rows := make([]uint64, rowsPerStep)
				for i := range rows {
					rows[i] = uint64(perm[s*rowsPerStep+i])
				}
				if err := h.Decode(0, rows); err != nil {
					return fmt.Errorf("step %d: %w", s, err)
				}
				st, err := h.Barrier()
				if err != nil {
					return fmt.Errorf("step %d: barrier: %w", s, err)
				}
				if st.Failed != 0 {
					return fmt.Errorf("step %d: barrier %+v", s, st)
				}
				for _, r := range rows { // the step's gather
					if _, err := f.ReadAt(buf, int64(weight.DataPage())*4096+int64(r)*weight.RowBytes); err != nil {
						return fmt.Errorf("step %d: row %d: %w", s, r, err)
					}
				}
			}
			return nil
		}()
	}()
	// Unstalled, the steps take ~10-40 s on the busy 2-core VM; stalled,
	// one step took longer than that.
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(4 * time.Minute):
		u, _ := g.Usage()
		t.Fatalf("%d decode steps not done in 4 minutes: the mount stalls in its cgroup's reclaim (%+v)\n%s", steps, u, d.Summary())
	}
	u, err := g.Usage()
	if err != nil {
		t.Fatal(err)
	}
	mem, _ := d.Mem()
	s := d.Stats(t)
	t.Logf("%d steps in %v; the daemon's group: %+v; the daemon: %+v; tier %d of %d MiB pinned, %d evictions, %d recharged, %d foreign\n%s",
		steps, time.Since(start).Round(time.Millisecond), u, mem, s.CacheUsedBytes>>20, s.CacheCapacityBytes>>20, s.CacheEvictions,
		s.CachePagesRecharged, s.CachePinForeign, d.Summary())
	if s.MemcgLimitBytes != limit {
		t.Errorf("memcg_limit_bytes %d, want the group's %d", s.MemcgLimitBytes, limit)
	}
	if s.CacheRequestedBytes != 1<<30 || s.CacheCapacityBytes <= 0 || s.CacheCapacityBytes > limit-minMemcgHeadroom {
		t.Errorf("cache_requested_bytes %d, cache_capacity_bytes %d: want 1 GiB asked and a budget within the group's %d less %d of headroom",
			s.CacheRequestedBytes, s.CacheCapacityBytes, limit, minMemcgHeadroom)
	}
	if s.CacheUsedBytes == 0 || s.CacheUsedBytes > s.CacheCapacityBytes {
		t.Errorf("cache_used_bytes %d: want pages pinned within the clamped budget %d", s.CacheUsedBytes, s.CacheCapacityBytes)
	}
	if !strings.Contains(d.Log(), "hot tier clamped to fit the memory cgroup") {
		t.Errorf("the clamp is not logged:\n%s", d.Summary())
	}
}

// minMemcgHeadroom is the least the daemon keeps free of its tier in its
// group (cmd/engramfs/limits.go: memcgHeadroom).
const minMemcgHeadroom = 64 << 20

// TestMemcgDaemonRefusesTierThatCannotFit: in a group too small for the
// headroom and the smallest tier, the mount is refused with a message that
// names the limit and what to do; with --cache-size 0 it mounts.
func TestMemcgDaemonRefusesTierThatCannotFit(t *testing.T) {
	g := newMemcg(t, 48<<20)
	dir := Synth(t, backing.DefaultSynth())
	// A daemon that mounts instead runs until stopped: stop it after a
	// minute (SIGTERM: it unmounts), which fails the test.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, Binary(t), "mount", dir, testenv.PrivateTempDir(t))
	cmd.Args = append(g.Wrapper(), cmd.Args...)
	cmd.Path = cmd.Args[0]
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "memory cgroup") || !strings.Contains(string(out), "--cache-size") {
		t.Fatalf("mount in a 48 MiB group with a 1 GiB tier: %v\n%s\nwant a refusal naming the cgroup limit and --cache-size", err, out)
	}
	d := MountWrapped(t, g.Wrapper(), dir, "--cache-size", "0")
	if s := d.Stats(t); s.MemcgLimitBytes != 48<<20 || s.CacheCapacityBytes != 0 {
		t.Errorf("with --cache-size 0: memcg_limit_bytes %d, cache_capacity_bytes %d", s.MemcgLimitBytes, s.CacheCapacityBytes)
	}
}

// readerEnv makes this test binary a reader process (TestMemcgReaderProcess):
// "TABLE_FILE PAGES".
const readerEnv = "ENGRAMFS_MEMCG_READER"

// TestMemcgReaderNotKilledByTier: a reader in a 128 MiB memory cgroup
// gathers random rows beside the default 1 GiB tier until it has faulted
// 4x its group's memory. The pages it faults are charged to its group;
// the tier pinned them in the daemon's mapping, where the reader's group
// could not reclaim them, and the kernel killed the reader once its group
// was full of them (~12 s; with --cache-size 0 it ran on). Now the pinner
// re-stores a page charged elsewhere from the daemon before it pins it:
// the reader finishes, its group holds no locked page, and the tier holds
// more than the reader's group could have.
func TestMemcgReaderNotKilledByTier(t *testing.T) {
	const limit = 128 << 20
	g := newMemcg(t, limit)
	dir, weight := bigModel(t, 4*limit>>20+64)
	d := Mount(t, dir)
	path := filepath.Join(d.Mountpoint, weight.Path())
	pages := 4 * limit / 4096

	out, err := runReader(t, g, path, pages)
	u, uerr := g.Usage()
	if uerr != nil {
		t.Fatal(uerr)
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL {
		t.Fatalf("the reader was killed (OOM) in its %d MiB group: %+v\n%s", limit>>20, u, out)
	}
	if err != nil || !strings.Contains(out, "READER DONE") {
		t.Fatalf("reader: %v\n%s", err, out)
	}
	s := d.Stats(t)
	if s.CacheUsedBytes <= limit {
		t.Errorf("cache_used_bytes %d: the tier should hold more than the reader's group (%d) could", s.CacheUsedBytes, limit)
	}
	if u.Unevictable > 4<<20 {
		t.Errorf("the reader's group holds %d bytes of locked pages: the tier's pins are charged to it (%+v)", u.Unevictable, u)
	}
	if s.CachePagesRecharged == 0 {
		t.Errorf("cache_pages_recharged 0: no faulted page was re-stored before its pin")
	}
	t.Logf("reader's group at the end: %+v; tier %d MiB pinned, %d pages re-stored, %d refused",
		u, s.CacheUsedBytes>>20, s.CachePagesRecharged, s.CachePinForeign)
}

// runReader runs TestMemcgReaderProcess in a process of its own, in g (nil:
// in this process's group), to fault pages distinct pages of the file at
// path; it returns the reader's output and how it exited.
func runReader(t testing.TB, g *memcg.Group, path string, pages int) (string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestMemcgReaderProcess$", "-test.v")
	if g != nil {
		cmd.Args = append(g.Wrapper(), cmd.Args...)
		cmd.Path = cmd.Args[0]
	}
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %d", readerEnv, path, pages))
	return runWithin(t, cmd, 5*time.Minute, fmt.Sprintf("the reader did not fault %d pages in 5 minutes", pages))
}

// BenchmarkMemcgPinCost is the daemon's CPU per page a reader faults and
// the tier pins: with the tier off, with the reader in the daemon's own
// group (every pin checks its page's group and finds it the daemon's),
// and with the reader in a group of its own (every pin stores its page
// again first). One iteration faults 32,768 random pages of a 160 MiB
// table once each, then waits until the tier has pinned them.
//
//	go test -run '^$' -bench MemcgPinCost -benchtime 3x ./tests
func BenchmarkMemcgPinCost(b *testing.B) {
	const pages = 32768
	for _, c := range []struct {
		name   string
		cache  string
		reader int64 // the reader's group's limit; 0: the daemon's group
	}{{"tier-off", "0", 0}, {"same-cgroup", "1GiB", 0}, {"reader-cgroup", "1GiB", 1 << 30}} {
		b.Run(c.name, func(b *testing.B) {
			var cpu time.Duration
			var pinned int64
			for range b.N {
				b.StopTimer()
				var g *memcg.Group
				if c.reader > 0 {
					g = newMemcgB(b, c.reader)
				}
				dir, weight := bigModel(b, 160)
				d := Mount(b, dir, "--cache-size", c.cache)
				path := filepath.Join(d.Mountpoint, weight.Path())
				cpu0 := CPU(b, d.Pid())
				b.StartTimer()
				if out, err := runReader(b, g, path, pages); err != nil {
					b.Fatalf("reader: %v\n%s", err, out)
				}
				if c.cache != "0" {
					for deadline := time.Now().Add(time.Minute); d.Stats(b).CacheUsedBytes < pages*4096; time.Sleep(10 * time.Millisecond) {
						if time.Now().After(deadline) {
							b.Fatalf("the tier pinned %d of %d pages in a minute", d.Stats(b).CacheUsedBytes/4096, pages)
						}
					}
				}
				b.StopTimer()
				cpu += CPU(b, d.Pid()) - cpu0
				s := d.Stats(b)
				pinned += s.CacheUsedBytes / 4096
				d.Stop(b)
			}
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N*pages), "daemon-ns/page")
			b.ReportMetric(float64(pinned)/float64(b.N), "pinned-pages")
		})
	}
}

// TestMemcgReaderProcess is the reader of TestMemcgReaderNotKilledByTier
// when readerEnv is set (a process of its own, in the reader's group); a
// no-op otherwise. It maps the table file and touches random pages until
// it has faulted the number of distinct pages asked.
func TestMemcgReaderProcess(t *testing.T) {
	arg := os.Getenv(readerEnv)
	if arg == "" {
		t.Skip("the reader of TestMemcgReaderNotKilledByTier")
	}
	path, n, _ := strings.Cut(arg, " ")
	want, err := strconv.Atoi(n)
	if err != nil {
		t.Fatal(err)
	}
	b := testenv.MapFile(t, path)
	if err := unix.Madvise(b, unix.MADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	pages := len(b) / 4096
	if want > pages {
		t.Fatalf("%d pages asked of a %d-page file", want, pages)
	}
	order := rand.New(rand.NewPCG(7, 24)).Perm(pages)[:want]
	start := time.Now()
	for i, p := range order {
		Touch(b, p*4096)
		if (i+1)%(want/8) == 0 {
			fmt.Printf("%d pages faulted in %v\n", i+1, time.Since(start).Round(time.Millisecond))
		}
	}
	fmt.Println("READER DONE")
}

package tests

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/testenv"
)

// dropCaches empties the page cache: only pinned pages survive.
func dropCaches(t testing.TB) {
	t.Helper()
	syscall.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
		t.Fatalf("drop_caches: %v", err)
	}
}

// zipfRows draws decode steps of Zipf-popular rows: rank r has weight
// ~1/r^s (Go's Zipf needs s > 1; the workload's 0.8-1.0 is close), ranks
// scattered over the table by a fixed permutation, as hashes scatter them.
type zipfRows struct {
	z    *rand.Zipf
	perm []uint64
}

func newZipfRows(seed uint64, rows uint64) *zipfRows {
	rng := rand.New(rand.NewPCG(seed, 99))
	perm := make([]uint64, rows)
	for i := range perm {
		perm[i] = uint64(i)
	}
	rng.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	return &zipfRows{z: rand.NewZipf(rng, 1.05, 1, rows-1), perm: perm}
}

func (z *zipfRows) step(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = z.perm[z.z.Uint64()]
	}
	return out
}

// decodeStep hints rows as one decode step and waits for the barrier.
func decodeStep(t testing.TB, ctl *os.File, layer int, rows []uint64) {
	t.Helper()
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, layer, rows)); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); err != nil {
		t.Fatal(err)
	}
}

// settle waits until the hot tier's pinned bytes stop changing: pins and
// unpins are applied by the tier's own goroutine, after the barrier.
func settle(t testing.TB, d *Daemon) {
	t.Helper()
	last, stableSince := int64(-1), time.Now()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		used := d.Stats(t).CacheUsedBytes
		if used != last {
			last, stableSince = used, time.Now()
		} else if time.Since(stableSince) > 300*time.Millisecond {
			return
		}
	}
	t.Fatalf("hot tier did not settle")
}

// lockedBytes is the daemon's locked, resident memory: "Locked" of its
// smaps_rollup (VmLck counts the whole MLOCK_ONFAULT mappings of the tier).
func lockedBytes(t testing.TB, d *Daemon) int64 {
	t.Helper()
	return mustProcBytes(t, d.Pid(), "smaps_rollup", "Locked")
}

// vmas is the daemon's number of mappings.
func vmas(t testing.TB, d *Daemon) int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(d.Pid()) + "/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "\n")
}

func TestHotTierBudgetHolds(t *testing.T) {
	spec := geometries()["4096B"]
	spec.Rows = 8000
	const capacity = 2 << 20
	d := Mount(t, Synth(t, spec), "--cache-size", "2MiB")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	ctl := openControl(t, d)
	rng := rand.New(rand.NewPCG(30, 31))
	check := func(when string) {
		st := d.Stats(t)
		if st.CacheCapacityBytes != capacity || !st.CachePinned {
			t.Fatalf("cache capacity %d pinned %v, want %d and true", st.CacheCapacityBytes, st.CachePinned, capacity)
		}
		if st.CacheUsedBytes > capacity {
			t.Fatalf("%s: cache_used_bytes %d over the capacity %d", when, st.CacheUsedBytes, capacity)
		}
		// Plus the fault-around neighbours of a pin in progress, locked until
		// the pinner trims them (cache.MaxTransientPages).
		if lck := lockedBytes(t, d); lck > capacity+cache.MaxTransientPages*4096 {
			t.Fatalf("%s: daemon's locked memory %d bytes over the capacity %d", when, lck, capacity)
		}
	}
	// Decode hints and demand faults over far more pages than fit.
	for step := 0; step < 60; step++ {
		decodeStep(t, ctl, 0, randomRows(rng, 72, spec.Rows))
		for tb, b := range maps {
			for range 20 {
				Touch(b, int(tb.DataPage()+rng.Uint64N(tb.Pages()-tb.DataPage()))*4096)
			}
		}
		check("during the trace")
	}
	settle(t, d)
	check("after the trace")
	// Pinning must not fragment the daemon's mappings: pinning page by page
	// with mlock once split a VMA per page until mmap failed.
	if n := vmas(t, d); n > 2000 {
		t.Fatalf("daemon has %d mappings after pinning and evicting thousands of pages", n)
	}
	st := d.Stats(t)
	if st.CacheEvictions == 0 || st.CacheUsedBytes < capacity/2 {
		t.Fatalf("a trace over %d rows into a 2 MiB tier: %d evictions, %d bytes pinned; want evictions and a full tier", spec.Rows, st.CacheEvictions, st.CacheUsedBytes)
	}
}

// pagesOf lists the pages of tb that hold rows.
func pagesOf(tb *backing.Table, rows []uint64) []uint64 {
	var out []uint64
	for _, r := range rows {
		first, last := tb.RowPages(r)
		for p := first; p <= last; p++ {
			out = append(out, p)
		}
	}
	return out
}

func TestHotSetSurvivesAScanAndDropCaches(t *testing.T) {
	for _, scan := range []string{"prefill hints", "demand faults"} {
		t.Run(scan, func(t *testing.T) {
			spec := geometries()["flash"]
			spec.Rows = 120000 // 7,500 weight pages and 235 scale pages a layer
			d := Mount(t, Synth(t, spec), "--cache-size", "16MiB")
			m := Model(t, d.ModelDir)
			maps := layerMaps(t, d, m, 0)
			ctl := openControl(t, d)

			// Decode: 200 steps of 72 Zipf-popular rows.
			z := newZipfRows(40, spec.Rows)
			hits := map[*backing.Table]map[uint64]int{}
			var traced []uint64
			for range 200 {
				rows := z.step(72)
				decodeStep(t, ctl, 0, rows)
				traced = append(traced, rows...)
				for tb := range maps {
					if hits[tb] == nil {
						hits[tb] = map[uint64]int{}
					}
					for _, p := range pagesOf(tb, rows) {
						hits[tb][p]++
					}
				}
			}
			settle(t, d)
			dropCaches(t)
			// The decode-hot set: pages the trace touched more than once that
			// the tier pinned (they survived drop_caches).
			hot := map[*backing.Table][]uint64{}
			nhot := 0
			for tb, b := range maps {
				res := resident(t, b)
				for p, n := range hits[tb] {
					if n >= 2 && res[p] {
						hot[tb] = append(hot[tb], p)
						nhot++
					}
				}
			}
			if nhot < 500 {
				t.Fatalf("only %d decode-hot pages pinned after the trace", nhot)
			}

			// Gathering the hot rows after drop_caches: no FUSE read, no
			// backing I/O.
			res := map[*backing.Table][]bool{}
			for tb, b := range maps {
				res[tb] = resident(t, b)
			}
			var hotRows []uint64
			for _, r := range traced {
				all := true
				for tb := range maps {
					for _, p := range pagesOf(tb, []uint64{r}) {
						all = all && res[tb][p]
					}
				}
				if all {
					hotRows = append(hotRows, r)
				}
			}
			before := d.Stats(t)
			gatherAndCheck(t, d, maps, hotRows)
			after := d.Stats(t)
			if after.FuseReads != before.FuseReads || after.BackingReads != before.BackingReads {
				t.Fatalf("gathering %d pinned rows after drop_caches: %d FUSE reads, %d backing reads; want none",
					len(hotRows), after.FuseReads-before.FuseReads, after.BackingReads-before.BackingReads)
			}
			// ... and rows that are not pinned do go back to FUSE.
			cold := 0
			for r := uint64(0); r < spec.Rows && cold < 50; r += 997 {
				for tb, b := range maps {
					first, _ := tb.RowPages(r)
					if !resident(t, b)[first] {
						Touch(b, int(first)*4096)
						cold++
					}
				}
			}
			if got := d.Stats(t).FuseReads - after.FuseReads; cold == 0 || got < uint64(cold) {
				t.Fatalf("touching %d unpinned pages after drop_caches caused %d FUSE reads", cold, got)
			}

			// A one-pass scan of 100,000 rows.
			scanRows := make([]uint64, 100000)
			for i := range scanRows {
				scanRows[i] = uint64(i)
			}
			if scan == "prefill hints" {
				for i := 0; i < len(scanRows); i += 8192 {
					if _, err := ctl.Write(hints.AppendBinary(nil, hints.Prefill, 0, scanRows[i:min(i+8192, len(scanRows))])); err != nil {
						t.Fatal(err)
					}
				}
				if err := ctl.Sync(); err != nil {
					t.Fatal(err)
				}
			} else {
				for tb, b := range maps {
					_, last := tb.RowPages(scanRows[len(scanRows)-1])
					for p := tb.DataPage(); p <= last; p++ {
						Touch(b, int(p)*4096)
					}
				}
			}
			settle(t, d)
			dropCaches(t)
			kept := 0
			for tb, b := range maps {
				res := resident(t, b)
				for _, p := range hot[tb] {
					if res[p] {
						kept++
					}
				}
			}
			t.Logf("%d of %d decode-hot pages still pinned after a %s scan of 100,000 rows; stats %+v", kept, nhot, scan, d.Stats(t))
			if kept*10 < nhot*9 {
				t.Fatalf("the scan flushed the hot set: %d of %d decode-hot pages kept, want at least 90%%", kept, nhot)
			}
		})
	}
}

func TestUnmountWithPinnedPages(t *testing.T) {
	for _, how := range []string{"SIGTERM", "SIGINT", "engramfs unmount"} {
		t.Run(how, func(t *testing.T) {
			spec := geometries()["4096B"]
			d := Mount(t, Synth(t, spec), "--cache-size", "1MiB")
			maps := layerMaps(t, d, Model(t, d.ModelDir), 0)
			decodeStep(t, openControl(t, d), 0, []uint64{1, 2, 3, 500, 1000})
			settle(t, d)
			if d.Stats(t).CacheUsedBytes == 0 || lockedBytes(t, d) == 0 {
				t.Fatalf("nothing pinned")
			}
			for _, b := range maps { // readers go away, as they do in an orderly shutdown
				if err := unix.Munmap(b); err != nil {
					t.Fatal(err)
				}
			}
			switch how {
			case "SIGTERM":
				_ = d.Signal(syscall.SIGTERM)
			case "SIGINT":
				_ = d.Signal(syscall.SIGINT)
			default:
				if out, err := exec.Command(Binary(t), "unmount", d.Mountpoint).CombinedOutput(); err != nil {
					t.Fatalf("engramfs unmount: %v\n%s", err, out)
				}
			}
			select {
			case <-d.Exited():
			case <-time.After(10 * time.Second):
				t.Fatalf("daemon still running 10 s after %s\n%s", how, d.Log())
			}
			if err := d.ExitErr(); err != nil {
				t.Fatalf("daemon exited with %v after %s\n%s", err, how, d.Log())
			}
			if Mounted(d.Mountpoint) {
				t.Fatalf("%s left the mount behind", how)
			}
		})
	}
}

func TestConcurrentReadersHintsAndEvictions(t *testing.T) {
	spec := geometries()["flash"]
	spec.Rows = 60000
	d := Mount(t, Synth(t, spec), "--cache-size", "512KiB")
	m := Model(t, d.ModelDir)
	want := map[string][]byte{}
	for _, tb := range m.Tables {
		want[tb.Name] = ShardTable(t, d.ModelDir, tb.Name)
	}
	stop := time.Now().Add(3 * time.Second)
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for i := range 4 { // readers
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 50))
			layer := i % 2
			maps := map[*backing.Table][]byte{}
			for _, tb := range m.LayerTables(layer) {
				maps[tb] = testenv.MapFile(t, filepath.Join(d.Mountpoint, tb.Path()))
			}
			for time.Now().Before(stop) {
				r := rng.Uint64N(spec.Rows)
				for tb, b := range maps {
					lo := uint64(len(tb.FileHeader)) + r*uint64(tb.RowBytes)
					if string(b[lo:lo+uint64(tb.RowBytes)]) != string(want[tb.Name][r*uint64(tb.RowBytes):(r+1)*uint64(tb.RowBytes)]) {
						errs <- tb.Path() + ": wrong bytes"
						return
					}
				}
			}
		}(i)
	}
	for i := range 2 { // hinters
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			f, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_WRONLY, 0)
			if err != nil {
				errs <- err.Error()
				return
			}
			defer f.Close()
			rng := rand.New(rand.NewPCG(uint64(i), 60))
			for time.Now().Before(stop) {
				class := hints.Class(rng.IntN(2))
				if _, err := f.Write(hints.AppendBinary(nil, class, rng.IntN(2), randomRows(rng, 200, spec.Rows))); err != nil {
					errs <- err.Error()
					return
				}
				if err := f.Sync(); err != nil {
					errs <- err.Error()
					return
				}
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	st := d.Stats(t)
	if st.CacheEvictions == 0 || st.CacheUsedBytes > 512<<10 {
		t.Fatalf("want evictions within the 512 KiB budget: %+v", st)
	}
	if strings.Contains(d.Log(), "DATA RACE") {
		t.Fatalf("the daemon reported a data race:\n%s", d.Log())
	}
}

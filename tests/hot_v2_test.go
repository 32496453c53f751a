package tests

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/procfs"
)

// capsh drops a capability from the bounding set before exec'ing bash, which
// sets a ulimit and execs the daemon: the daemon keeps the wrapper's pid.
const capsh = "/usr/sbin/capsh"

func withoutIPCLock(memlockKiB int) []string {
	return []string{capsh, "--drop=cap_ipc_lock", "--", "-c",
		"ulimit -l " + strconv.Itoa(memlockKiB) + ` && exec "$0" "$@"`}
}

// procStatusField is one line of /proc/pid/status, without its key.
func procStatusField(t testing.TB, pid int, key string) string {
	t.Helper()
	v, err := procfs.StatusField(pid, key)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestHotTierUnpinnedWithoutCapIPCLock runs the daemon as Docker and
// Kubernetes do by default: without CAP_IPC_LOCK, with an RLIMIT_MEMLOCK
// (64 KiB) far below the table files. mlock2(MLOCK_ONFAULT) of a table's
// mapping would fail with ENOMEM; the tier must say it runs unpinned (one
// warning at mount, cache_mode "unpinned"), lock nothing, report nothing
// pinned, and so never let prefetch skip a page as pinned: after a cache drop,
// hinting the same rows again makes them resident again. Pages that are
// cached are still skipped, found without the mapping.
func TestHotTierUnpinnedWithoutCapIPCLock(t *testing.T) {
	if _, err := os.Stat(capsh); err != nil {
		t.Skipf("%s: %v", capsh, err)
	}
	spec := geometries()["4096B"]
	d := MountWrapped(t, withoutIPCLock(64), Synth(t, spec), "--cache-size", "2MiB")
	pid := d.Pid()
	capEff, err := strconv.ParseUint(procStatusField(t, pid, "CapEff"), 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	const capIPCLock = 14
	if capEff&(1<<capIPCLock) != 0 {
		t.Fatalf("the daemon has CAP_IPC_LOCK (CapEff %x): the wrapper did not drop it", capEff)
	}
	if lim, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/limits"); err != nil || !strings.Contains(string(lim), "Max locked memory         65536") {
		t.Fatalf("RLIMIT_MEMLOCK of the daemon is not 64 KiB: %v\n%s", err, lim)
	}
	st := d.Stats(t)
	if st.CacheMode != "unpinned" || st.CachePinned {
		t.Fatalf("at mount: cache_mode %q cache_pinned %v, want unpinned", st.CacheMode, st.CachePinned)
	}
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	ctl := openControl(t, d)
	rows := randomRows(rand.New(rand.NewPCG(12, 1)), 200, spec.Rows)
	for range 3 { // hinted again and again: hot, admitted, promoted
		decodeStep(t, ctl, 0, rows)
	}
	st = d.Stats(t)
	if st.CacheUsedBytes != 0 || st.CacheHits == 0 {
		t.Fatalf("unpinned tier after 3 decode steps: cache_used_bytes %d (want 0), cache_hits %d (want the policy running)", st.CacheUsedBytes, st.CacheHits)
	}
	if lck := lockedBytes(t, d); lck != 0 {
		t.Fatalf("the daemon has %d bytes locked without CAP_IPC_LOCK", lck)
	}
	// Unpinned, hints still skip what is cached (cachestat on the
	// daemon's own descriptor; there is no locked mapping to ask mincore
	// of): the same step again reads and stores nothing.
	untilNoOutsideDrop(t, "a decode step of cached rows, unpinned", func() error {
		before := d.Stats(t)
		decodeStep(t, ctl, 0, rows)
		after := d.Stats(t)
		reads, stored := after.BackingReads-before.BackingReads, after.PrefetchPagesStored-before.PrefetchPagesStored
		cached := after.PrefetchDecodePagesCached - before.PrefetchDecodePagesCached
		if reads != 0 || stored != 0 || cached == 0 {
			return fmt.Errorf("a decode step of rows the last steps made resident: %d backing reads, %d pages stored, %d counted cached; want 0, 0 and all", reads, stored, cached)
		}
		return nil
	})
	dropCaches(t)
	untilNoOutsideDrop(t, "after the barrier (did prefetch skip pages it believed pinned?)", func() error {
		decodeStep(t, ctl, 0, rows)
		return allResident(t, maps, rows)
	})
	if n := strings.Count(d.Log(), "mlock refused"); n != 1 {
		t.Fatalf("%d 'mlock refused' warnings, want exactly 1:\n%s", n, d.Log())
	}
}

// waitLockedEqualsPinned waits (bounded, not timed) until the daemon's
// locked memory equals cache_used_bytes, and fails if it never does.
func waitLockedEqualsPinned(t testing.TB, d *Daemon, capacity int64, when string) {
	t.Helper()
	var lck, used int64
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		st := d.Stats(t)
		lck, used = lockedBytes(t, d), st.CacheUsedBytes
		if used > capacity {
			t.Fatalf("%s: cache_used_bytes %d over the capacity %d", when, used, capacity)
		}
		if lck == used && st.CachePinned {
			return
		}
	}
	t.Fatalf("%s: the daemon has %d bytes locked, the tier %d pinned (%d pages apart)", when, lck, used, (lck-used)/4096)
}

// TestHotTierLockedEqualsPinned: with every page of the table files cached
// (warm neighbours for fault-around and large folios to map), after every
// batch of decode hints and faults the daemon's locked memory (smaps Locked)
// is exactly the tier's pinned pages: no neighbour stays locked, on pin or
// on unpin.
//
// The test reads with pread, never mmap: smaps' Locked is proportional (a
// page the test process maps too counts half in the daemon's Locked).
func TestHotTierLockedEqualsPinned(t *testing.T) {
	spec := geometries()["4096B"]
	spec.Rows = 4000
	const capacity = 1 << 20
	d := Mount(t, Synth(t, spec), "--cache-size", "1MiB")
	m := Model(t, d.ModelDir)
	files := map[*backing.Table]*os.File{}
	for _, tb := range m.LayerTables(0) {
		f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		files[tb] = f
	}
	page := make([]byte, 4096)
	read := func(f *os.File, p uint64) {
		if _, err := f.ReadAt(page, int64(p)*4096); err != nil {
			t.Fatal(err)
		}
	}
	for tb, f := range files { // warm every page (and fill the tier with faults)
		for p := uint64(0); p < tb.Pages(); p++ {
			read(f, p)
		}
	}
	waitLockedEqualsPinned(t, d, capacity, "after warming")
	ctl := openControl(t, d)
	rng := rand.New(rand.NewPCG(70, 71))
	z := newZipfRows(72, spec.Rows)
	for step := range 12 {
		rows := z.step(72)
		if step%4 == 3 {
			rows = randomRows(rng, 300, spec.Rows) // a burst of new pages: evictions
		}
		decodeStep(t, ctl, 0, rows)
		for tb, f := range files {
			read(f, tb.DataPage()+rng.Uint64N(tb.Pages()-tb.DataPage()))
		}
		waitLockedEqualsPinned(t, d, capacity, "step "+strconv.Itoa(step))
	}
	if st := d.Stats(t); st.CacheEvictions == 0 || st.CacheUsedBytes == 0 {
		t.Fatalf("want pins and evictions: %+v", st)
	}
}

// TestHotTierDecodeWorkingSetFitsIsAllPinned: decode-hinting a working set
// larger than the old pin queue (16K pages) that fits the budget pins every
// page of it, and nothing is dropped.
func TestHotTierDecodeWorkingSetFitsIsAllPinned(t *testing.T) {
	spec := geometries()["4096B"]
	spec.Rows = 20000 // 20,000 weight pages and 625 scale pages a layer
	d := Mount(t, Synth(t, spec), "--cache-size", "128MiB")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	ctl := openControl(t, d)
	rows := make([]uint64, spec.Rows)
	for i := range rows {
		rows[i] = uint64(i)
	}
	decodeStep(t, ctl, 0, rows) // one hint of every row
	want := int64(0)
	for tb := range maps {
		want += int64(tb.Pages()-tb.DataPage()) * 4096
	}
	var st = d.Stats(t)
	for deadline := time.Now().Add(60 * time.Second); st.CacheUsedBytes < want && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		st = d.Stats(t)
	}
	if st.CachePinDropped != 0 || st.CacheUsedBytes < want {
		t.Fatalf("decode hint of %d rows (%d bytes of pages) into 128 MiB: %d bytes pinned, %d pins dropped", len(rows), want, st.CacheUsedBytes, st.CachePinDropped)
	}
}

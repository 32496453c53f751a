package tests

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/procfs"
)

// dropCount is /proc/vmstat's drop_pagecache: how many times anyone on this
// machine has written to /proc/sys/vm/drop_caches since boot.
func dropCount(t testing.TB) uint64 { return vmstat(t, "drop_pagecache") }

// refaultCount is /proc/vmstat's workingset_refault_file: how many file
// pages that the kernel's reclaim evicted were read in again, machine-wide.
// Each CPU batches its part of the count; /proc/sys/vm/stat_refresh (root)
// folds them in first, or a refault a moment ago may not show.
func refaultCount(t testing.TB) uint64 {
	t.Helper()
	if err := os.WriteFile("/proc/sys/vm/stat_refresh", []byte("1"), 0); err != nil {
		t.Logf("vmstat refresh: %v", err)
	}
	return vmstat(t, "workingset_refault_file")
}

// vmstat is the /proc/vmstat counter called name.
func vmstat(t testing.TB, name string) uint64 {
	t.Helper()
	vm, err := procfs.VMStat()
	if err != nil {
		t.Fatalf("vmstat: %v", err)
	}
	return vm[name]
}

// errReclaimed marks a residency check that failed only on pages the
// kernel's reclaim evicted (each has a shadow entry in its file's page
// cache). These VMs reclaim page cache on their own, with no memory
// pressure (kdamond: half of an idle file's cached pages within a quarter
// of an hour; see the kernel facts in docs/design.md): an unpinned page
// engramfs did make resident may be gone a second later. drop_caches, an
// invalidation (NOTIFY_INVAL_INODE, truncation) or a page never stored
// leave no shadow.
var errReclaimed = errors.New("every missing page was reclaimed by the kernel (a shadow entry in its place), not dropped or never stored")

// allReclaimed reports whether each of pages (of the shared file mapping b)
// holds a shadow entry in the page cache of b's file: it was cached, and the
// kernel's reclaim evicted it. False when that cannot be told.
func allReclaimed(t testing.TB, b []byte, pages []uint64) bool {
	t.Helper()
	r := reclaimedPages(t, b, pages)
	for _, p := range pages {
		if !r[p] {
			return false
		}
	}
	return true
}

// reclaimedPages is the set of pages (of the shared file mapping b) that
// hold a shadow entry in the page cache of b's file; nil when that cannot be
// told (logged). Ask before anything reads them: a read takes the shadow.
func reclaimedPages(t testing.TB, b []byte, pages []uint64) map[uint64]bool {
	t.Helper()
	path, err := mappedPath(b)
	if err != nil {
		t.Logf("whether the missing pages were reclaimed: %v", err)
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		t.Logf("whether the missing pages were reclaimed: %v", err)
		return nil
	}
	defer f.Close()
	out := map[uint64]bool{}
	for _, p := range pages {
		r := unix.CachestatRange{Off: p * 4096, Len: 4096}
		var cs unix.Cachestat_t
		if err := unix.Cachestat(uint(f.Fd()), &r, &cs, 0); err != nil {
			t.Logf("whether the missing pages were reclaimed: cachestat: %v", err)
			return nil
		}
		if cs.Evicted != 0 {
			out[p] = true
		}
	}
	return out
}

// mappedPath is the path of the file mapped at b, from /proc/self/maps.
func mappedPath(b []byte) (string, error) {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return "", err
	}
	defer f.Close()
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, start) {
			continue
		}
		// address perms offset dev inode path
		fields := strings.SplitN(line, " ", 6)
		if len(fields) == 6 {
			if path := strings.TrimSpace(fields[5]); strings.HasPrefix(path, "/") {
				return path, nil
			}
		}
		return "", fmt.Errorf("the mapping at %s is of no file: %q", start, line)
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("no mapping at %s in /proc/self/maps", start)
}

// outsideEviction reports whether a residency check's failure err cannot be
// judged: the page cache was dropped from outside since dropCount read
// drops, or every page it missed was reclaimed by the kernel.
func outsideEviction(t testing.TB, err error, drops uint64) bool {
	return dropCount(t) != drops || errors.Is(err, errReclaimed)
}

// maxOutsideDrops bounds how often untilNoOutsideDrop tries again.
const maxOutsideDrops = 10

// untilNoOutsideDrop runs attempt (send hints, then check that their pages
// are resident) until it passes. A failure fails the test at once unless the
// page cache was dropped while attempt ran, or the pages it missed were all
// reclaimed by the kernel (errReclaimed): a benchmark or another test run
// beside this one (engramfs bench drops caches before every path), or these
// VMs' own reclaim, evicts unpinned pages that engramfs did make resident,
// and no filesystem can prevent that. Such an attempt is logged and run
// again, at most maxOutsideDrops times. Call it only where this test
// process drops nothing itself while attempt runs.
func untilNoOutsideDrop(t testing.TB, what string, attempt func() error) {
	t.Helper()
	for try := 1; ; try++ {
		before := dropCount(t)
		err := attempt()
		if err == nil {
			return
		}
		if !outsideEviction(t, err, before) {
			t.Fatalf("%s: %v", what, err)
		}
		if try == maxOutsideDrops {
			t.Fatalf("%s: %v (pages were evicted from outside during each of %d attempts)", what, err, try)
		}
		t.Logf("%s: %v; pages were evicted from outside meanwhile: trying again", what, err)
	}
}

// checkHintedResident checks that the pages of rows are resident in maps
// (rows of layer, hinted and waited for since dropCount read drops).
func checkHintedResident(t testing.TB, d *Daemon, layer int, maps map[*backing.Table][]byte, rows []uint64, drops uint64, what string) {
	t.Helper()
	checkHinted(t, d, layer, rows, drops, what, func() error { return allResident(t, maps, rows) })
}

// checkHintedServed checks, as checkHintedResident, that the pages of rows
// are resident, and then that gathering them gives their bytes without
// reaching FUSE.
func checkHintedServed(t testing.TB, d *Daemon, layer int, maps map[*backing.Table][]byte, rows []uint64, drops uint64, what string) {
	t.Helper()
	checkHinted(t, d, layer, rows, drops, what, func() error {
		if err := allResident(t, maps, rows); err != nil {
			return err
		}
		return gatherFromMemoryErr(t, d, maps, rows)
	})
}

// checkHinted runs check on rows of layer, hinted and waited for since
// dropCount read drops. If it fails and the page cache was dropped from
// outside since, that check cannot be judged: the rows are hinted again, as
// decode frames and their barrier on a fresh control handle, and checked
// again (untilNoOutsideDrop). With no outside drop a failure fails the test
// at once.
func checkHinted(t testing.TB, d *Daemon, layer int, rows []uint64, drops uint64, what string, check func() error) {
	t.Helper()
	err := check()
	if err == nil {
		return
	}
	if !outsideEviction(t, err, drops) {
		t.Fatalf("%s: %v", what, err)
	}
	t.Logf("%s: %v; pages were evicted from outside meanwhile: hinting again", what, err)
	untilNoOutsideDrop(t, what, func() error {
		ctl, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer ctl.Close()
		for i := 0; i < len(rows); i += hints.MaxRowsPerFrame {
			if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, layer, rows[i:min(i+hints.MaxRowsPerFrame, len(rows))])); err != nil {
				t.Fatal(err)
			}
		}
		if err := ctl.Sync(); err != nil {
			t.Fatalf("barrier: %v", err)
		}
		return check()
	})
}

// The residency checks tell the kernel's reclaim (a shadow entry left in
// the page's place: retried, see errReclaimed) from a page dropped by
// invalidation (judged): a page reclaimed by MADV_PAGEOUT is errReclaimed,
// and so is the FUSE read of a gather that refaults it; a page dropped by
// POSIX_FADV_DONTNEED (no shadow) is not.
func TestResidencyCheckTellsReclaimFromDrop(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	var tb *backing.Table
	for _, x := range m.LayerTables(0) {
		if tb == nil || x.RowBytes > tb.RowBytes {
			tb = x
		}
	}
	maps := map[*backing.Table][]byte{tb: layerMaps(t, d, m, 0)[tb]}
	rows := randomRows(rand.New(rand.NewPCG(81, 82)), 2, spec.Rows)
	// Faulted in, and again where the machine's reclaim took a page first.
	for try := 1; ; try++ {
		faultInFromAnotherProcess(t, d, m, 0, rows)
		err := allResident(t, maps, rows)
		if err == nil {
			break
		}
		if try == 3 {
			t.Fatalf("rows read by another process: %v", err)
		}
	}
	b := maps[tb]
	first, last := tb.RowPages(rows[0])
	// Reclaimed: mapped by this process alone, then paged out.
	pg := b[first*4096 : (last+1)*4096]
	for i := 0; i < len(pg); i += 4096 {
		Touch(pg, i)
	}
	if err := unix.Madvise(pg, unix.MADV_PAGEOUT); err != nil {
		t.Fatal(err)
	}
	if err := allResident(t, maps, rows[:1]); !errors.Is(err, errReclaimed) {
		t.Fatalf("after MADV_PAGEOUT: %v, want errReclaimed", err)
	}
	// The gather reads it again through FUSE: a refault.
	if err := gatherFromMemoryErr(t, d, maps, rows[:1]); !errors.Is(err, errReclaimed) {
		t.Fatalf("a gather after MADV_PAGEOUT: %v, want errReclaimed", err)
	}
	// Dropped: not mapped, invalidated.
	f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	first, last = tb.RowPages(rows[1])
	if err := unix.Fadvise(int(f.Fd()), int64(first*4096), int64((last+1-first)*4096), unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	err = allResident(t, maps, rows[1:])
	if err == nil || errors.Is(err, errReclaimed) {
		t.Fatalf("after POSIX_FADV_DONTNEED: %v, want a failure that is not errReclaimed", err)
	}
	t.Log(err)
}

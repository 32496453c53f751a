package tests

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/procfs"
)

// dropCount is /proc/vmstat's drop_pagecache: how many times anyone on this
// machine has written to /proc/sys/vm/drop_caches since boot.
func dropCount(t testing.TB) uint64 {
	t.Helper()
	vm, err := procfs.VMStat()
	if err != nil {
		t.Fatalf("vmstat: %v", err)
	}
	return vm["drop_pagecache"]
}

// maxOutsideDrops bounds how often untilNoOutsideDrop tries again.
const maxOutsideDrops = 10

// untilNoOutsideDrop runs attempt (send hints, then check that their pages
// are resident) until it passes. A failure fails the test at once unless the
// page cache was dropped while attempt ran: a benchmark or another test run
// beside this one (engramfs bench drops caches before every path) evicts
// unpinned pages that engramfs did make resident, and no filesystem can
// prevent that. Such an attempt is logged and run again, at most
// maxOutsideDrops times. Call it only where this test process drops nothing
// itself while attempt runs.
func untilNoOutsideDrop(t testing.TB, what string, attempt func() error) {
	t.Helper()
	for try := 1; ; try++ {
		before := dropCount(t)
		err := attempt()
		if err == nil {
			return
		}
		if dropCount(t) == before {
			t.Fatalf("%s: %v", what, err)
		}
		if try == maxOutsideDrops {
			t.Fatalf("%s: %v (the page cache was dropped from outside during each of %d attempts)", what, err, try)
		}
		t.Logf("%s: %v; the page cache was dropped from outside meanwhile: trying again", what, err)
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
	if dropCount(t) == drops {
		t.Fatalf("%s: %v", what, err)
	}
	t.Logf("%s: %v; the page cache was dropped from outside meanwhile: hinting again", what, err)
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

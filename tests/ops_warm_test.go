package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// waitWarm waits until the warm-up has settled every saved page.
func waitWarm(t *testing.T, d *Daemon, timeout time.Duration) stats.Snapshot {
	t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(20 * time.Millisecond) {
		s := d.Stats(t)
		if s.WarmPagesTotal > 0 && s.WarmPagesDone == s.WarmPagesTotal {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm-up not finished within %v: %d of %d pages\n%s", timeout, s.WarmPagesDone, s.WarmPagesTotal, d.Log())
		}
	}
}

func TestWarmRestart(t *testing.T) {
	spec := geometries()["flash"]
	spec.Rows = 120000 // 7,500 weight pages and 235 scale pages a layer
	model := Synth(t, spec)
	dir := t.TempDir()
	mp := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "engramfs.state")
	args := []string{"--cache-size", "16MiB", "--state-file", state}

	// First life: decode makes a hot set, pinned.
	d := MountAt(t, model, mp, args...)
	if !strings.Contains(d.Log(), "no state file yet") {
		t.Fatalf("a first mount should say it starts cold:\n%s", d.Log())
	}
	m := Model(t, model)
	maps := layerMaps(t, d, m, 0)
	ctl := openControl(t, d)
	z := newZipfRows(70, spec.Rows)
	var traced []uint64
	for range 150 {
		rows := z.step(72)
		decodeStep(t, ctl, 0, rows)
		traced = append(traced, rows...)
	}
	settle(t, d)
	dropCaches(t)
	// The hot rows: traced rows whose pages all survived drop_caches (pinned).
	hotRows := pinnedRows(t, maps, traced)
	pinnedBefore := d.Stats(t).CacheUsedBytes / 4096
	if len(hotRows) < 1000 {
		t.Fatalf("only %d of %d traced rows pinned", len(hotRows), len(traced))
	}
	for _, b := range maps { // an orderly shutdown: readers go first
		_ = unix.Munmap(b)
	}
	ctl.Close()
	d.Stop(t) // SIGTERM: clean unmount, state saved
	if !strings.Contains(d.Log(), "hot set saved") {
		t.Fatalf("no state saved on SIGTERM:\n%s", d.Log())
	}
	if fi, err := os.Stat(state); err != nil || fi.Size() == 0 {
		t.Fatalf("state file: %v", err)
	}

	// Second life: warm within seconds, the hot rows served from memory.
	start := time.Now()
	d = MountAt(t, model, mp, args...)
	st := waitWarm(t, d, 30*time.Second)
	took := time.Since(start)
	settle(t, d)
	st = d.Stats(t)
	t.Logf("warm restart: %d pages (%d were pinned before the restart) fetched in %v from the daemon's start; %d backing reads, %d FUSE reads, %d pinned now",
		st.WarmPagesTotal, pinnedBefore, took.Round(time.Millisecond), st.BackingReads, st.FuseReads, st.CacheUsedBytes/4096)
	if st.WarmPagesTotal < uint64(pinnedBefore) {
		t.Fatalf("the state held %d pages, fewer than the %d pinned before", st.WarmPagesTotal, pinnedBefore)
	}
	if st.PrefetchStoreErrors != 0 {
		t.Errorf("%d pushes of the warm-up failed (files not looked up?)", st.PrefetchStoreErrors)
	}
	maps = layerMaps(t, d, m, 0)
	dropCaches(t)
	before := d.Stats(t)
	gatherAndCheck(t, d, maps, hotRows)
	after := d.Stats(t)
	if after.FuseReads != before.FuseReads || after.BackingReads != before.BackingReads {
		t.Fatalf("gathering %d previously hot rows after the restart and drop_caches: %d FUSE reads, %d backing reads; want none",
			len(hotRows), after.FuseReads-before.FuseReads, after.BackingReads-before.BackingReads)
	}
	for _, b := range maps {
		_ = unix.Munmap(b)
	}
	d.Stop(t)

	// A state file of another model is ignored, with a log line.
	other := spec
	other.Rows = 50000
	d = MountAt(t, Synth(t, other), mp, args...)
	if !strings.Contains(d.Log(), "saved for another model") {
		t.Fatalf("another model's state was not refused in the log:\n%s", d.Log())
	}
	if s := d.Stats(t); s.WarmPagesTotal != 0 {
		t.Fatalf("another model's state was used: warm_pages_total %d", s.WarmPagesTotal)
	}
}

// pinnedRows are the rows all of whose pages are resident in every table.
func pinnedRows(t *testing.T, maps map[*backing.Table][]byte, rows []uint64) []uint64 {
	t.Helper()
	res := map[*backing.Table][]bool{}
	for tb, b := range maps {
		res[tb] = resident(t, b)
	}
	var out []uint64
	seen := map[uint64]bool{}
	for _, r := range rows {
		if seen[r] {
			continue
		}
		seen[r] = true
		all := true
		for tb := range maps {
			for _, p := range pagesOf(tb, []uint64{r}) {
				all = all && res[tb][p]
			}
		}
		if all {
			out = append(out, r)
		}
	}
	return out
}

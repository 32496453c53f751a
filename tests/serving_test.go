package tests

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints/client"
)

// faultInFromAnotherProcess reads the pages holding rows of every table of
// layer with dd, one process per table: the pages enter the page cache
// through FUSE reads of a process that is neither the hinter nor the
// daemon, as another rank's gather would bring them in.
func faultInFromAnotherProcess(t testing.TB, d *Daemon, m *backing.Model, layer int, rows []uint64) {
	t.Helper()
	for _, tb := range m.LayerTables(layer) {
		path := filepath.Join(d.Mountpoint, tb.Path())
		for _, r := range rows {
			first, last := tb.RowPages(r)
			out, err := exec.Command("dd", "if="+path, "of=/dev/null", "bs=4096", "skip="+strconv.FormatUint(first, 10),
				"count="+strconv.FormatUint(last+1-first, 10), "status=none").CombinedOutput()
			if err != nil {
				t.Fatalf("dd of %s row %d: %v: %s", tb.Path(), r, err, out)
			}
		}
	}
}

// A decode hint for rows another process faulted in reads nothing from
// backing and stores nothing: the daemon finds the pages in the page cache
// (issue 21: in the serving loop 63-78% of a decode step's pages were
// resident before it, and each was read from backing again). With
// --cache-size 0 the tier pins nothing, so only the residency lookup can
// save the reads.
func TestDecodeHintOfRowsAnotherProcessFaultedReadsNothing(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0) // keeps the inodes known; never touched
	rows := randomRows(rand.New(rand.NewPCG(31, 32)), 40, spec.Rows)
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	untilNoOutsideDrop(t, "decode hint of rows another process faulted in", func() error {
		faultInFromAnotherProcess(t, d, m, 0, rows)
		if err := allResident(t, maps, rows); err != nil {
			return err
		}
		before := d.Stats(t)
		if err := h.Decode(0, rows); err != nil {
			t.Fatal(err)
		}
		st, err := h.Barrier()
		if err != nil {
			t.Fatal(err)
		}
		after := d.Stats(t)
		reads, stored := after.BackingReads-before.BackingReads, after.PrefetchPagesStored-before.PrefetchPagesStored
		cached := after.PrefetchDecodePagesCached - before.PrefetchDecodePagesCached
		if reads != 0 || stored != 0 || st.Pages == 0 || st.Cached != st.Pages || st.Resident != st.Pages || cached != st.Pages {
			return fmt.Errorf("decode hint of %d pages another process faulted in: %d backing reads, %d stored, %d counted cached by the daemon, status %+v; want 0, 0, all, all cached", st.Pages, reads, stored, cached, st)
		}
		return nil
	})
}

// A hint's residency lookup asks the kernel (mincore) only for pages the
// daemon ever served or stored: for a page never brought in, the answer is
// known without a system call (cache.Seen), and the page is fetched all the
// same. Pages another process faulted in are looked up, found, and not read.
func TestHintLooksUpOnlyPagesItEverServed(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	rng := rand.New(rand.NewPCG(51, 52))
	all := randomRows(rng, 80, spec.Rows)
	cold, faulted := all[:40], all[40:]
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	drops := dropCount(t)
	before := d.Stats(t)
	if err := h.Decode(0, cold); err != nil {
		t.Fatal(err)
	}
	st, err := h.Barrier()
	if err != nil {
		t.Fatal(err)
	}
	after := d.Stats(t)
	lookups := after.PrefetchResidencyLookups - before.PrefetchResidencyLookups
	skipped := after.PrefetchResidencySkipped - before.PrefetchResidencySkipped
	if lookups == 0 || skipped != lookups {
		t.Errorf("a hint of %d pages never served: %d residency lookups, %d answered without mincore; want all of them", st.Pages, lookups, skipped)
	}
	if st.Failed != 0 || st.Cached != 0 || st.Resident != st.Pages || after.BackingReads == before.BackingReads {
		t.Errorf("pages never served must be fetched: status %+v, %d backing reads", st, after.BackingReads-before.BackingReads)
	}
	checkHintedResident(t, d, 0, maps, cold, drops, "after the barrier")

	untilNoOutsideDrop(t, "hint of rows another process faulted in", func() error {
		faultInFromAnotherProcess(t, d, m, 0, faulted)
		if err := allResident(t, maps, faulted); err != nil {
			return err
		}
		before := d.Stats(t)
		if err := h.Decode(0, faulted); err != nil {
			t.Fatal(err)
		}
		st, err := h.Barrier()
		if err != nil {
			t.Fatal(err)
		}
		after := d.Stats(t)
		lookups := after.PrefetchResidencyLookups - before.PrefetchResidencyLookups
		skipped := after.PrefetchResidencySkipped - before.PrefetchResidencySkipped
		reads := after.BackingReads - before.BackingReads
		if lookups == 0 || skipped != 0 || reads != 0 || st.Cached != st.Pages {
			return fmt.Errorf("a hint of %d pages another process faulted in: %d lookups, %d without mincore, %d backing reads, status %+v; want some, 0, 0, all cached",
				st.Pages, lookups, skipped, reads, st)
		}
		return nil
	})
}

// A page a hint pushed that the page cache lets go before its reader comes
// is read again by the reader's fault, and the daemon counts it
// (prefetch_pushed_evicted): the thrash a prefill larger than memory
// causes, made here by evicting the pushed pages with
// POSIX_FADV_DONTNEED.
func TestPushedPageEvictedBeforeUseIsCounted(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	tb := m.LayerTables(0)[0]
	path := filepath.Join(d.Mountpoint, tb.Path())
	f, err := os.Open(path) // no mapping: DONTNEED drops only unmapped pages
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows := []uint64{3, 70, 700, 1400} // one page each, far apart
	// A page's first read, a fault's, is no read again (backing_pages_again).
	first, _ := tb.RowPages(1000) // on no page of rows
	if _, err := f.ReadAt(make([]byte, 1), int64(first)*4096); err != nil {
		t.Fatal(err)
	}
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.Prefill(0, rows); err != nil {
		t.Fatal(err)
	}
	st, err := h.Barrier()
	if err != nil {
		t.Fatal(err)
	}
	// Every table of the layer was hinted; only this one's pages are evicted
	// and read: those of them the hint pushed are the ones to count.
	if st.Failed != 0 || st.Pages == 0 {
		t.Fatalf("prefill barrier %+v", st)
	}
	before := d.Stats(t)
	if before.BackingAgain != 0 {
		t.Errorf("a first fault and a first fetch of %d pages counted %d pages read again", st.Pages, before.BackingAgain)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	for _, r := range rows {
		first, _ := tb.RowPages(r)
		if _, err := f.ReadAt(buf, int64(first)*4096); err != nil {
			t.Fatal(err)
		}
	}
	after := d.Stats(t)
	faults := after.FuseReads - before.FuseReads
	evicted := after.PrefetchPushedEvicted - before.PrefetchPushedEvicted
	again := after.BackingAgain - before.BackingAgain
	if faults != uint64(len(rows)) || evicted != uint64(len(rows)) || again != uint64(len(rows)) {
		t.Fatalf("after evicting %d pushed pages and reading them: %d FUSE reads, %d counted as pushed pages evicted before use, %d as read again; want %d each",
			len(rows), faults, evicted, again, len(rows))
	}
}

// A decode step whose pages are all pinned or cached, as a serving loop's
// popular rows are: the hints of both layers and the read barrier, against
// v3's fadvise(WILLNEED) calls for the same rows on the same mount (issue
// 21's target: the step ≤ the fadvise calls; found: 170-400 µs against
// ~190 µs for 288 pages). Reported per step, with the daemon's context
// switches a step.
func BenchmarkDecodeStepAllResident(b *testing.B) { benchDecodeStepResident(b) }

// The same step with no hot tier (--cache-size 0): its pages are in the page
// cache but none is pinned, so every one is a residency lookup in the
// hint's write, as a serving loop's pages that the tier does not hold are.
func BenchmarkDecodeStepAllCached(b *testing.B) { benchDecodeStepResident(b, "--cache-size", "0") }

func benchDecodeStepResident(b *testing.B, args ...string) {
	spec := benchModel(b, 60000)
	d := Mount(b, Synth(b, spec), args...)
	m := Model(b, d.ModelDir)
	rows := randomRows(rand.New(rand.NewPCG(41, 42)), 72, spec.Rows)
	var files []*os.File
	for _, tb := range m.Tables {
		f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	step := func() {
		for _, layer := range m.Layers {
			if err := h.Decode(layer, rows); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := h.Barrier(); err != nil {
			b.Fatal(err)
		}
	}
	for range 5 { // fetched, then pinned (or only cached)
		step()
	}
	run := func(b *testing.B, fn func()) {
		sw0, err := d.Switches()
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for range b.N {
			fn()
		}
		b.StopTimer()
		sw1, err := d.Switches()
		if err != nil {
			b.Fatal(err)
		}
		if sw1 < sw0 {
			// A thread that exits takes its counts along (procfs.Switches
			// sums the live threads'): a run that lost one says so.
			b.Logf("a daemon thread exited during the run: its context switches are not counted")
			return
		}
		b.ReportMetric(float64(sw1-sw0)/float64(b.N), "daemon-switches/step")
	}
	b.Run("hints", func(b *testing.B) {
		before := d.Stats(b)
		run(b, step)
		after := d.Stats(b)
		b.ReportMetric(float64(after.BackingReads-before.BackingReads)/float64(b.N), "backing-reads/step")
	})
	b.Run("step", func(b *testing.B) {
		before := d.Stats(b)
		layers := m.Layers
		lrows := make([][]uint64, len(layers))
		for i := range lrows {
			lrows[i] = rows
		}
		run(b, func() {
			if _, err := h.Step(layers, lrows); err != nil {
				b.Fatal(err)
			}
		})
		after := d.Stats(b)
		b.ReportMetric(float64(after.BackingReads-before.BackingReads)/float64(b.N), "backing-reads/step")
		if steps := after.HintSteps - before.HintSteps; steps < uint64(b.N) {
			b.Fatalf("%d steps answered by the step ioctl of %d", steps, b.N)
		}
	})
	b.Run("fadvise", func(b *testing.B) {
		run(b, func() {
			for i, tb := range m.Tables {
				for _, r := range rows {
					off := int64(len(tb.FileHeader)) + int64(r)*int64(tb.RowBytes)
					if err := unix.Fadvise(int(files[i].Fd()), off, int64(tb.RowBytes), unix.FADV_WILLNEED); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	})
}

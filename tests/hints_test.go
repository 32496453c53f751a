package tests

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/pagecache"
	"github.com/engramfs/engramfs/internal/testenv"
)

// openControl opens the control file for writing.
func openControl(t testing.TB, d *Daemon) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// layerMaps maps every table file of layer (keeping their inodes known to
// the kernel, as a real reader does) with MADV_RANDOM.
func layerMaps(t testing.TB, d *Daemon, m *backing.Model, layer int) map[*backing.Table][]byte {
	t.Helper()
	out := map[*backing.Table][]byte{}
	for _, tb := range m.LayerTables(layer) {
		b := testenv.MapFile(t, filepath.Join(d.Mountpoint, tb.Path()))
		if err := unix.Madvise(b, unix.MADV_RANDOM); err != nil {
			t.Fatal(err)
		}
		out[tb] = b
	}
	return out
}

// resident reports, for each page of b, whether it is in the page cache.
func resident(t testing.TB, b []byte) []bool {
	t.Helper()
	out, err := pagecache.Resident(b)
	if err != nil {
		t.Fatalf("mincore: %v", err)
	}
	return out
}

// rowsResident reports how many of the pages holding rows are resident.
func rowsResident(t testing.TB, tb *backing.Table, b []byte, rows []uint64) (res, total int) {
	missing, total := missingPages(t, tb, b, rows)
	return total - len(missing), total
}

// missingPages lists the pages holding rows that are not resident in the
// mapping b of tb, and counts the pages holding rows.
func missingPages(t testing.TB, tb *backing.Table, b []byte, rows []uint64) (missing []uint64, total int) {
	r := resident(t, b)
	seen := map[uint64]bool{}
	for _, row := range rows {
		first, last := tb.RowPages(row)
		for p := first; p <= last; p++ {
			if seen[p] {
				continue
			}
			seen[p] = true
			total++
			if !r[p] {
				missing = append(missing, p)
			}
		}
	}
	return missing, total
}

func randomRows(rng *rand.Rand, n int, rows uint64) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = rng.Uint64N(rows)
	}
	return out
}

func gatherAndCheck(t testing.TB, d *Daemon, maps map[*backing.Table][]byte, rows []uint64) {
	t.Helper()
	for tb, b := range maps {
		want := ShardTable(t, d.ModelDir, tb.Name)
		data := b[len(tb.FileHeader):]
		for _, r := range rows {
			lo, hi := r*uint64(tb.RowBytes), (r+1)*uint64(tb.RowBytes)
			if string(data[lo:hi]) != string(want[lo:hi]) {
				t.Fatalf("%s row %d differs from the shard", tb.Path(), r)
			}
		}
	}
}

// gatherFromMemoryErr gathers rows (failing the test on a wrong byte) and
// says whether that reached FUSE.
func gatherFromMemoryErr(t testing.TB, d *Daemon, maps map[*backing.Table][]byte, rows []uint64) error {
	t.Helper()
	before, refaults := d.Stats(t), refaultCount(t)
	gatherAndCheck(t, d, maps, rows)
	if after := d.Stats(t); after.FuseReads != before.FuseReads {
		err := fmt.Errorf("the gather caused %d FUSE reads, want 0", after.FuseReads-before.FuseReads)
		// A page the kernel reclaimed since the residency check counts
		// as a refault when the gather reads it again.
		if refaultCount(t)-refaults >= after.FuseReads-before.FuseReads {
			return fmt.Errorf("%w, and as many pages or more were refaulted meanwhile: %w", err, errReclaimed)
		}
		return err
	}
	return nil
}

// allResident says whether every page holding rows is resident in maps.
func allResident(t testing.TB, maps map[*backing.Table][]byte, rows []uint64) error {
	t.Helper()
	for tb, b := range maps {
		if missing, total := missingPages(t, tb, b, rows); len(missing) > 0 {
			err := fmt.Errorf("%s: %d of %d hinted pages resident (missing: pages %v)", tb.Path(), total-len(missing), total, missing[:min(len(missing), 8)])
			if allReclaimed(t, b, missing) {
				return fmt.Errorf("%w: %w", err, errReclaimed)
			}
			return err
		}
	}
	return nil
}

func TestDecodeHintThenBarrierMakesRowsResident(t *testing.T) {
	for name, spec := range geometries() {
		for _, proto := range []string{"binary", "text"} {
			t.Run(name+"/"+proto, func(t *testing.T) {
				d := Mount(t, Synth(t, spec))
				m := Model(t, d.ModelDir)
				maps := layerMaps(t, d, m, 1)
				rows := randomRows(rand.New(rand.NewPCG(5, 6)), 72, spec.Rows)
				ctl := openControl(t, d)
				var frame []byte
				if proto == "binary" {
					frame = hints.AppendBinary(nil, hints.Decode, 1, rows)
				} else {
					frame = hints.AppendText(nil, hints.Decode, 1, rows)
				}
				frames := 0
				untilNoOutsideDrop(t, "after the barrier", func() error {
					frames++
					if _, err := ctl.Write(frame); err != nil {
						t.Fatal(err)
					}
					if err := ctl.Sync(); err != nil {
						t.Fatalf("fsync (barrier): %v", err)
					}
					if err := allResident(t, maps, rows); err != nil {
						return err
					}
					return gatherFromMemoryErr(t, d, maps, rows)
				})
				if after := d.Stats(t); after.HintFrames != uint64(frames) || after.HintRows != uint64(72*frames) || after.PrefetchPagesStored == 0 {
					t.Fatalf("stats after one frame: %+v", after)
				}
			})
		}
	}
}

func TestPrefillHintBecomesResidentWithoutWait(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	rows := randomRows(rand.New(rand.NewPCG(7, 8)), 500, spec.Rows)
	ctl := openControl(t, d)
	untilNoOutsideDrop(t, "prefetched rows", func() error {
		if _, err := ctl.Write(hints.AppendBinary(nil, hints.Prefill, 0, rows)); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for allResident(t, maps, rows) != nil {
			if time.Now().After(deadline) {
				return fmt.Errorf("prefill rows not resident after 30 s; stats %+v", d.Stats(t))
			}
			time.Sleep(20 * time.Millisecond)
		}
		return gatherFromMemoryErr(t, d, maps, rows)
	})
}

func TestBadFrameIsRefusedAndTheNextWorks(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	ctl := openControl(t, d)
	bad := map[string][]byte{
		"unknown layer":    hints.AppendBinary(nil, hints.Decode, 7, []uint64{1}),
		"row out of range": hints.AppendBinary(nil, hints.Decode, 0, []uint64{spec.Rows}),
		"bad magic":        append([]byte("EGHX"), make([]byte, 8)...),
		"bad class":        {'E', 'G', 'H', '1', 9, 0, 0, 0, 1, 0, 0, 0},
		"count over limit": {'E', 'G', 'H', '1', 1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f},
		"text garbage":     []byte("fetch 0 1 2\n"),
		"text bad row":     []byte("decode 0 12x\n"),
	}
	good := []uint64{3, 1000, 17000}
	drops := dropCount(t)
	for name, frame := range bad {
		_, err := ctl.Write(frame)
		if !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("%s: write returned %v, want EINVAL", name, err)
		}
		// The next good frame on the same handle is accepted and served.
		if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, 0, good)); err != nil {
			t.Fatalf("%s: the good frame after it failed: %v", name, err)
		}
		if err := ctl.Sync(); err != nil {
			t.Fatalf("%s: barrier after a good frame: %v", name, err)
		}
	}
	if st := d.Stats(t); st.HintRejected != uint64(len(bad)) || st.HintFrames != uint64(len(bad)) {
		t.Fatalf("hint_rejected %d, hint_frames %d; want %d each", st.HintRejected, st.HintFrames, len(bad))
	}
	checkHintedResident(t, d, 0, maps, good, drops, "the good frames")
}

func TestFramesSplitAcrossManySmallWrites(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 1)
	rng := rand.New(rand.NewPCG(9, 10))
	rowsA, rowsB := randomRows(rng, 300, spec.Rows), randomRows(rng, 300, spec.Rows)
	stream := hints.AppendBinary(nil, hints.Decode, 1, rowsA)
	stream = append(stream, "# a comment line\n"...)
	stream = hints.AppendText(stream, hints.Prefill, 1, rowsB)
	ctl := openControl(t, d)
	drops := dropCount(t)
	for i := 0; i < len(stream); i += 7 {
		if _, err := ctl.Write(stream[i:min(i+7, len(stream))]); err != nil {
			t.Fatalf("write at %d: %v", i, err)
		}
	}
	if err := ctl.Sync(); err != nil {
		t.Fatal(err)
	}
	if st := d.Stats(t); st.HintFrames != 2 || st.HintRows != 600 {
		t.Fatalf("frames %d rows %d, want 2 and 600", st.HintFrames, st.HintRows)
	}
	checkHintedResident(t, d, 1, maps, append(rowsA, rowsB...), drops, "split frames")
}

func TestSeveralProcessesHintAtOnce(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	var wg sync.WaitGroup
	drops := dropCount(t)
	errs := make(chan error, 8)
	all := make([][]uint64, 8)
	for i := range all {
		all[i] = randomRows(rand.New(rand.NewPCG(uint64(i), 11)), 400, spec.Rows)
	}
	// Each "process" is its own open file description with its own barrier;
	// separate processes are exercised by the Python client test.
	for i := range all {
		wg.Add(1)
		go func(rows []uint64) {
			defer wg.Done()
			f, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_WRONLY, 0)
			if err != nil {
				errs <- err
				return
			}
			defer f.Close()
			for j := 0; j < len(rows); j += 50 {
				if _, err := f.Write(hints.AppendBinary(nil, hints.Decode, 0, rows[j:j+50])); err != nil {
					errs <- err
					return
				}
			}
			errs <- f.Sync()
		}(all[i])
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	var rows []uint64
	for _, r := range all {
		rows = append(rows, r...)
	}
	checkHintedServed(t, d, 0, maps, rows, drops, "rows hinted by several processes")
}

// A prefill hint for rows a reader has already brought into the page cache
// reads and stores nothing, as fadvise(WILLNEED) would: the barrier counts
// them resident and prefetch_pages_cached counts them. (--cache-size 0: with
// a tier, the faulted pages would be pinned, and skipped as pinned.)
func TestPrefillHintOfCachedRowsReadsNothing(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	rows := randomRows(rand.New(rand.NewPCG(21, 22)), 40, spec.Rows)
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	untilNoOutsideDrop(t, "hinted cached rows", func() error {
		gatherAndCheck(t, d, maps, rows) // faults them in
		if err := allResident(t, maps, rows); err != nil {
			return err
		}
		before := d.Stats(t)
		if err := h.Prefill(0, rows); err != nil {
			t.Fatal(err)
		}
		st, err := h.Barrier()
		if err != nil {
			t.Fatal(err)
		}
		after := d.Stats(t)
		reads, stored, cached := after.BackingReads-before.BackingReads, after.PrefetchPagesStored-before.PrefetchPagesStored, after.PrefetchPagesCached-before.PrefetchPagesCached
		if reads != 0 || stored != 0 || cached != st.Pages || st.Resident != st.Pages || st.Pages == 0 {
			return fmt.Errorf("prefill hint of %d cached pages: %d backing reads, %d stored, %d counted cached, status %+v; want 0, 0, all, all resident", st.Pages, reads, stored, cached, st)
		}
		return nil
	})
}

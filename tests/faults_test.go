package tests

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
)

// readPage reads data page p of a table file with read(2): the error path
// of a fault without the SIGBUS an mmap reader would get.
func readPage(f *os.File, tb *backing.Table, p uint64) ([]byte, error) {
	buf := make([]byte, min(4096, tb.FileSize-int64(p)*4096))
	_, err := f.ReadAt(buf, int64(p)*4096)
	return buf, err
}

func openTable(t testing.TB, d *Daemon, tb *backing.Table) *os.File {
	t.Helper()
	f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestBackingEIOFailsOnlyBadPages(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "eio=0.1,seed=5")
	m := Model(t, d.ModelDir)
	tb := m.LayerTables(0)[1] // weight: one row a page
	want := ShardTable(t, d.ModelDir, tb.Name)
	f := openTable(t, d, tb)
	bad := map[uint64]bool{}
	good := 0
	for p := tb.DataPage(); p < tb.DataPage()+400; p++ {
		got, err := readPage(f, tb, p)
		if err != nil {
			if !errors.Is(err, syscall.EIO) {
				t.Fatalf("page %d: %v, want EIO or data", p, err)
			}
			bad[p] = true
			continue
		}
		off := (p - tb.DataPage()) * 4096
		if !bytes.Equal(got, want[off:off+uint64(len(got))]) {
			t.Fatalf("page %d: wrong bytes", p)
		}
		good++
	}
	if len(bad) < 10 || good < 300 {
		t.Fatalf("eio=0.1 over 400 pages: %d failed, %d served", len(bad), good)
	}
	// Nothing wrong was cached: a bad page fails again, and the good ones
	// around it still read right.
	for p := range bad {
		if _, err := readPage(f, tb, p); !errors.Is(err, syscall.EIO) {
			t.Fatalf("page %d failed once, then read %v", p, err)
		}
	}
	// The second failure of a page comes from a new read, or (within a
	// second of the first) from the negative cache, without one.
	if st := d.Stats(t); st.BackingErrors+st.BackingFailFast < uint64(2*len(bad)) {
		t.Fatalf("backing_errors %d + backing_fail_fast %d, want at least %d", st.BackingErrors, st.BackingFailFast, 2*len(bad))
	}

	// A hint that covers bad pages: fsync says EIO, and the rest of the
	// frame still lands.
	maps := layerMaps(t, d, m, 1)
	rows := randomRows(rand.New(rand.NewPCG(70, 71)), 300, spec.Rows)
	ctl := openControl(t, d)
	drops := dropCount(t)
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, 1, rows)); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("barrier over bad pages returned %v, want EIO", err)
	}
	if err := ctl.Sync(); err != nil {
		t.Fatalf("a second barrier with nothing new pending returned %v, want 0 (an error is reported once)", err)
	}
	landed, failed := 0, 0
	for tb, b := range maps {
		res := resident(t, b)
		pages := pagesOf(tb, rows)
		var missing []uint64
		for _, p := range pages {
			if !res[p] {
				missing = append(missing, p)
			}
		}
		// Asked before the reads, which take the shadow entries.
		reclaimed := reclaimedPages(t, b, missing)
		f := openTable(t, d, tb)
		for _, p := range pages {
			_, err := readPage(f, tb, p)
			if !res[p] && err == nil && (reclaimed[p] || dropCount(t) != drops) {
				// Landed, then evicted by someone else's drop_caches or by
				// the kernel's reclaim.
				t.Logf("%s page %d: not judged, evicted from outside (reclaimed: %v)", tb.Path(), p, reclaimed[p])
				continue
			}
			if res[p] != (err == nil) {
				t.Fatalf("%s page %d: resident %v after the hint, but read(2) says %v", tb.Path(), p, res[p], err)
			}
			if res[p] {
				landed++
			} else {
				failed++
			}
		}
	}
	if landed == 0 || failed == 0 {
		t.Fatalf("hinted pages: %d landed, %d failed; want both", landed, failed)
	}
}

func TestShortBackingReadsAreErrorsNotData(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "short=0.3,seed=8")
	m := Model(t, d.ModelDir)
	for _, tb := range m.Tables {
		want := ShardTable(t, d.ModelDir, tb.Name)
		f := openTable(t, d, tb)
		short := 0
		for p := tb.DataPage(); p < tb.Pages(); p++ {
			got, err := readPage(f, tb, p)
			if err != nil {
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("%s page %d: %v", tb.Path(), p, err)
				}
				short++
				continue
			}
			off := (p - tb.DataPage()) * 4096
			if !bytes.Equal(got, want[off:off+uint64(len(got))]) {
				t.Fatalf("%s page %d: a short backing read was passed off as data", tb.Path(), p)
			}
		}
		if short == 0 {
			t.Fatalf("%s: short=0.3 spoiled no read", tb.Path())
		}
	}
}

func TestSlowBackingStillServes(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=30ms")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	rng := rand.New(rand.NewPCG(72, 73))
	// Faults wait for the slow backing and get the right bytes.
	gatherAndCheck(t, d, maps, randomRows(rng, 10, spec.Rows))
	// Hints complete, and fsync returns only once they have.
	rows := randomRows(rng, 100, spec.Rows)
	ctl := openControl(t, d)
	untilNoOutsideDrop(t, "after the barrier", func() error {
		if _, err := ctl.Write(hints.AppendBinary(nil, hints.Prefill, 0, rows)); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := ctl.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := allResident(t, maps, rows); err != nil {
			return fmt.Errorf("fsync returned after %v: %w", time.Since(start), err)
		}
		return gatherFromMemoryErr(t, d, maps, rows)
	})
}

func TestShardChangedWhileMountedIsEIO(t *testing.T) {
	for _, how := range []string{"truncated", "rewritten in place"} {
		t.Run(how, func(t *testing.T) {
			spec := geometries()["4096B"]
			d := Mount(t, Synth(t, spec))
			m := Model(t, d.ModelDir)
			tb, other := m.LayerTables(0)[1], m.LayerTables(1)[1]
			want := ShardTable(t, d.ModelDir, tb.Name)
			wantOther := ShardTable(t, d.ModelDir, other.Name)
			f := openTable(t, d, tb)
			// A page read before the change is right and may stay cached.
			if got, err := readPage(f, tb, tb.DataPage()); err != nil || !bytes.Equal(got, want[:4096]) {
				t.Fatalf("before the change: %v", err)
			}
			switch how {
			case "truncated":
				if err := os.Truncate(tb.Shard.Path, tb.Shard.Size/2); err != nil {
					t.Fatal(err)
				}
			default:
				sf, err := os.OpenFile(tb.Shard.Path, os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := sf.WriteAt(bytes.Repeat([]byte{0xAB}, 1<<20), tb.DataStart); err != nil {
					t.Fatal(err)
				}
				sf.Close()
				later := time.Now().Add(time.Minute)
				if err := os.Chtimes(tb.Shard.Path, later, later); err != nil {
					t.Fatal(err)
				}
			}
			for p := tb.DataPage() + 1; p < tb.DataPage()+50; p++ {
				got, err := readPage(f, tb, p)
				if err == nil {
					off := (p - tb.DataPage()) * 4096
					if !bytes.Equal(got, want[off:off+uint64(len(got))]) {
						t.Fatalf("page %d: bytes that are not the table's (from the changed shard)", p)
					}
					t.Fatalf("page %d of a %s shard was served", p, how)
				}
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("page %d: %v, want EIO", p, err)
				}
			}
			// The filesystem keeps serving the other layer's shard.
			if got, err := readPage(openTable(t, d, other), other, other.DataPage()+3); err != nil || !bytes.Equal(got, wantOther[3*4096:4*4096]) {
				t.Fatalf("another shard after the change: %v", err)
			}
		})
	}
}

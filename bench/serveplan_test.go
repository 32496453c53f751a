package bench

import (
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/engramfs/engramfs/backing"
)

func smallServeSpec() ServeSpec {
	return ServeSpec{Requests: 3, Chunks: 2, ChunkRows: 200, RareFraction: 0.5, Steps: 5, StepRows: 72, S: 0.9}
}

// TestServePlan: the plan is a function of seed, rank and spec; chunks
// hold the asked unique rows in order, half of them rare rows that no
// other chunk or step names; steps the asked lookups; ranks have rows of
// their own; a table too small for the plan is refused.
func TestServePlan(t *testing.T) {
	spec := smallServeSpec()
	layers := []uint64{1 << 16, 1 << 17}
	a, err := ServePlan(7, 0, layers, spec)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := ServePlan(7, 0, layers, spec)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("two draws of one plan differ")
	}
	other, _ := ServePlan(7, 1, layers, spec)
	if reflect.DeepEqual(a[0].Chunks[0][0], other[0].Chunks[0][0]) {
		t.Error("ranks 0 and 1 ask for the same rows")
	}
	if len(a) != spec.Requests {
		t.Fatalf("%d requests", len(a))
	}
	named := map[[2]uint64]int{}
	for _, rq := range a {
		if len(rq.Chunks) != spec.Chunks || len(rq.Steps) != spec.Steps {
			t.Fatalf("request of %d chunks, %d steps", len(rq.Chunks), len(rq.Steps))
		}
		for _, ch := range rq.Chunks {
			for j, rows := range ch {
				if len(rows) != spec.ChunkRows || !slices.IsSorted(rows) || len(slices.Compact(slices.Clone(rows))) != len(rows) {
					t.Fatalf("layer %d chunk: %d rows, sorted %v", j, len(rows), slices.IsSorted(rows))
				}
				for _, r := range rows {
					if r >= layers[j] {
						t.Fatalf("row %d out of layer %d's %d", r, j, layers[j])
					}
					named[[2]uint64{uint64(j), r}]++
				}
			}
		}
		for _, st := range rq.Steps {
			for j, rows := range st {
				if len(rows) != spec.StepRows {
					t.Fatalf("step layer %d: %d lookups", j, len(rows))
				}
				for _, r := range UniqueRows(slices.Clone(rows)) {
					named[[2]uint64{uint64(j), r}]++
				}
			}
		}
	}
	sh := Shape(a)
	if sh.ChunkRows != 2*spec.ChunkRows || sh.StepLookups != 2*spec.StepRows {
		t.Errorf("shape %+v", sh)
	}
	// At least the rare half is named once; popular rows recur, so not all.
	if sh.ChunkSingletons < spec.RareFraction || sh.ChunkSingletons > 0.95 {
		t.Errorf("%.2f of chunk rows named once, want at least the rare %.2f and not all", sh.ChunkSingletons, spec.RareFraction)
	}
	if sh.StepSeenBefore <= 0.2 {
		t.Errorf("only %.2f of decode lookups name rows named before: decode should be mostly popular rows", sh.StepSeenBefore)
	}
	// Count the singletons directly: Shape must agree.
	singles, rows := 0, 0
	for _, rq := range a {
		for _, ch := range rq.Chunks {
			for j, rs := range ch {
				for _, r := range rs {
					rows++
					if named[[2]uint64{uint64(j), r}] == 1 {
						singles++
					}
				}
			}
		}
	}
	if want := float64(singles) / float64(rows); sh.ChunkSingletons != want {
		t.Errorf("Shape says %.4f singletons, counted %.4f", sh.ChunkSingletons, want)
	}

	if _, err := ServePlan(7, 0, []uint64{1000}, spec); err == nil {
		t.Error("a 1000-row table took 300 rare rows and 100 popular ones a chunk")
	}
	bad := spec
	bad.RareFraction = 1.5
	if _, err := ServePlan(7, 0, layers, bad); err == nil {
		t.Error("a rare fraction of 1.5 was taken")
	}
}

// TestShardPagesAndReadOnce: in the shards' layout an unaligned 4 KiB row
// spans two pages, in the mount's one; reading each mount page once costs
// the aligned superset of each run of adjacent pages in the shard.
func TestShardPagesAndReadOnce(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	spec := backing.DefaultSynth()
	spec.Layers, spec.Rows = 1, 64 // 4096-byte weight rows, 128-byte scale rows
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	var w, sc *backing.Table
	for _, t := range m.LayerTables(0) {
		if t.Kind == "weight" {
			w = t
		} else {
			sc = t
		}
	}
	if w.DataStart%512 == 0 {
		t.Fatalf("the synthetic weight table starts at %d: want an unaligned start for this test", w.DataStart)
	}
	mount, shard := NewPageCounter(m), NewShardPageCounter(m)
	for _, c := range []*PageCounter{mount, shard} {
		c.Add(0, []uint64{3})
	}
	// Mount: a weight page and a scale page. Shard: the pages the row's
	// bytes span there (an unaligned 4 KiB weight row: two).
	spans := func(t *backing.Table, r int64) int {
		off := t.DataStart + r*t.RowBytes
		return int((off+t.RowBytes-1)/4096 - off/4096 + 1)
	}
	if want := spans(w, 3) + spans(sc, 3); mount.Len() != 2 || shard.Len() != want || spans(w, 3) != 2 {
		t.Errorf("row 3: %d mount pages, %d shard pages, want 2 and %d", mount.Len(), shard.Len(), want)
	}
	if got := shard.ReadOnceBytes(512); got != uint64(shard.Len())*4096 {
		t.Errorf("shard layout read once: %d bytes, want a page each", got)
	}
	// Each lone mount page is 4096 bytes of the shard at an offset that is
	// not a multiple of 512: 4608 bytes with 512-byte alignment.
	if got := mount.ReadOnceBytes(512); got != 2*4608 {
		t.Errorf("mount layout read once, 512-byte alignment: %d, want 2 × 4608", got)
	}
	mount.Add(0, []uint64{4, 5})
	// Weight pages 3, 4, 5 are one run: 3 × 4096 + 512; the scale rows are on
	// the same page.
	if got := mount.ReadOnceBytes(512); got != 3*4096+512+4608 {
		t.Errorf("a run of three pages: %d, want 12800 + 4608", got)
	}
	if got := mount.ReadOnceBytes(1); got != 3*4096+4096 {
		t.Errorf("no alignment: %d, want the pages' bytes", got)
	}
}

// TestStepNewReads: a step's compulsory reads are those of pages nothing
// named before it in the loop's order (every rank's chunks of a request,
// then every rank's steps), one read a row whatever pages it spans.
func TestStepNewReads(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	spec := backing.DefaultSynth()
	spec.Layers, spec.Rows = 1, 4096 // 4096-byte weight rows (unaligned in the shard), 128-byte scale rows
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	// Row 100 spans two shard pages: two new pages, one read.
	if pages, reads := NewShardPageCounter(m).AddReads(0, []uint64{100}); pages != 3 || reads != 2 {
		t.Errorf("shard layout, one row: %d pages %d reads, want 3 (two weight, one scale) and 2", pages, reads)
	}
	if pages, reads := NewPageCounter(m).AddReads(0, []uint64{100, 100, 101}); pages != 3 || reads != 3 {
		t.Errorf("mount layout, rows 100, 100, 101: %d pages %d reads, want 3 and 3 (two weight pages, one scale page)", pages, reads)
	}
	rows := func(r ...uint64) [][]uint64 { return [][]uint64{r} }
	// Rank 0 names row 0 in a chunk; its step names 0 (seen) and 2000
	// (new). Rank 1's step names 2000 too, after rank 0's: seen. The
	// second request's step names 3000, which rank 1's chunk of that
	// request named before it.
	plans := [][]ServeRequest{
		{
			{Chunks: [][][]uint64{rows(0)}, Steps: [][][]uint64{rows(0, 2000)}},
			{Chunks: [][][]uint64{rows(1)}, Steps: [][][]uint64{rows(3000)}},
		},
		{
			{Chunks: [][][]uint64{rows(1024)}, Steps: [][][]uint64{rows(2000)}},
			{Chunks: [][][]uint64{rows(3000)}, Steps: [][][]uint64{rows(4000)}},
		},
	}
	nm, ns := stepNewReads(m, plans, NewPageCounter(m), NewShardPageCounter(m))
	// Steps: request 1 (row 2000: a weight read and a scale read), request
	// 2 (row 4000: the same). Two steps, two reads each, in both layouts.
	if nm != 2 || ns != 2 {
		t.Errorf("new reads a step: mount %v, shard %v; want 2 and 2", nm, ns)
	}
}

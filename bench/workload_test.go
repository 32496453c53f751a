package bench

import (
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/engramfs/engramfs/backing"
)

// TestZipfShape checks the sampler against the exact Zipf probabilities of
// a small support: every rank's frequency within 5 standard errors.
func TestZipfShape(t *testing.T) {
	for _, s := range []float64{0.5, 0.9, 1.0, 1.3} {
		const n, draws = 50, 400_000
		z := NewZipf(rand.New(rand.NewPCG(1, 2)), s, n)
		counts := make([]int, n+1)
		for range draws {
			k := z.Rank()
			if k < 1 || k > n {
				t.Fatalf("s=%v: rank %d outside 1..%d", s, k, n)
			}
			counts[k]++
		}
		var norm float64
		for k := 1; k <= n; k++ {
			norm += math.Pow(float64(k), -s)
		}
		for k := 1; k <= n; k++ {
			p := math.Pow(float64(k), -s) / norm
			want := p * draws
			sd := math.Sqrt(draws * p * (1 - p))
			if d := math.Abs(float64(counts[k]) - want); d > 5*sd {
				t.Errorf("s=%v rank %d: %d draws, want %.0f ± %.0f", s, k, counts[k], want, 5*sd)
			}
		}
	}
}

// TestZipfHeadShare checks that the decode workload is Zipf-popular as
// docs/design.md ("The problem") describes decode rows: with s = 0.9 over a
// million rows, the top 1% of rows take over half the lookups.
func TestZipfHeadShare(t *testing.T) {
	const n, draws = 1 << 20, 200_000
	z := NewZipf(rand.New(rand.NewPCG(3, 4)), 0.9, n)
	head := 0
	for range draws {
		if z.Rank() <= n/100 {
			head++
		}
	}
	if share := float64(head) / draws; share < 0.5 || share > 0.6 {
		t.Errorf("top 1%% of rows took %.1f%% of lookups, want just over half", 100*share)
	}
}

func TestScatterIsABijection(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []uint64{1, 2, 7, 1000, 4096, 12345} {
		sc := NewScatter(rng, n)
		seen := make([]bool, n)
		for x := range n {
			r := sc.Row(x)
			if r >= n || seen[r] {
				t.Fatalf("n=%d: x=%d maps to %d (out of range or repeated)", n, x, r)
			}
			seen[r] = true
		}
	}
}

func TestDecodeWorkload(t *testing.T) {
	spec := DecodeSpec{Steps: 50, RowsPerStep: 72, S: 0.9}
	rows := []uint64{1 << 20, 1000}
	a := DecodeWorkload(7, rows, spec)
	if len(a) != 50 {
		t.Fatalf("%d steps, want 50", len(a))
	}
	for _, step := range a {
		if len(step) != 2 {
			t.Fatalf("%d layers, want 2", len(step))
		}
		for j, rs := range step {
			if len(rs) != 72 {
				t.Fatalf("%d rows, want 72", len(rs))
			}
			for _, r := range rs {
				if r >= rows[j] {
					t.Fatalf("row %d out of the %d rows of layer %d", r, rows[j], j)
				}
			}
		}
	}
	if b := DecodeWorkload(7, rows, spec); !slices.EqualFunc(a, b, func(x, y [][]uint64) bool {
		return slices.EqualFunc(x, y, slices.Equal)
	}) {
		t.Error("the same seed drew different steps")
	}
	// The most popular row takes 1/H(n, 0.9) ≈ 3.3% of the lookups: about
	// 120 of 3600.
	count := map[uint64]int{}
	top := 0
	for _, step := range a {
		for _, r := range step[0] {
			count[r]++
			top = max(top, count[r])
		}
	}
	if top < 80 || top > 160 {
		t.Errorf("the most popular row came up %d times in 3600 lookups, want about 120", top)
	}
}

// TestPrefillChunkRows checks chunk -> unique rows: sorted, deduplicated, in
// range, and 10K-40K per layer for an 8192-token chunk (docs/design.md,
// "The problem").
func TestPrefillChunkRows(t *testing.T) {
	rows := []uint64{1 << 20, 16 << 20}
	chunks := PrefillWorkload(1, rows, DefaultPrefill(3))
	if len(chunks) != 3 {
		t.Fatalf("%d chunks, want 3", len(chunks))
	}
	for c, ch := range chunks {
		for j, rs := range ch {
			if len(rs) < 10_000 || len(rs) > 40_000 {
				t.Errorf("chunk %d layer %d: %d unique rows, want 10K-40K", c, j, len(rs))
			}
			for i, r := range rs {
				if r >= rows[j] || (i > 0 && rs[i-1] >= r) {
					t.Fatalf("chunk %d layer %d: rows not sorted, unique and in range at %d", c, j, i)
				}
			}
		}
	}
	// A tiny table: every lookup lands on few rows, so dedup must bite.
	small := PrefillWorkload(1, []uint64{500}, DefaultPrefill(1))
	if n := len(small[0][0]); n > 500 || n < 400 {
		t.Errorf("500-row table: %d unique rows, want nearly all 500 and no more", n)
	}
}

func TestUniqueRows(t *testing.T) {
	got := UniqueRows([]uint64{5, 3, 5, 1, 3, 3, 9})
	if want := []uint64{1, 3, 5, 9}; !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if got := UniqueRows(nil); len(got) != 0 {
		t.Errorf("got %v for no rows", got)
	}
}

// TestPageCounter counts pages in the mount layout for the small-row
// geometry, each page once across calls.
func TestPageCounter(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	spec := backing.DefaultSynth()
	spec.Layers, spec.Rows = 1, 4096
	spec.FlashGeometry() // 256-byte weight rows (16 a page), 8-byte scale rows (512 a page)
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	pc := NewPageCounter(m)
	for _, tc := range []struct {
		rows []uint64
		want int
	}{
		{[]uint64{0}, 2},          // one weight page, one scale page
		{[]uint64{0, 1, 15}, 0},   // the same pages again
		{[]uint64{16}, 1},         // a new weight page; scale page 0 seen
		{[]uint64{511, 512}, 3},   // weight pages 31 and 32, scale page 1
		{[]uint64{4095, 4095}, 2}, // the last rows: weight page 255, scale page 7
	} {
		if got := pc.Add(0, tc.rows); got != tc.want {
			t.Errorf("rows %v: %d new pages, want %d", tc.rows, got, tc.want)
		}
	}
}

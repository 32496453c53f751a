package cache

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// BenchmarkTierAccessDecode is the policy's cost per decode step: 72 pages,
// Zipf(0.9) over 1M rows, on a warm tier of 20,000 pages (2% of the rows).
func BenchmarkTierAccessDecode(b *testing.B) {
	const rows = 1_000_000
	z := newZipfRows(rows, 0.9)
	rng := rand.New(rand.NewPCG(5, 6))
	steps := make([][]PageKey, 4096)
	for i := range steps {
		steps[i] = z.decodeStep(rng, 72, nil)
	}
	tr := NewTier(rows / 50 * PageSize)
	var c Changes
	for _, s := range steps {
		tr.Access(s, SignalDecode, &c)
		c.Reset()
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			c.Reset()
			tr.Access(steps[i%len(steps)], SignalDecode, &c)
			i++
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			var c Changes
			i := rand.IntN(len(steps))
			for pb.Next() {
				c.Reset()
				tr.Access(steps[i%len(steps)], SignalDecode, &c)
				i++
			}
		})
	})
}

// trace is a synthetic serving workload: decode steps of Zipf-popular rows,
// with a prefill chunk of distinct rows every scanEvery steps.
type trace struct {
	rows      int     // one row per page
	zipf      float64 // Zipf exponent of decode rows; 0: 0.9
	steps     int     // decode steps
	warm      int     // steps not counted in the hit ratio
	perStep   int     // rows per decode step
	scanEvery int     // steps between prefill chunks
	scanRows  int     // distinct rows per prefill chunk
	scanZipf  bool    // chunk rows drawn by popularity (else uniformly)
	locality  float64 // share of decode rows drawn from the last prefill chunk
}

type traceOp struct {
	sig     Signal
	keys    []PageKey
	counted bool
}

func (tc trace) ops(seed uint64) []traceOp {
	s := tc.zipf
	if s == 0 {
		s = 0.9
	}
	z := newZipfRows(tc.rows, s)
	rng := rand.New(rand.NewPCG(seed, 11))
	var ops []traceOp
	var chunk []PageKey
	for step := range tc.steps {
		if step%tc.scanEvery == 0 {
			if tc.scanZipf {
				seen := map[PageKey]bool{}
				chunk = nil
				for len(chunk) < tc.scanRows {
					k := PageKey{Page: z.row(rng)}
					if !seen[k] {
						seen[k] = true
						chunk = append(chunk, k)
					}
				}
			} else {
				chunk = scanPages(rng, tc.rows, tc.scanRows)
			}
			ops = append(ops, traceOp{sig: SignalPrefill, keys: chunk})
		}
		keys := make([]PageKey, tc.perStep)
		for i := range keys {
			if rng.Float64() < tc.locality {
				keys[i] = chunk[rng.IntN(len(chunk))]
			} else {
				keys[i] = PageKey{Page: z.row(rng)}
			}
		}
		ops = append(ops, traceOp{sig: SignalDecode, keys: keys, counted: step >= tc.warm})
	}
	return ops
}

// tierHitRatio replays ops and returns the hit ratio of counted decode lookups.
func tierHitRatio(tr *Tier, ops []traceOp) float64 {
	var c Changes
	hits, lookups := 0, 0
	for _, op := range ops {
		c.Reset()
		tr.Access(op.keys, op.sig, &c)
		if op.counted {
			hits += c.Hits
			lookups += len(op.keys)
		}
	}
	return float64(hits) / float64(lookups)
}

// lruHitRatio is the same for a plain LRU of the same page count, which
// treats every access alike.
func lruHitRatio(pages int, ops []traceOp) float64 {
	l, _ := simplelru.NewLRU[PageKey, struct{}](pages, nil)
	hits, lookups := 0, 0
	for _, op := range ops {
		for _, k := range op.keys {
			_, ok := l.Get(k)
			if !ok {
				l.Add(k, struct{}{})
			}
			if op.counted {
				lookups++
				if ok {
					hits++
				}
			}
		}
	}
	return float64(hits) / float64(lookups)
}

// BenchmarkTierHitRatio compares the decode hit ratio of the tier with a plain
// LRU of the same page capacity (2% of 1M rows), on decode steps of 72
// Zipf(0.9) rows with a 20K-row prefill chunk every 50 steps; the first 500
// of 3000 steps warm up. Variants: prefill rows drawn uniformly or by
// popularity; decode rows partly repeating the last prompt chunk (locality);
// the tier admitting prefill into probation or not at all. One iteration
// replays the whole trace: run with -benchtime=1x.
func BenchmarkTierHitRatio(b *testing.B) {
	const rows = 1_000_000
	capPages := rows / 50
	base := trace{rows: rows, steps: 3000, warm: 500, perStep: 72, scanEvery: 50, scanRows: 20_000}
	for _, v := range []struct {
		name string
		tc   func(trace) trace
	}{
		{"scan=uniform", func(t trace) trace { return t }},
		{"scan=zipf", func(t trace) trace { t.scanZipf = true; return t }},
		{"scan=zipf/locality=0.2", func(t trace) trace { t.scanZipf = true; t.locality = 0.2; return t }},
	} {
		ops := v.tc(base).ops(1)
		for _, admit := range []prefillAdmission{prefillAll, prefillGhost, prefillNone} {
			b.Run(fmt.Sprintf("%s/admit_prefill=%s", v.name, []string{"none", "ghost", "all"}[admit]), func(b *testing.B) {
				var tier, lru float64
				for b.Loop() {
					o := defaultTierOptions()
					o.admitPrefill = admit
					tier = tierHitRatio(newTier(int64(capPages)*PageSize, o), ops)
					lru = lruHitRatio(capPages, ops)
				}
				b.ReportMetric(tier, "tier_hit_ratio")
				b.ReportMetric(lru, "lru_hit_ratio")
			})
		}
	}
}

// BenchmarkTierTuning sweeps probation's share and the ghost list's length
// (per mille of capacity) on 12,000 decode steps (2,000 warm) with a prefill
// chunk every 50 steps. Run with -benchtime=1x.
func BenchmarkTierTuning(b *testing.B) {
	const rows = 1_000_000
	capPages := rows / 50
	for _, zipfScan := range []bool{false, true} {
		ops := trace{rows: rows, steps: 12000, warm: 2000, perStep: 72, scanEvery: 50, scanRows: 20_000, scanZipf: zipfScan}.ops(1)
		for _, pg := range [][2]int{{50, 1000}, {100, 1000}, {200, 1000}, {250, 1000}, {330, 1000}, {100, 0}, {100, 500}, {100, 2000}} {
			b.Run(fmt.Sprintf("scan_zipf=%v/probation=%d/ghost=%d", zipfScan, pg[0], pg[1]), func(b *testing.B) {
				var r float64
				for b.Loop() {
					o := defaultTierOptions()
					o.probationPermille, o.ghostPermille = pg[0], pg[1]
					r = tierHitRatio(newTier(int64(capPages)*PageSize, o), ops)
				}
				b.ReportMetric(r, "tier_hit_ratio")
			})
		}
	}
}

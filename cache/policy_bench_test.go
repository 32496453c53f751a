package cache

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// policyTraces are the workloads the tier's policy is chosen on: 3000 decode
// steps of 72 Zipf rows (the first 500 warm up) over 1M rows, one row per
// page, a tier of 2% of the rows, a prefill chunk of distinct rows every few
// steps.
func policyTraces() []struct {
	name string
	tc   trace
} {
	base := trace{rows: 1_000_000, steps: 3000, warm: 500, perStep: 72, scanEvery: 50, scanRows: 20_000}
	with := func(f func(*trace)) trace { t := base; f(&t); return t }
	return []struct {
		name string
		tc   trace
	}{
		{"s0.8/uniform20K", with(func(t *trace) { t.zipf = 0.8 })},
		{"s0.9/uniform20K", with(func(t *trace) {})},
		{"s1.0/uniform20K", with(func(t *trace) { t.zipf = 1.0 })},
		{"s0.9/uniform10K/20", with(func(t *trace) { t.scanRows, t.scanEvery = 10_000, 20 })},
		{"s0.9/uniform40K/100", with(func(t *trace) { t.scanRows, t.scanEvery = 40_000, 100 })},
		{"s0.8/popular20K", with(func(t *trace) { t.zipf, t.scanZipf = 0.8, true })},
		{"s0.9/popular20K", with(func(t *trace) { t.scanZipf = true })},
		{"s1.0/popular20K", with(func(t *trace) { t.zipf, t.scanZipf = 1.0, true })},
		{"s0.9/popular40K/100", with(func(t *trace) { t.scanZipf, t.scanRows, t.scanEvery = true, 40_000, 100 })},
		{"s0.9/popular20K/repeat0.2", with(func(t *trace) { t.scanZipf, t.locality = true, 0.2 })},
	}
}

// tierPolicy runs a Tier as a simPolicy, one access at a time.
type tierPolicy struct {
	t *Tier
	c Changes
}

func (p *tierPolicy) access(k uint64, sig Signal) bool {
	p.c.Reset()
	p.t.Access([]PageKey{{Page: k}}, sig, &p.c)
	return p.c.Hits > 0
}

// policies are the candidates, by name, each a constructor for a capacity.
func policies() []struct {
	name string
	new  func(capPages int) simPolicy
} {
	return []struct {
		name string
		new  func(capPages int) simPolicy
	}{
		{"LRU", func(c int) simPolicy { return newSimLRU(c) }},
		{"SLRU(v1)", func(c int) simPolicy { return newSimSLRU(c) }},
		{"S3FIFO", func(c int) simPolicy { return newSimS3FIFO(c, prefillAll) }},
		{"S3FIFO/pf=ghost", func(c int) simPolicy { return newSimS3FIFO(c, prefillGhost) }},
		{"S3FIFO/pf=none", func(c int) simPolicy { return newSimS3FIFO(c, prefillNone) }},
		{"SIEVE", func(c int) simPolicy { return newSimSIEVE(c, true) }},
		{"SIEVE/pf=none", func(c int) simPolicy { return newSimSIEVE(c, false) }},
		{"ChunkSLRU", func(c int) simPolicy { return newSimChunkSLRU(c) }},
		{"Tier", func(c int) simPolicy { return &tierPolicy{t: NewTier(int64(c) * PageSize)} }},
	}
}

// simHitRatio replays ops through p: the hit ratio of the counted decode
// lookups.
func simHitRatio(p simPolicy, ops []traceOp) float64 {
	hits, lookups := 0, 0
	for _, op := range ops {
		for _, k := range op.keys {
			hit := p.access(k.Page, op.sig)
			if op.counted {
				lookups++
				if hit {
					hits++
				}
			}
		}
	}
	return float64(hits) / float64(lookups)
}

// BenchmarkPolicy prints the decode hit ratio of every candidate policy on
// every trace, side by side (and reports each as a metric):
//
//	go test -run '^$' -bench Policy -benchtime 1x ./cache
//
// ENGRAMFS_POLICIES=LRU,Tier limits the policies (comma-separated names).
func BenchmarkPolicy(b *testing.B) {
	ps := policies()
	if only := os.Getenv("ENGRAMFS_POLICIES"); only != "" {
		var keep = ps[:0]
		for _, p := range ps {
			if strings.Contains(","+only+",", ","+p.name+",") {
				keep = append(keep, p)
			}
		}
		ps = keep
	}
	traces := policyTraces()
	ratios := make([][]float64, len(traces))
	for i, tr := range traces {
		ops := tr.tc.ops(1)
		capPages := tr.tc.rows / 50
		ratios[i] = make([]float64, len(ps))
		var wg sync.WaitGroup
		for j, p := range ps {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ratios[i][j] = simHitRatio(p.new(capPages), ops)
			}()
		}
		wg.Wait()
		for j, p := range ps {
			b.Run(tr.name+"/"+p.name, func(b *testing.B) {
				for b.Loop() {
				}
				b.ReportMetric(ratios[i][j], "hit_ratio")
			})
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%-28s", "trace \\ policy")
	for _, p := range ps {
		fmt.Fprintf(&sb, " %16s", p.name)
	}
	for i, tr := range traces {
		fmt.Fprintf(&sb, "\n%-28s", tr.name)
		for j := range ps {
			fmt.Fprintf(&sb, " %16.4f", ratios[i][j])
		}
	}
	fmt.Println(sb.String())
}

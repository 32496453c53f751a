package tests

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/testenv"
)

// Eight rank processes on one node, each hinting its decode steps (72
// Zipf-popular rows per layer, hint + read barrier) and, every few steps,
// its next prefill chunk (on a second handle, never waited on), against one
// process doing the same alone. The target: each rank's decode
// barrier p99 ≤ 2× the single process's p99. Ratios, not times, and no
// assertion on them: run it alone, e.g.
//
//	ENGRAMFS_REQUIRE_FUSE=1 go test -run '^$' -bench 'HintsEightRanks' -benchtime 1x ./tests/
//
// Each rank is this test binary run again, as a rank by TestMain (a process
// of its own, as an engine's ranks are: its own control handles, its own
// faults), told what to do through rankEnv.

// rankWork is one rank's share of the workload.
type rankWork struct {
	Mount     string
	Rank      int    // which row range of each layer is this rank's
	Ranks     int    // how many ranges the rows are split into
	RowsTotal uint64 // rows of each table
	Layers    int
	Steps     int // decode steps measured (after a few unmeasured ones)
	ChunkRows int // prefill rows per layer per chunk
	// ChunkEvery: a prefill chunk is hinted every ChunkEvery decode steps.
	ChunkEvery int
	ComputeMs  int    // the step's "compute" after its barrier
	Salt       uint64 // which rows are popular: a run's own, so another run's pinned rows do not help it
}

// rankResult is what a rank reports, in µs: each measured decode step
// (hint + barrier) and each prefill chunk's writes (its hint only: nobody
// waits for prefill, but the rank's thread is in write(2) meanwhile).
type rankResult struct {
	Rank      int
	BarrierUs []int64
	PrefillUs []int64
}

const rankEnv = "ENGRAMFS_RANK_HELPER"

func BenchmarkHintsEightRanks(b *testing.B) {
	const ranks = 8
	spec := benchModel(b, ranks*8000)
	d := Mount(b, Synth(b, spec))
	work := rankWork{Mount: d.Mountpoint, Ranks: ranks, RowsTotal: uint64(spec.Rows), Layers: spec.Layers,
		Steps: 200, ChunkRows: 3000, ChunkEvery: 4, ComputeMs: 5}

	// The daemon's CPU in each phase, in cores: near the node's two, the
	// ranks wait for the daemon's capacity, not for its scheduling.
	cpu := func(run func()) float64 {
		c0, err := procfs.CPU(d.Pid())
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		run()
		c1, err := procfs.CPU(d.Pid())
		if err != nil {
			b.Fatal(err)
		}
		return float64(c1-c0) / float64(time.Since(t0))
	}
	alone := work
	alone.Salt = 1
	var single rankResult
	aloneCPU := cpu(func() { single = runRanks(b, alone, 1)[0] })

	all := work
	all.Salt = 2
	var results []rankResult
	allCPU := cpu(func() { results = runRanks(b, all, ranks) })
	b.ReportMetric(aloneCPU, "alone-daemon-cores")
	b.ReportMetric(allCPU, "ranks-daemon-cores")

	q := func(us []int64, q float64) float64 {
		s := slices.Clone(us)
		slices.Sort(s)
		return float64(s[min(len(s)-1, int(q*float64(len(s))))]) / 1000
	}
	base := q(single.BarrierUs, 0.99)
	worst, worstP50, worstPrefill := 0.0, 0.0, 0.0
	for _, r := range results {
		v := q(r.BarrierUs, 0.99)
		worst = max(worst, v)
		worstP50 = max(worstP50, q(r.BarrierUs, 0.5))
		worstPrefill = max(worstPrefill, q(r.PrefillUs, 0.99))
		b.ReportMetric(v, fmt.Sprintf("rank%d-p99-ms", r.Rank))
	}
	b.ReportMetric(q(single.PrefillUs, 0.99), "alone-prefill-write-p99-ms")
	b.ReportMetric(worstPrefill, "worst-prefill-write-p99-ms")
	b.ReportMetric(q(single.BarrierUs, 0.5), "alone-p50-ms")
	b.ReportMetric(base, "alone-p99-ms")
	b.ReportMetric(worst, "worst-p99-ms")
	b.ReportMetric(worstP50/q(single.BarrierUs, 0.5), "worst-ratio-p50")
	b.ReportMetric(worst/base, "worst-ratio-p99")
	st := d.Stats(b)
	if st.PrefetchPagesFailed != 0 {
		b.Fatalf("%d pages failed", st.PrefetchPagesFailed)
	}
}

// runRanks runs n rank processes at once, ranks 0..n-1 of w, and returns
// their reports.
func runRanks(b *testing.B, w rankWork, n int) []rankResult {
	b.Helper()
	type ran struct {
		out    bytes.Buffer
		errOut bytes.Buffer
		err    error
	}
	runs := make([]*ran, n)
	var wg sync.WaitGroup
	for i := range n {
		w := w
		w.Rank = i
		arg, err := json.Marshal(w)
		if err != nil {
			b.Fatal(err)
		}
		r := &ran{}
		runs[i] = r
		cmd := exec.Command(os.Args[0]) // TestMain runs it as a rank
		cmd.Env = append(os.Environ(), rankEnv+"="+string(arg))
		cmd.Stdout, cmd.Stderr = &r.out, &r.errOut
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.err = cmd.Run()
		}()
	}
	wg.Wait()
	out := make([]rankResult, n)
	for i, r := range runs {
		if r.err != nil {
			b.Fatalf("rank %d: %v\n%s\n%s", i, r.err, r.out.String(), r.errOut.String())
		}
		line := r.out.Bytes()
		if j := bytes.Index(line, []byte("RANK ")); j >= 0 {
			line = line[j+5:]
		}
		if j := bytes.IndexByte(line, '\n'); j >= 0 {
			line = line[:j]
		}
		if err := json.Unmarshal(line, &out[i]); err != nil || len(out[i].BarrierUs) == 0 {
			b.Fatalf("rank %d: report %q: %v", i, r.out.String(), err)
		}
	}
	return out
}

// TestMain runs this binary as one rank of BenchmarkHintsEightRanks when
// rankEnv says so, and as the test binary otherwise.
func TestMain(m *testing.M) {
	if arg := os.Getenv(rankEnv); arg != "" {
		if err := runRank(arg); err != nil {
			fmt.Fprintln(os.Stderr, "rank:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(testenv.Run(m))
}

// runRank is one rank of BenchmarkHintsEightRanks, in a process of its own.
func runRank(arg string) error {
	var w rankWork
	if err := json.Unmarshal([]byte(arg), &w); err != nil {
		return err
	}
	dec, err := client.Open(w.Mount) // decode steps and their barriers
	if err != nil {
		return err
	}
	defer dec.Close()
	pre, err := client.Open(w.Mount) // prefill chunks, never waited on
	if err != nil {
		return err
	}
	defer pre.Close()

	per := w.RowsTotal / uint64(w.Ranks)
	start := uint64(w.Rank) * per
	rng := rand.New(rand.NewPCG(uint64(w.Rank), w.Salt))
	// Zipf-popular rows of this rank's range: a few rows take most lookups.
	zipf := rand.NewZipf(rng, 1.1, 1, per-1)
	row := func(popularity uint64) uint64 { return start + (popularity*7919+w.Salt*104729)%per }
	const warmup = 5
	res := rankResult{Rank: w.Rank}
	for step := range warmup + w.Steps {
		if step%w.ChunkEvery == 0 { // the next chunk's rows, hinted a chunk ahead
			t0 := time.Now()
			for layer := range w.Layers {
				chunk := make([]uint64, w.ChunkRows)
				for i := range chunk {
					chunk[i] = start + rng.Uint64N(per)
				}
				if err := pre.Prefill(layer, chunk); err != nil {
					return err
				}
			}
			if step >= warmup {
				res.PrefillUs = append(res.PrefillUs, time.Since(t0).Microseconds())
			}
		}
		t0 := time.Now()
		for layer := range w.Layers {
			rows := make([]uint64, 72)
			for i := range rows {
				rows[i] = row(zipf.Uint64())
			}
			if err := dec.Decode(layer, rows); err != nil {
				return err
			}
		}
		st, err := dec.Barrier()
		took := time.Since(t0)
		if err != nil {
			return err
		}
		if st.Dropped != 0 || st.Resident+st.Pinned != st.Pages {
			return fmt.Errorf("step %d: decode barrier status %+v", step, st)
		}
		if step >= warmup {
			res.BarrierUs = append(res.BarrierUs, took.Microseconds())
		}
		time.Sleep(time.Duration(w.ComputeMs) * time.Millisecond)
	}
	line, err := json.Marshal(res)
	if err != nil {
		return err
	}
	fmt.Println("RANK " + string(line))
	return nil
}

package tests

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
)

// The hint path's targets, measured against a real mount: a decode step
// beside a blocked prefill barrier or a prefill flood stays within a small
// ratio of the same step alone, and partial frames do not grow the daemon's
// RSS. Ratios, not times: run them alone, e.g.
//
//	ENGRAMFS_REQUIRE_FUSE=1 go test -run '^$' -bench 'Hints' -benchtime 1x ./tests/

// decodeSteps runs n decode steps (72 cold rows, hint + read barrier) on h
// and returns the time of each.
func decodeSteps(b *testing.B, h *client.Hinter, rng *rand.Rand, rows uint64, n int) []time.Duration {
	b.Helper()
	out := make([]time.Duration, 0, n)
	for range n {
		step := randomRows(rng, 72, rows)
		start := time.Now()
		if err := h.Decode(0, step); err != nil {
			b.Fatal(err)
		}
		if _, err := h.Barrier(); err != nil {
			b.Fatal(err)
		}
		out = append(out, time.Since(start))
	}
	return out
}

func quantile(d []time.Duration, q float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

func benchModel(b *testing.B, rows uint64) backing.SynthSpec {
	spec := geometries()["4096B"]
	spec.Rows = rows
	return spec
}

// A decode step beside another process blocked on a large prefill barrier,
// against the same step alone (target: ≤ 1.5×).
func BenchmarkHintsDecodeBesidePrefillBarrier(b *testing.B) {
	spec := benchModel(b, 60000)
	d := Mount(b, Synth(b, spec), "--inject-faults", "latency=1ms", "--queue-depth", "8")
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	rng := rand.New(rand.NewPCG(70, 71))
	decodeSteps(b, h, rng, spec.Rows, 5) // warm the paths
	alone := decodeSteps(b, h, rng, spec.Rows, 30)

	cmd, exited, _ := startHint(b, d, randomRows(rng, 40000, spec.Rows), "0")
	waitForB(b, func() bool { return d.Stats(b).HintFrames > 0 })
	beside := decodeSteps(b, h, rng, spec.Rows, 30)
	select {
	case <-exited:
		b.Logf("warning: the prefill barrier ended during the measurement")
	default:
	}
	_ = cmd.Process.Kill()
	<-exited
	b.ReportMetric(float64(quantile(alone, 0.5).Microseconds()), "alone-p50-µs")
	b.ReportMetric(float64(quantile(beside, 0.5).Microseconds()), "beside-p50-µs")
	b.ReportMetric(float64(quantile(beside, 0.5))/float64(quantile(alone, 0.5)), "ratio-p50")
}

// A decode step while four other handles flood 4M-row prefill frames,
// against the same step alone (target: ≤ 2×).
func BenchmarkHintsDecodeBesidePrefillFlood(b *testing.B) {
	spec := benchModel(b, 60000)
	d := Mount(b, Synth(b, spec), "--inject-faults", "latency=1ms", "--queue-depth", "8")
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	rng := rand.New(rand.NewPCG(80, 81))
	decodeSteps(b, h, rng, spec.Rows, 5)
	alone := decodeSteps(b, h, rng, spec.Rows, 30)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 4 {
		f, err := client.Open(d.Mountpoint)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		frame := randomRows(rand.New(rand.NewPCG(90, uint64(i))), hints.MaxRowsPerFrame, spec.Rows)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := f.Prefill(0, frame); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	waitForB(b, func() bool { return d.Stats(b).HintRows >= 4<<20 }) // the flood is on
	beside := decodeSteps(b, h, rng, spec.Rows, 30)
	rows := d.Stats(b).HintRows
	close(stop)
	wg.Wait()
	b.ReportMetric(float64(rows)/(1<<20), "flood-Mrows")
	b.ReportMetric(float64(quantile(alone, 0.5).Microseconds()), "alone-p50-µs")
	b.ReportMetric(float64(quantile(beside, 0.5).Microseconds()), "flood-p50-µs")
	b.ReportMetric(float64(quantile(beside, 0.5))/float64(quantile(alone, 0.5)), "ratio-p50")
}

// 64 handles each holding a nearly complete 4M-row frame: the daemon holds
// no partial frame (rows are queued as they arrive), so its RSS barely
// moves.
func BenchmarkHintsPartialFramesRSS(b *testing.B) {
	spec := benchModel(b, 4000)
	d := Mount(b, Synth(b, spec))
	pid := d.Pid()
	before := rssBytes(b, pid)
	frame := hints.AppendBinary(nil, hints.Prefill, 0, make([]uint64, hints.MaxRowsPerFrame)) // row 0, repeated
	frame = frame[:len(frame)-8]                                                              // one row short
	var files []*os.File
	for range 64 {
		f, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_RDWR, 0)
		if err != nil {
			b.Fatal(err)
		}
		files = append(files, f)
		if _, err := syscall.Write(int(f.Fd()), frame); err != nil {
			b.Fatal(err)
		}
	}
	after := rssBytes(b, pid)
	for _, f := range files {
		f.Close()
	}
	b.ReportMetric(float64(before)/(1<<20), "rss-before-MiB")
	b.ReportMetric(float64(after)/(1<<20), "rss-after-MiB")
	b.ReportMetric(float64(after-before)/(1<<20), "rss-growth-MiB")
}

func waitForB(b *testing.B, cond func() bool) {
	b.Helper()
	waitFor(b, "the other clients", cond)
}

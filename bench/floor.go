package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"sync/atomic"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
)

// BurstSizes are the bursts whose latency the step floor is interpolated
// from (the fio table: batches of 1, 8, 16, 32, 64 and 128).
var BurstSizes = []int{1, 8, 16, 32, 64, 128}

// BurstFloor is how long a burst of n random 4 KiB O_DIRECT reads,
// submitted together, takes on the disk under the shards, for a few n: the
// floor of a decode step whose rows need n cold reads, since its reads can
// at best all be in flight at once. It includes one wake-up of the read
// engine's reaper (the submission's), as every read the daemon submits
// from another thread does. On the VMs engramfs was built on the
// disk serves a burst in about 35-40 µs × n (it answers a whole queue with
// one interrupt), so the floor grows with the step's cold reads.
type BurstFloor struct {
	Engine string       `json:"engine"` // the read engine that submitted them (io_uring, or pread where io_uring is refused)
	Points []BurstPoint `json:"points"` // by N, ascending
}

// BurstPoint is the latency of bursts of N reads: submission of the first
// to completion of the last.
type BurstPoint struct {
	N    int           `json:"n"`
	P50  time.Duration `json:"p50_ns"`
	P99  time.Duration `json:"p99_ns"`
	Runs int           `json:"runs"`
}

// MeasureBursts times runs bursts of each size in ns, over random 4 KiB
// blocks of files (O_DIRECT: the disk's own latency, no page cache), one
// burst at a time, through the daemon's own read engine (engine: auto is
// io_uring where the kernel allows it, one submission for the whole burst).
func MeasureBursts(ctx context.Context, files []string, ns []int, runs int, engine string) (*BurstFloor, error) {
	if len(ns) == 0 || runs < 1 {
		return nil, fmt.Errorf("burst floor: need burst sizes and at least one run")
	}
	bs, err := openBlocks(files)
	if err != nil {
		return nil, fmt.Errorf("burst floor: %w", err)
	}
	defer bs.close()
	maxN := slices.Max(ns)
	eng, _, err := ioengine.New(engine, maxN)
	if err != nil {
		return nil, fmt.Errorf("burst floor: %w", err)
	}
	defer eng.Close()
	bufs := make([][]byte, maxN)
	for i := range bufs {
		bufs[i] = backing.AlignedBuf(diskBlock, diskBlock)
	}
	rng := rand.New(rand.NewPCG(uint64(maxN), 0xb0257))
	var spin atomic.Int32
	f := &BurstFloor{Engine: eng.Name()}
	for _, n := range slices.Sorted(slices.Values(ns)) {
		times := make([]time.Duration, 0, runs)
		for range runs {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			reqs := make([]*ioengine.Req, n)
			var left atomic.Int64
			var firstErr atomic.Pointer[error]
			left.Store(int64(n))
			for i := range reqs {
				fd, off := bs.pick(rng)
				// Done runs on the io_uring reaper, or on any of the pread
				// engine's workers at once.
				reqs[i] = &ioengine.Req{Fd: fd, Off: off, Buf: bufs[i], Demand: true, Done: func(_ int, err error) {
					if err != nil {
						firstErr.CompareAndSwap(nil, &err)
					}
					if left.Add(-1) == 0 {
						spin.Store(1)
					}
				}}
			}
			spin.Store(0)
			start := time.Now()
			eng.Submit(reqs...)
			// Spin for the last completion: waking a goroutine that sleeps
			// on a channel added ~40 µs to a lone read here (186 µs a burst
			// of 1 against 115-141 µs spinning, a QD1 pread 103-123 µs).
			for spin.Load() == 0 {
				runtime.Gosched()
			}
			if err := firstErr.Load(); err != nil {
				return nil, fmt.Errorf("burst floor: O_DIRECT read: %w", *err)
			}
			times = append(times, time.Since(start))
		}
		s := Summarize(times)
		f.Points = append(f.Points, BurstPoint{N: n, P50: s.P50, P99: s.P99, Runs: s.N})
	}
	return f, nil
}

// At is the floor of a step with n cold reads: the p50 burst latency
// interpolated linearly between the measured sizes, from 0 at n = 0, and
// past the largest size along the last segment's slope (latency grows about
// linearly with n on these disks).
func (f *BurstFloor) At(n float64) time.Duration {
	if f == nil || len(f.Points) == 0 || n <= 0 {
		return 0
	}
	prev := BurstPoint{}
	for i, p := range f.Points {
		if n <= float64(p.N) || i == len(f.Points)-1 {
			if i > 0 {
				prev = f.Points[i-1]
			}
			if p.N == prev.N {
				return p.P50
			}
			slope := float64(p.P50-prev.P50) / float64(p.N-prev.N)
			return max(0, prev.P50+time.Duration(slope*(n-float64(prev.N))))
		}
	}
	return 0 // not reached
}

// bestBursts combines measurements of the same disk into the best each
// burst size showed (the lowest p50): other work only makes a measurement
// worse.
func bestBursts(runs []*BurstFloor) *BurstFloor {
	var best *BurstFloor
	for _, f := range runs {
		if f == nil {
			continue
		}
		if best == nil {
			best = &BurstFloor{Engine: f.Engine, Points: slices.Clone(f.Points)}
			continue
		}
		for _, p := range f.Points {
			i := sort.Search(len(best.Points), func(i int) bool { return best.Points[i].N >= p.N })
			switch {
			case i == len(best.Points) || best.Points[i].N != p.N:
				best.Points = slices.Insert(best.Points, i, p)
			case p.P50 < best.Points[i].P50:
				best.Points[i] = p
			}
		}
	}
	return best
}

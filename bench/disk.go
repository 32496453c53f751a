package bench

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DiskLimit is the physical limit of the disk under the shards, measured in
// the same run: 4 KiB O_DIRECT random reads (no page cache, no readahead).
type DiskLimit struct {
	QD1  Summary         `json:"qd1_latency"` // one read at a time
	IOPS map[int]float64 `json:"iops"`        // by queue depth (32, 64)
	// Files are the shards read; Bytes their total size.
	Files []string `json:"files"`
	Bytes int64    `json:"bytes"`
}

// BestIOPS is the highest measured IOPS (0 when none).
func (d *DiskLimit) BestIOPS() float64 {
	var best float64
	for _, v := range d.IOPS {
		best = max(best, v)
	}
	return best
}

const diskBlock = 4096

// MeasureDisk reads random 4 KiB blocks of files with O_DIRECT: for dur at
// queue depth 1 (latency), then for dur at each of qds (IOPS), with one
// goroutine per queue slot doing pread. GOMAXPROCS is raised to the queue
// depth meanwhile: a goroutine in a blocking syscall holds its P until the
// runtime's monitor hands the P off (20 µs or more), which would add that
// much to every read past GOMAXPROCS in flight and measure the runtime, not
// the disk.
func MeasureDisk(ctx context.Context, files []string, dur time.Duration, qds []int, progress func(string)) (*DiskLimit, error) {
	type target struct {
		fd     int
		blocks int64
	}
	var targets []target
	var total int64
	d := &DiskLimit{IOPS: map[int]float64{}, Files: files}
	for _, path := range files {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("disk limit: open %s with O_DIRECT: %w", path, err)
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, err
		}
		if st.Size >= diskBlock {
			targets = append(targets, target{fd: fd, blocks: st.Size / diskBlock})
			total += st.Size
		}
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("disk limit: no file of 4 KiB or more among %v", files)
	}
	d.Bytes = total

	// reader does random reads until stop; lat, if not nil, gets each latency.
	reader := func(seed uint64, stop <-chan struct{}, lat *[]time.Duration) (int, error) {
		rng := rand.New(rand.NewPCG(seed, 0xd15c))
		buf := alignedBlock()
		n := 0
		for {
			select {
			case <-stop:
				return n, nil
			default:
			}
			// Pick a block uniformly over all bytes, whatever the file.
			b := rng.Int64N(total / diskBlock)
			var tg target
			for _, t := range targets {
				if b < t.blocks {
					tg = t
					break
				}
				b -= t.blocks
			}
			start := time.Now()
			if _, err := unix.Pread(tg.fd, buf, b*diskBlock); err != nil && err != unix.EINTR {
				return n, fmt.Errorf("disk limit: O_DIRECT pread: %w", err)
			}
			if lat != nil {
				*lat = append(*lat, time.Since(start))
			}
			n++
		}
	}
	run := func(qd int) (float64, []time.Duration, error) {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		counts := make([]int, qd)
		errs := make([]error, qd)
		var lat []time.Duration
		start := time.Now()
		err := withProcs(qd+2, func() error {
			for i := range qd {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var lp *[]time.Duration
					if qd == 1 {
						lp = &lat
					}
					counts[i], errs[i] = reader(uint64(qd<<16|i), stop, lp)
				}()
			}
			select {
			case <-time.After(dur):
			case <-ctx.Done():
			}
			close(stop)
			wg.Wait()
			return nil
		})
		elapsed := time.Since(start)
		if err != nil {
			return 0, nil, err
		}
		if ctx.Err() != nil {
			return 0, nil, ctx.Err()
		}
		n := 0
		for i := range qd {
			if errs[i] != nil {
				return 0, nil, errs[i]
			}
			n += counts[i]
		}
		return float64(n) / elapsed.Seconds(), lat, nil
	}

	if progress != nil {
		progress("disk limit: 4 KiB O_DIRECT random reads, QD1")
	}
	_, lat, err := run(1)
	if err != nil {
		return nil, err
	}
	d.QD1 = Summarize(lat)
	for _, qd := range qds {
		if progress != nil {
			progress(fmt.Sprintf("disk limit: 4 KiB O_DIRECT random reads, QD%d", qd))
		}
		iops, _, err := run(qd)
		if err != nil {
			return nil, err
		}
		d.IOPS[qd] = iops
	}
	return d, nil
}

// alignedBlock returns a 4 KiB buffer aligned to 4 KiB, as O_DIRECT needs
// (memory alignment is at most the logical block size, 4 KiB at most here).
func alignedBlock() []byte {
	b := make([]byte, 2*diskBlock)
	skip := (diskBlock - int(uintptr(unsafe.Pointer(&b[0]))%diskBlock)) % diskBlock
	return b[skip : skip+diskBlock : skip+diskBlock]
}

// bestDisk combines measurements of the same disk into the best it showed:
// the lowest QD1 latency and the highest IOPS at each queue depth. Other
// work on the machine only ever makes a measurement worse, so the best is
// the closest to what the disk can do (and the strictest limit to compare with).
func bestDisk(runs []*DiskLimit) *DiskLimit {
	var best *DiskLimit
	for _, d := range runs {
		if best == nil {
			c := *d
			c.IOPS = maps.Clone(d.IOPS)
			best = &c
			continue
		}
		if d.QD1.P50 < best.QD1.P50 {
			best.QD1 = d.QD1
		}
		for qd, v := range d.IOPS {
			best.IOPS[qd] = max(best.IOPS[qd], v)
		}
	}
	return best
}

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
	bs, err := openBlocks(files)
	if err != nil {
		return nil, fmt.Errorf("disk limit: %w", err)
	}
	defer bs.close()
	d := &DiskLimit{IOPS: map[int]float64{}, Files: files, Bytes: bs.blocks * diskBlock}

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
			fd, off := bs.pick(rng)
			start := time.Now()
			if _, err := unix.Pread(fd, buf, off); err != nil && err != unix.EINTR {
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

// blockSet is the 4 KiB blocks of some files opened with O_DIRECT, for
// random reads of the disk itself (no page cache, no readahead).
type blockSet struct {
	fds    []int
	counts []int64 // blocks of each file
	blocks int64
}

func openBlocks(files []string) (*blockSet, error) {
	bs := &blockSet{}
	for _, path := range files {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			bs.close()
			return nil, fmt.Errorf("open %s with O_DIRECT: %w", path, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			bs.close()
			return nil, err
		}
		if n := st.Size / diskBlock; n > 0 {
			bs.fds, bs.counts = append(bs.fds, fd), append(bs.counts, n)
			bs.blocks += n
		} else {
			unix.Close(fd)
		}
	}
	if bs.blocks == 0 {
		return nil, fmt.Errorf("no file of 4 KiB or more among %v", files)
	}
	return bs, nil
}

// pick draws a block uniformly over all the files' blocks, whatever the file.
func (bs *blockSet) pick(rng *rand.Rand) (fd int, off int64) {
	b := rng.Int64N(bs.blocks)
	for i, n := range bs.counts {
		if b < n {
			return bs.fds[i], b * diskBlock
		}
		b -= n
	}
	return bs.fds[len(bs.fds)-1], 0 // not reached
}

func (bs *blockSet) close() {
	for _, fd := range bs.fds {
		unix.Close(fd)
	}
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

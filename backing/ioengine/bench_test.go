package ioengine

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/testenv"
)

// benchFileSize is large enough that random 4 KiB reads do not hit the
// device's cache much; reads are O_DIRECT, so the page cache is out anyway.
const benchFileSize = 1 << 30

var (
	benchOnce sync.Once
	benchDir  string
	benchPath string
	benchErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if benchDir != "" {
		os.RemoveAll(benchDir)
	}
	testenv.RemoveBinaries()
	os.Exit(code)
}

// benchFile creates the 1 GiB file of random data once per test binary;
// TestMain removes it. ENGRAMFS_BENCH_FILE names an existing file instead.
func benchFile(b *testing.B) string {
	benchOnce.Do(func() {
		if p := os.Getenv("ENGRAMFS_BENCH_FILE"); p != "" {
			benchPath = p
			return
		}
		benchDir, benchErr = os.MkdirTemp("", "ioengine-bench-")
		if benchErr != nil {
			return
		}
		benchPath = filepath.Join(benchDir, "shard")
		benchErr = writeRandomFile(benchPath, benchFileSize)
	})
	if benchErr != nil {
		b.Fatal(benchErr)
	}
	return benchPath
}

func writeRandomFile(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	// Reserve the extents first so the file is laid out in one go, as the
	// shards are.
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		return fmt.Errorf("fallocate: %w", err)
	}
	rng := rand.New(rand.NewPCG(42, 42))
	block := make([]byte, 4<<20)
	for off := int64(0); off < size; off += int64(len(block)) {
		for i := 0; i < len(block); i += 8 {
			v := rng.Uint64()
			for j := range 8 {
				block[i+j] = byte(v >> (8 * j))
			}
		}
		if _, err := f.WriteAt(block, off); err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	// Drop the written pages: O_DIRECT does not use them, but they would
	// take memory from the other engineers' builds on this machine.
	return unix.Fadvise(int(f.Fd()), 0, size, unix.FADV_DONTNEED)
}

// BenchmarkRandRead4K keeps qd random 4 KiB O_DIRECT reads in flight: each
// Done submits the next read, as a prefetcher with a full queue does. CPU
// µs/read is the whole process's user+system time per read (getrusage), the
// number to compare with fio's ~18 µs; ctxsw/read counts voluntary and
// involuntary switches, the cost these VMs make expensive.
func BenchmarkRandRead4K(b *testing.B) {
	for _, kind := range []string{"io_uring", "pread"} {
		for _, qd := range []int{1, 64} {
			b.Run(fmt.Sprintf("%s/qd%d", kind, qd), func(b *testing.B) { benchRandRead(b, kind, qd) })
		}
	}
}

func benchRandRead(b *testing.B, kind string, qd int) {
	path := benchFile(b)
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		b.Fatal(err)
	}
	pages := st.Size / 4096
	e := newEngine(b, kind, qd)
	defer e.Close()

	var issued, completed atomic.Int64
	var failed atomic.Value
	finished := make(chan struct{})
	total := int64(b.N)
	reqs := make([]*Req, min(int64(qd), total))
	for i := range reqs {
		rng := rand.New(rand.NewPCG(uint64(i), 5))
		r := &Req{Fd: fd, Buf: alignedBuf(4096, 4096)}
		r.Off = rng.Int64N(pages) * 4096
		r.Done = func(n int, err error) {
			if err != nil || n != 4096 {
				failed.Store(fmt.Sprintf("read at %d: n=%d err=%v", r.Off, n, err))
			}
			if completed.Add(1) == total {
				close(finished)
			}
			if issued.Add(1) <= total {
				r.Off = rng.Int64N(pages) * 4096
				e.Submit(r)
			}
		}
		reqs[i] = r
	}
	issued.Store(int64(len(reqs)))

	before, t0 := rusage(b), time.Now()
	b.ResetTimer()
	e.Submit(reqs...)
	<-finished
	b.StopTimer()
	elapsed, after := time.Since(t0), rusage(b)
	if v := failed.Load(); v != nil {
		b.Fatal(v)
	}

	n := float64(b.N)
	cpu := (tv(after.Utime) + tv(after.Stime) - tv(before.Utime) - tv(before.Stime)).Seconds()
	b.ReportMetric(n/elapsed.Seconds(), "IOPS")
	b.ReportMetric(cpu*1e6/n, "cpu-µs/read")
	b.ReportMetric(float64(after.Nvcsw+after.Nivcsw-before.Nvcsw-before.Nivcsw)/n, "ctxsw/read")
	if s, ok := e.(interface{ Stats() Stats }); ok {
		st := s.Stats()
		b.ReportMetric(float64(st.Enters)/n, "enters/read")
		b.ReportMetric(float64(st.Wakeups)/n, "wakeups/read")
	}
}

func rusage(b *testing.B) unix.Rusage {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru
}

func tv(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }

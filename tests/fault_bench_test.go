package tests

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

// BenchmarkColdFault faults random rows of a cold 1 GiB table three ways in
// one run: through engramfs, and through the shard mapped directly with and
// without MADV_RANDOM. It reports time per fault and backing bytes per fault
// for each, and their ratios (engramfs / shard). Backing bytes: engramfs's
// stats for the mount; for a direct mapping, the shard pages the fault made
// resident (mincore), which is what readahead cost.
//
//	go test -run '^$' -bench ColdFault -benchtime 2000x ./tests
func BenchmarkColdFault(b *testing.B) {
	RequireFUSE(b)
	spec := backing.DefaultSynth()
	spec.Layers = 1
	spec.Rows = 1 << 18 // 1 GiB of 4 KiB weight rows
	d := Mount(b, Synth(b, spec), "--cache-size", "0")
	m := Model(b, d.ModelDir)
	tb := m.LayerTables(0)[1]
	rng := rand.New(rand.NewPCG(1, 1))
	rows := make([]uint64, b.N)
	for i := range rows {
		rows[i] = rng.Uint64N(tb.Rows)
	}

	// Mapped pages survive drop_caches: each run gets its own mapping and
	// unmaps it before the next run drops the caches.
	residentPages := func(mm []byte) int {
		n := 0
		for _, r := range resident(b, mm) {
			if r {
				n++
			}
		}
		return n
	}
	type result struct{ nsPerFault, bytesPerFault float64 }
	run := func(mm []byte, base int64, rowBytes int64) time.Duration {
		dropCaches(b)
		start := time.Now()
		for _, r := range rows {
			Touch(mm, int(base+int64(r)*rowBytes))
		}
		return time.Since(start)
	}
	b.ResetTimer()

	// engramfs.
	ff, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
	if err != nil {
		b.Fatal(err)
	}
	fsMap, err := unix.Mmap(int(ff.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED)
	ff.Close()
	if err != nil {
		b.Fatal(err)
	}
	if err := unix.Madvise(fsMap, unix.MADV_RANDOM); err != nil {
		b.Fatal(err)
	}
	before := d.Stats(b)
	cpu0 := CPU(b, before.Pid)
	el := run(fsMap, int64(len(tb.FileHeader)), tb.RowBytes)
	cpu := CPU(b, before.Pid) - cpu0
	after := d.Stats(b)
	fs := result{float64(el.Nanoseconds()) / float64(b.N), float64(after.BackingBytes-before.BackingBytes) / float64(b.N)}
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "daemon_cpu_us/fault")
	b.ReportMetric(float64(after.BackingReads-before.BackingReads)/float64(b.N), "backing_reads/fault")

	if err := unix.Munmap(fsMap); err != nil {
		b.Fatal(err)
	}

	// The shard, mapped directly.
	var direct [2]result
	for i, advice := range []int{unix.MADV_RANDOM, -1} {
		f, err := os.Open(tb.Shard.Path)
		if err != nil {
			b.Fatal(err)
		}
		mm, err := unix.Mmap(int(f.Fd()), 0, int(tb.Shard.Size), unix.PROT_READ, unix.MAP_SHARED)
		f.Close()
		if err != nil {
			b.Fatal(err)
		}
		if advice >= 0 {
			if err := unix.Madvise(mm, advice); err != nil {
				b.Fatal(err)
			}
		}
		el := run(mm, tb.DataStart, tb.RowBytes)
		direct[i] = result{float64(el.Nanoseconds()) / float64(b.N), float64(residentPages(mm)*4096) / float64(b.N)}
		if err := unix.Munmap(mm); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(fs.nsPerFault, "engramfs_ns/fault")
	b.ReportMetric(direct[0].nsPerFault, "mmap_random_ns/fault")
	b.ReportMetric(direct[1].nsPerFault, "mmap_ns/fault")
	b.ReportMetric(fs.bytesPerFault, "engramfs_B/fault")
	b.ReportMetric(direct[0].bytesPerFault, "mmap_random_B/fault")
	b.ReportMetric(direct[1].bytesPerFault, "mmap_B/fault")
	b.ReportMetric(fs.nsPerFault/direct[0].nsPerFault, "time_vs_mmap_random")
	b.ReportMetric(fs.nsPerFault/direct[1].nsPerFault, "time_vs_mmap")
	b.ReportMetric(fs.bytesPerFault/direct[1].bytesPerFault, "bytes_vs_mmap")
	b.ReportMetric(0, "ns/op")
}

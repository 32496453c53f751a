package tests

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

// BenchmarkModelDirSequentialRead reads files of the model directory
// straight through (1 MiB reads, as cp, sha256sum or a loader's copy do),
// cold, four ways in one run, and reports each one's MB/s and their ratios:
//
//   - shard_direct: the shard in MODEL_DIR itself;
//   - shard_mount: the same shard through the mount (FUSE passthrough where
//     the kernel allows it);
//   - shard_daemon: through a second mount with --passthrough=false (the
//     daemon reads it, with its sequential readahead);
//   - table: a 64 MiB table file of the mount (the daemon's readahead;
//     its backing reads are O_DIRECT, so always from the disk).
//
// Each mount path also reports the daemon's CPU per MiB read (on a busy
// node the daemon's readahead is CPU-bound: two copies of every byte, into
// its buffer and into the page cache).
//
// Cold means evicted with FADV_DONTNEED, file by file (the backing shard,
// and the mount's own page cache where it has one): no drop_caches. The
// shard is written back first: FADV_DONTNEED leaves dirty pages, and the
// freshly synthesized shard read "directly" from them ran at 4-6 GB/s.
//
//	go test -run '^$' -bench ModelDirSequentialRead -benchtime 5x ./tests
func BenchmarkModelDirSequentialRead(b *testing.B) {
	RequireFUSE(b)
	spec := backing.DefaultSynth()
	spec.Layers = 1 // one shard: a 64 MiB weight table and a 2 MiB scale table
	dir := Synth(b, spec)
	pt := Mount(b, dir, "--cache-size", "0")
	daemon := Mount(b, dir, "--cache-size", "0", "--passthrough=false")
	tb := Model(b, dir).LayerTables(0)[1]
	shard := filepath.Base(tb.Shard.Path)
	paths := []struct {
		name  string
		path  string
		evict []string
		d     *Daemon // whose CPU the path costs; nil: none
	}{
		{"shard_direct", filepath.Join(dir, shard), []string{filepath.Join(dir, shard)}, nil},
		{"shard_mount", filepath.Join(pt.Mountpoint, shard), []string{filepath.Join(dir, shard)}, pt},
		{"shard_daemon", filepath.Join(daemon.Mountpoint, shard), []string{filepath.Join(dir, shard), filepath.Join(daemon.Mountpoint, shard)}, daemon},
		{"table", filepath.Join(pt.Mountpoint, tb.Path()), []string{filepath.Join(pt.Mountpoint, tb.Path())}, pt},
	}
	elapsed := make([]time.Duration, len(paths))
	cpu := make([]time.Duration, len(paths))
	bytes := make([]int64, len(paths))
	buf := make([]byte, 1<<20)
	b.ResetTimer()
	for range b.N {
		for i, p := range paths {
			for _, e := range p.evict {
				evict(b, e)
			}
			var cpu0 time.Duration
			if p.d != nil {
				cpu0 = CPU(b, p.d.Pid())
			}
			start := time.Now()
			n := readThrough(b, p.path, buf)
			elapsed[i] += time.Since(start)
			bytes[i] += n
			if p.d != nil {
				cpu[i] += CPU(b, p.d.Pid()) - cpu0
			}
		}
	}
	b.StopTimer()
	mbps := map[string]float64{}
	for i, p := range paths {
		mbps[p.name] = float64(bytes[i]) / elapsed[i].Seconds() / 1e6
		b.ReportMetric(mbps[p.name], p.name+"_MB/s")
		if p.d != nil {
			b.ReportMetric(cpu[i].Seconds()*1e3/(float64(bytes[i])/(1<<20)), p.name+"_daemon_cpu_ms/MiB")
		}
	}
	b.ReportMetric(mbps["shard_mount"]/mbps["shard_direct"], "shard_mount/direct")
	b.ReportMetric(mbps["shard_daemon"]/mbps["shard_direct"], "shard_daemon/direct")
	b.ReportMetric(mbps["table"]/mbps["shard_direct"], "table/shard_direct")
	b.ReportMetric(mbps["table"]/mbps["shard_mount"], "table/shard_mount")
}

// evict drops path's clean pages from the page cache.
func evict(tb testing.TB, path string) {
	tb.Helper()
	f, err := os.Open(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	// Dirty pages stay cached through FADV_DONTNEED. A file of the mount
	// has none (and answers ENOSYS or EOPNOTSUPP to fsync).
	if err := unix.Fdatasync(int(f.Fd())); err != nil && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EOPNOTSUPP) {
		tb.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		tb.Fatal(err)
	}
}

// readThrough reads path from start to end with buf and returns its size.
func readThrough(tb testing.TB, path string, buf []byte) int64 {
	tb.Helper()
	f, err := os.Open(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	// Neither side's ReadFrom/WriteTo: reads of exactly len(buf).
	n, err := io.CopyBuffer(struct{ io.Writer }{io.Discard}, struct{ io.Reader }{f}, buf)
	if err != nil {
		tb.Fatal(err)
	}
	return n
}

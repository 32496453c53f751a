package backing

import (
	"fmt"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkReadTablePage is the fault path's backing read: one random 4 KiB
// data page of a 256 MiB table, cold (the shard is dropped from the page
// cache first; buffered reads drop what they read, direct reads bypass it).
// The table's data starts at an unaligned shard offset, as in real
// checkpoints, so a direct read fetches the aligned superset: backing_B/op
// shows what that costs. qd1 is one reader; qd32 is 32 readers through a
// queue depth of 32.
func BenchmarkReadTablePage(b *testing.B) {
	spec := DefaultSynth()
	spec.Layers, spec.Rows, spec.WeightRow, spec.ScaleRow = 1, 65536, 4096, 4 // 256 MiB of weight rows
	dir := b.TempDir()
	if err := Synthesize(dir, spec); err != nil {
		b.Fatal(err)
	}
	m, err := Load(dir, DefaultTablePattern)
	if err != nil {
		b.Fatal(err)
	}
	tb := m.Tables[1]
	if tb.Kind != "weight" || tb.DataLen != 256<<20 {
		b.Fatalf("table %s of %d bytes", tb.Name, tb.DataLen)
	}
	dropShards(b, m)
	pages := tb.DataLen / PageSize

	for _, mode := range []IOMode{IODirect, IOBuffered} {
		for _, qd := range []int{1, 32} {
			b.Run(fmt.Sprintf("%s/qd%d", mode, qd), func(b *testing.B) {
				s, st := openStore(b, m, mode, qd)
				dropShards(b, m)
				before := st.Snapshot()
				b.SetBytes(PageSize)
				b.ResetTimer()
				if qd == 1 {
					rng := rand.New(rand.NewPCG(1, 2))
					for b.Loop() {
						if _, err := ReadTable(s, tb, rng.Int64N(pages)*PageSize, PageSize); err != nil {
							b.Fatal(err)
						}
					}
				} else {
					b.SetParallelism((qd + 1) / 2) // x GOMAXPROCS goroutines; 2 CPUs here
					var seed atomic.Uint64
					b.RunParallel(func(pb *testing.PB) {
						rng := rand.New(rand.NewPCG(seed.Add(1), 2))
						for pb.Next() {
							if _, err := ReadTable(s, tb, rng.Int64N(pages)*PageSize, PageSize); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				b.StopTimer()
				after := st.Snapshot()
				reads := after.BackingReads - before.BackingReads
				if reads == 0 {
					return
				}
				b.ReportMetric(float64(after.BackingBytes-before.BackingBytes)/float64(reads), "backing_B/op")
			})
		}
	}
}

// dropShards writes back and drops m's shards from the page cache.
func dropShards(b *testing.B, m *Model) {
	b.Helper()
	for _, sh := range m.Shards {
		f, err := os.Open(sh.Path)
		if err != nil {
			b.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			b.Fatal(err)
		}
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
}

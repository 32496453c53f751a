package tests

import (
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/testenv"
)

// BenchmarkHotGatherAfterDropCaches: a decode workload makes rows hot through
// decode hints; then, after drop_caches (memory pressure at its harshest),
// one decode step of hot rows is gathered, with the hot tier on and off.
// It reports the step's gather time and the FUSE reads it caused.
//
//	go test -run '^$' -bench HotGather -benchtime 20x ./tests
func BenchmarkHotGatherAfterDropCaches(b *testing.B) {
	RequireFUSE(b)
	spec := backing.DefaultSynth()
	spec.Layers = 1
	spec.Rows = 1 << 16
	model := Synth(b, spec)
	for _, tier := range []string{"64MiB", "0"} {
		b.Run("cache-size="+tier, func(b *testing.B) {
			d := Mount(b, model, "--cache-size", tier)
			m := Model(b, d.ModelDir)
			ctl := openControl(b, d)
			z := newZipfRows(80, spec.Rows)
			var trace [][]uint64
			for range 300 { // warm-up: the decode trace that makes rows hot
				rows := z.step(72)
				decodeStep(b, ctl, 0, rows)
				trace = append(trace, rows)
			}
			maps := map[*backing.Table][]byte{}
			for _, tb := range m.LayerTables(0) {
				mm := testenv.MapFile(b, filepath.Join(d.Mountpoint, tb.Path()))
				if err := unix.Madvise(mm, unix.MADV_RANDOM); err != nil {
					b.Fatal(err)
				}
				maps[tb] = mm
			}
			settle(b, d)
			var total time.Duration
			var fuse uint64
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				dropCaches(b)
				step := z.step(72) // a new step of Zipf-popular rows
				before := d.Stats(b)
				b.StartTimer()
				start := time.Now()
				for tb, mm := range maps {
					for _, r := range step {
						Touch(mm, len(tb.FileHeader)+int(r)*int(tb.RowBytes))
					}
				}
				total += time.Since(start)
				b.StopTimer()
				fuse += d.Stats(b).FuseReads - before.FuseReads
			}
			b.ReportMetric(float64(total.Microseconds())/float64(b.N), "µs/step")
			b.ReportMetric(float64(fuse)/float64(b.N), "fuse_reads/step")
			b.ReportMetric(0, "ns/op")
		})
	}
}

package hints

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// benchLayers has one layer of 16M rows, so row ids take ~8 decimal digits.
var benchLayers = layers{0: 1 << 24}

func benchRows(n int) []uint64 {
	r := rand.New(rand.NewPCG(1, 2))
	rows := make([]uint64, n)
	for i := range rows {
		rows[i] = r.Uint64N(1 << 24)
	}
	return rows
}

// Sizes from the workload: ~72 rows per layer per decode step, 10K-40K per
// prefill chunk.
var benchSizes = []int{72, 40000}

func benchmarkDecode(b *testing.B, encode func([]byte, Class, int, []uint64) []byte) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("rows=%d", n), func(b *testing.B) {
			frame := encode(nil, Prefill, 0, benchRows(n))
			d := NewDecoder(benchLayers)
			b.SetBytes(int64(len(frame)))
			b.ReportAllocs()
			for b.Loop() {
				frames, err := d.Write(frame)
				if err != nil || len(frames) != 1 {
					b.Fatal(frames, err)
				}
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
		})
	}
}

func BenchmarkDecodeBinary(b *testing.B) { benchmarkDecode(b, AppendBinary) }
func BenchmarkDecodeText(b *testing.B)   { benchmarkDecode(b, AppendText) }

func BenchmarkAppendBinary(b *testing.B) {
	rows := benchRows(40000)
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendBinary(buf[:0], Prefill, 0, rows)
	}
	b.ReportMetric(40000*float64(b.N)/b.Elapsed().Seconds(), "rows/s")
}

package metrics

import (
	"testing"
	"time"
)

// BenchmarkFaultServed is what metrics add to a FUSE READ of a table file
// (two clock reads are on top of it, in fs).
func BenchmarkFaultServed(b *testing.B) {
	tm := NewTimings(testModel(b))
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			tm.FaultServed(1, 40*time.Microsecond)
		}
	})
}

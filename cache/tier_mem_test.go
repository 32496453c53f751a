package cache

import (
	"runtime"
	"testing"
)

// heapInUse is the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkTierMemory is the tier's metadata per tracked page (in the tier
// or on the ghost list) at 1M pages of capacity, from the heap delta:
//
//	go test -run '^$' -bench TierMemory -benchtime 1x ./cache
func BenchmarkTierMemory(b *testing.B) {
	const capPages = 1 << 20
	for b.Loop() {
		before := heapInUse()
		tr := NewTier(capPages * PageSize)
		var c Changes
		keys := make([]PageKey, 0, 1024)
		// 2x capacity of distinct pages: a full tier and a full ghost list.
		for p := uint64(0); p < 2*capPages; p += 1024 {
			keys = keys[:0]
			for i := range uint64(1024) {
				keys = append(keys, PageKey{Table: uint32(p % 7), Page: p + i})
			}
			c.Reset()
			tr.Access(keys, SignalDecode, &c)
		}
		c = Changes{}
		keys = nil
		after := heapInUse()
		tracked := tr.Len() + tr.ghostLen()
		b.ReportMetric(float64(after-before)/float64(tracked), "B/tracked_page")
		b.ReportMetric(float64(after-before)/float64(tr.Len()), "B/pinned_page")
		b.ReportMetric(float64(tracked), "tracked_pages")
		runtime.KeepAlive(tr)
	}
}

package backing

import (
	"testing"
	"unsafe"
)

// TestSlab: buffers carved from a chunk are aligned, exactly as long as
// asked (capacity included, so an append cannot reach a neighbour), and never
// overlap; large ones get their own allocation.
func TestSlab(t *testing.T) {
	for _, memAl := range []int64{1, 512, 4096} {
		var s slab
		type span struct{ lo, hi uintptr }
		var spans []span
		var keep [][]byte // live, so that no chunk is freed and reused
		for i, n := range []int{4096, 512, 4096, 8192, 100, 4096, slabChunk / 4, 4096, slabChunk, 4096} {
			for range 40 {
				b := s.get(n, memAl)
				if len(b) != n || cap(b) != n {
					t.Fatalf("memAl %d, read %d: len %d cap %d, want %d", memAl, i, len(b), cap(b), n)
				}
				at := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
				if memAl > 1 && at%uintptr(memAl) != 0 {
					t.Fatalf("memAl %d: buffer at %#x is not aligned", memAl, at)
				}
				for _, sp := range spans {
					if at < sp.hi && sp.lo < at+uintptr(n) {
						t.Fatalf("memAl %d: buffer [%#x, %#x) overlaps [%#x, %#x)", memAl, at, at+uintptr(n), sp.lo, sp.hi)
					}
				}
				spans = append(spans, span{at, at + uintptr(n)})
				keep = append(keep, b)
				b[0], b[n-1] = 1, 1 // writable
			}
		}
		_ = keep
	}
}

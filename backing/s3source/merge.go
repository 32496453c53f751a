package s3source

import (
	"slices"

	"github.com/engramfs/engramfs/backing"
)

// span is one GET: bytes [off, off+n) of a shard, and the reads it answers.
type span struct {
	off, n int64
	want   int64                // bytes of [off, off+n) that some read asked for
	reads  []*backing.ShardRead // sorted by Off
	demand bool                 // a reader is blocked on one of the reads
}

// plan merges reads submitted together into spans: a read joins the span
// before it when the gap between them is at most gap bytes, the span stays
// within max bytes, and the span's bytes that no read asked for stay within
// waste times the bytes its reads want. A GET's first byte costs ~17-20 ms
// on S3 Standard while 64 KiB more of its body costs well under a
// millisecond, so nearby reads are one GET; but the gaps are bytes paid
// for and moved, so a dense run of reads carries a gap and two lone pages
// 60 KiB apart do not (with waste 0.25: at most 1.25 bytes fetched per byte
// wanted; a hinted decode step fetched 3.8 bytes per page byte with the gap
// rule alone). A read longer than max is a span of its own. reads must be
// in range and non-empty.
func plan(reads []*backing.ShardRead, gap, max int64, waste float64) []span {
	sorted := slices.Clone(reads)
	slices.SortStableFunc(sorted, func(a, b *backing.ShardRead) int {
		switch {
		case a.Off < b.Off:
			return -1
		case a.Off > b.Off:
			return 1
		}
		return 0
	})
	var spans []span
	for _, r := range sorted {
		end := r.Off + int64(r.Len)
		if k := len(spans) - 1; k >= 0 {
			s := &spans[k]
			n := max64(end, s.off+s.n) - s.off
			want := s.want + max64(0, end-max64(r.Off, s.off+s.n))
			if r.Off <= s.off+s.n+gap && n <= max && float64(n-want) <= waste*float64(want) {
				s.n, s.want = n, want
				s.reads = append(s.reads, r)
				s.demand = s.demand || r.Demand
				continue
			}
		}
		spans = append(spans, span{off: r.Off, n: int64(r.Len), want: int64(r.Len), reads: []*backing.ShardRead{r}, demand: r.Demand})
	}
	return spans
}

// answer hands each read of s its bytes of buf (the span's bytes). Reads
// that overlap an earlier one get a copy: data belongs to its receiver.
func (s span) answer(buf []byte) {
	var covered int64 // end of the bytes already handed out
	for _, r := range s.reads {
		lo, hi := r.Off-s.off, r.Off-s.off+int64(r.Len)
		data := buf[lo:hi:hi]
		if r.Off < covered {
			data = slices.Clone(data)
		}
		covered = max64(covered, r.Off+int64(r.Len))
		r.Done(data, nil)
	}
}

func (s span) fail(err error) {
	for _, r := range s.reads {
		r.Done(nil, err)
	}
}

func max64(a, b int64) int64 { return max(a, b) }

package backing

import (
	"time"

	"github.com/engramfs/engramfs/internal/stats"
)

// Timed returns r with every read timed, from its submission to its
// answer, into tm.BackingRead; with tm nil it returns r itself, so the data
// path reads no clock and tests no flag when metrics are off. The timing is
// a wrapper chosen once, at setup, not a branch per read. A SyncReader stays
// one (the fault path reads inline through it).
func Timed(r Reader, tm stats.Timings) Reader {
	if tm == nil {
		return r
	}
	t := timedReader{r: r, tm: tm}
	if sr, ok := r.(SyncReader); ok {
		return timedSyncReader{timedReader: t, sr: sr}
	}
	return t
}

type timedReader struct {
	r  Reader
	tm stats.Timings
}

type timedSyncReader struct {
	timedReader
	sr SyncReader
}

var _ SyncReader = timedSyncReader{}

func (t timedReader) Submit(reads ...*TableRead) { t.r.Submit(t.timed(reads)...) }

func (t timedSyncReader) ReadSync(reads ...*TableRead) { t.sr.ReadSync(t.timed(reads)...) }

// timed copies reads, each with a Done that reports its time first.
func (t timedReader) timed(reads []*TableRead) []*TableRead {
	start := time.Now()
	out := make([]*TableRead, len(reads))
	for i, r := range reads {
		c := *r
		c.Done = func(data []byte, err error) {
			t.tm.BackingRead(r.Table.ID, time.Since(start))
			r.Done(data, err)
		}
		out[i] = &c
	}
	return out
}

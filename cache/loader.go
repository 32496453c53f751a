package cache

import (
	"fmt"
	"sync"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// MaxRunPages caps one coalesced backing read (1 MiB): large enough to keep a
// disk streaming, small enough that one run does not hold a queue slot for
// long.
const MaxRunPages = 256

// Origin says who asked for a page; the loader uses it to count late
// prefetches (a fault that caught a prefetch still in flight).
type Origin uint8

const (
	// OriginFault is a FUSE read: a reader is blocked on the page.
	OriginFault Origin = iota
	// OriginPrefetch is hint-driven work.
	OriginPrefetch
)

// Loader is the read-through page loader of every table file: the fault path
// and the prefetch path both go through it, so a page is read from backing
// once even when a fault and a hint want it at the same moment
// (singleflight per page). It keeps no data: the kernel page cache is the
// cache, the loader only owns reads in flight.
type Loader struct {
	src    backing.Reader
	tables []*backing.Table
	st     *stats.Counters

	mu      sync.Mutex
	flights map[PageKey]*flight // GUARDED_BY(mu)
}

type flight struct {
	done   chan struct{}
	origin Origin
	data   []byte // set before done closes
	err    error  // set before done closes
}

// NewLoader reads the pages of tables through src.
func NewLoader(src backing.Reader, tables []*backing.Table, st *stats.Counters) *Loader {
	return &Loader{src: src, tables: tables, st: st, flights: map[PageKey]*flight{}}
}

// Table returns table id, or nil.
func (l *Loader) Table(id uint32) *backing.Table {
	if int(id) >= len(l.tables) {
		return nil
	}
	return l.tables[id]
}

// Load returns the data of file pages [first, first+n) of table id, one
// slice per page (the last page of a file may be short). Header pages are
// not the loader's business: first must be at least the table's DataPage.
// Pages another caller is already reading are waited for, not read again;
// the rest are read in runs of adjacent pages, one backing read per run.
// The returned slices must not be modified. When some pages fail, the error
// is the first failure and exactly the failed pages are nil.
//
// LOCKS_EXCLUDED(l.mu)
func (l *Loader) Load(id uint32, first, n uint64, origin Origin) ([][]byte, error) {
	t := l.Table(id)
	if t == nil {
		return nil, fmt.Errorf("no table %d", id)
	}
	if first < t.DataPage() || first+n > t.Pages() || first+n < first {
		return nil, fmt.Errorf("table %s: pages [%d, +%d) outside data pages [%d, %d)", t.Name, first, n, t.DataPage(), t.Pages())
	}
	fl := make([]*flight, n)
	mine := make([]bool, n)
	l.mu.Lock()
	for i := range fl {
		k := PageKey{Table: id, Page: first + uint64(i)}
		if f, ok := l.flights[k]; ok {
			fl[i] = f
			if origin == OriginFault && f.origin == OriginPrefetch {
				l.st.PrefetchLate.Add(1)
			}
			continue
		}
		f := &flight{done: make(chan struct{}), origin: origin}
		l.flights[k] = f
		fl[i], mine[i] = f, true
	}
	l.mu.Unlock()

	// Read our runs; a failed run fails only its own pages.
	for i := 0; i < len(fl); {
		if !mine[i] {
			i++
			continue
		}
		j := i + 1
		for j < len(fl) && mine[j] && j-i < MaxRunPages {
			j++
		}
		l.readRun(t, id, first+uint64(i), fl[i:j])
		i = j
	}

	out := make([][]byte, n)
	var firstErr error
	for i, f := range fl {
		<-f.done
		if f.err != nil && firstErr == nil {
			firstErr = f.err
		}
		out[i] = f.data
	}
	return out, firstErr
}

// readRun reads pages [first, first+len(fl)) with one backing read and
// completes their flights.
func (l *Loader) readRun(t *backing.Table, id uint32, first uint64, fl []*flight) {
	dataOff := int64(first-t.DataPage()) * PageSize
	length := min(int64(len(fl))*PageSize, t.DataLen-dataOff)
	buf, err := l.read(t, dataOff, length)
	if err != nil && len(fl) > 1 {
		// One bad page must not fail its neighbours: read the run again a
		// page at a time, so the good pages of a hint still land.
		for i := range fl {
			lo := dataOff + int64(i)*PageSize
			fl[i].data, fl[i].err = l.read(t, lo, min(PageSize, t.DataLen-lo))
		}
	} else {
		for i, f := range fl {
			lo := int64(i) * PageSize
			if err != nil {
				f.err = err
			} else {
				f.data = buf[lo:min(lo+PageSize, length):min(lo+PageSize, length)]
			}
		}
	}
	l.mu.Lock()
	for i := range fl {
		delete(l.flights, PageKey{Table: id, Page: first + uint64(i)})
	}
	l.mu.Unlock()
	for _, f := range fl {
		close(f.done)
	}
}

// read is one backing read; a short result is an error, never data.
func (l *Loader) read(t *backing.Table, off, n int64) ([]byte, error) {
	buf, err := l.src.ReadTable(t, off, int(n))
	if err == nil && int64(len(buf)) != n {
		return nil, fmt.Errorf("table %s: backing returned %d of %d bytes at %d", t.Name, len(buf), n, off)
	}
	return buf, err
}

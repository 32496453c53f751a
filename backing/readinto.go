package backing

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/engramfs/engramfs/backing/ioengine"
)

// IntoReader reads table data into a buffer of the caller's: the daemon's
// sequential readahead reads a window straight into the buffer it then
// stores in the page cache, with no copy, no per-page bookkeeping and no
// fresh (zeroed) buffer per read. The fault and prefetch paths keep going
// through the loader (singleflight, negative cache, fault injection).
type IntoReader interface {
	// ReadInto reads n bytes of t's data at off into buf and returns the
	// slice of buf that holds them. buf must start at an IntoAlign-aligned
	// address and hold n+2*IntoAlign bytes (under O_DIRECT the read is of
	// the aligned superset). A shard that cannot read into a buffer (an
	// object store) answers an error matching errors.ErrUnsupported: read
	// through the loader then.
	ReadInto(t *Table, off int64, n int, buf []byte) ([]byte, error)
}

// IntoAlign is the alignment ReadInto needs of buf's address and slack:
// the largest O_DIRECT alignment it serves.
const IntoAlign = 4096

var _ IntoReader = (*Store)(nil)

// intoShard is a ShardFile that can read into a given buffer.
type intoShard interface {
	readInto(off int64, n int, buf []byte) ([]byte, error)
}

// ReadInto reads on the calling goroutine; see IntoReader.
func (s *Store) ReadInto(t *Table, off int64, n int, buf []byte) ([]byte, error) {
	if off < 0 || n < 0 || off > t.DataLen || int64(n) > t.DataLen-off {
		return nil, fmt.Errorf("table %s: read [%d, +%d) outside its %d data bytes", t.Name, off, n, t.DataLen)
	}
	sf, ok := s.files[t.Shard].(intoShard)
	if !ok {
		return nil, fmt.Errorf("table %s: shard %s: reads into a buffer: %w", t.Name, t.Shard.Path, errors.ErrUnsupported)
	}
	start := time.Now()
	data, err := sf.readInto(t.DataStart+off, n, buf)
	if tm := s.st.Timings; tm != nil && !errors.Is(err, errors.ErrUnsupported) && !errors.Is(err, ErrClosed) {
		// As Timed does for the loader's reads: backing_read_seconds
		// counts every backing read that backing_reads counts.
		tm.BackingRead(t.ID, time.Since(start))
	}
	if err != nil && !errors.Is(err, errors.ErrUnsupported) {
		s.st.BackingErrors.Add(1)
		err = fmt.Errorf("table %s: %w", t.Name, err)
	}
	return data, err
}

// readInto is ReadSync of one read into buf (see IntoReader).
func (sf *localShard) readInto(off int64, n int, buf []byte) ([]byte, error) {
	start, end := off, off+int64(n)
	if sf.direct {
		if sf.align > IntoAlign || sf.memAl > IntoAlign {
			return nil, fmt.Errorf("shard %s: O_DIRECT alignment %d/%d: %w", sf.path, sf.align, sf.memAl, errors.ErrUnsupported)
		}
		start = start / sf.align * sf.align
		end = (end + sf.align - 1) / sf.align * sf.align
	}
	if end-start > int64(len(buf)) || (len(buf) > 0 && uintptr(unsafe.Pointer(&buf[0]))%IntoAlign != 0) {
		return nil, fmt.Errorf("shard %s: %d bytes at %d into a buffer of %d: %w", sf.path, n, off, len(buf), errors.ErrUnsupported)
	}
	sf.mu.RLock()
	if sf.closed {
		sf.mu.RUnlock()
		return nil, fmt.Errorf("shard %s: %w", sf.path, ErrClosed)
	}
	sf.inflight.Add(1)
	sf.mu.RUnlock()
	defer sf.inflight.Done()
	buf = buf[: end-start : end-start]
	sf.st.BackingReads.Add(1)
	sf.st.BackingBytes.Add(uint64(len(buf)))
	got, err := PreadFull(sf.fd, buf, start)
	return sf.complete(&ShardRead{Off: off, Len: n}, start, buf, got, err, ioengine.Observe())
}

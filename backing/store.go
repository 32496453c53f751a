package backing

import (
	"errors"
	"fmt"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/stats"
)

// IOMode says how shard files are read.
type IOMode string

const (
	// IOAuto uses O_DIRECT where the backing filesystem accepts it, else buffered.
	IOAuto IOMode = "auto"
	// IODirect reads with O_DIRECT: an aligned superset of the range, no
	// backing page cache, no readahead.
	IODirect IOMode = "direct"
	// IOBuffered reads through the backing page cache with FADV_RANDOM (no
	// readahead: NFS would otherwise pull a 1 MiB window per row) and drops
	// what it read with FADV_DONTNEED, so a row is not cached twice.
	IOBuffered IOMode = "buffered"
)

// ParseIOMode checks a --backing-io value.
func ParseIOMode(s string) (IOMode, error) {
	switch m := IOMode(s); m {
	case IOAuto, IODirect, IOBuffered:
		return m, nil
	}
	return "", fmt.Errorf("backing I/O mode %q: want auto, direct or buffered", s)
}

// Reader reads a byte range of a table's data (off is relative to row 0).
// It is the seam where tests inject backing faults.
type Reader interface {
	ReadTable(t *Table, off int64, n int) ([]byte, error)
}

// ErrShardChanged means a shard file's size or mtime differs from when the
// model was loaded: its bytes can no longer be trusted at the offsets we know.
var ErrShardChanged = errors.New("shard changed since mount")

// Store reads tables from their shard files with a bounded queue depth.
type Store struct {
	st    *stats.Counters
	slots chan struct{} // a token per read in flight: blocking preads pin OS threads
	files map[*Shard]*shardFile

	// readHook, set only by tests, runs while a read holds its queue slot,
	// so tests can see how many reads are in flight.
	readHook func()
}

type shardFile struct {
	f      *os.File
	direct bool
	align  int64 // O_DIRECT offset and length alignment
	memAl  int64 // O_DIRECT buffer alignment
	size   int64
	mtime  time.Time
}

// Open opens every shard of m. queueDepth bounds the backing reads in flight
// across all shards.
func Open(m *Model, mode IOMode, queueDepth int, st *stats.Counters) (*Store, error) {
	if queueDepth < 1 {
		return nil, fmt.Errorf("queue depth %d: must be at least 1", queueDepth)
	}
	s := &Store{st: st, slots: make(chan struct{}, queueDepth), files: map[*Shard]*shardFile{}}
	for _, sh := range m.Shards {
		sf, err := openShardFile(sh, mode)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.files[sh] = sf
	}
	return s, nil
}

// Direct reports whether shard sh is read with O_DIRECT.
func (s *Store) Direct(sh *Shard) bool { return s.files[sh].direct }

func openShardFile(sh *Shard, mode IOMode) (*shardFile, error) {
	if mode != IOBuffered {
		sf, err := openDirect(sh)
		if err == nil {
			return sf, nil
		}
		if mode == IODirect {
			return nil, fmt.Errorf("shard %s: O_DIRECT: %w", sh.Path, err)
		}
	}
	f, err := os.Open(sh.Path)
	if err != nil {
		return nil, fmt.Errorf("shard %s: %w", sh.Path, err)
	}
	// FADV_RANDOM turns off readahead for this open file (NFS included).
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		f.Close()
		return nil, fmt.Errorf("shard %s: fadvise random: %w", sh.Path, err)
	}
	return newShardFile(sh, f, false, 1, 1)
}

func openDirect(sh *Shard) (*shardFile, error) {
	fd, err := unix.Open(sh.Path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), sh.Path)
	align, memAl := int64(4096), int64(4096)
	var sx unix.Statx_t
	if unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &sx) == nil && sx.Mask&unix.STATX_DIOALIGN != 0 {
		if sx.Dio_offset_align == 0 {
			f.Close()
			return nil, errors.New("the filesystem does not support O_DIRECT on this file")
		}
		align, memAl = int64(sx.Dio_offset_align), int64(sx.Dio_mem_align)
	}
	sf, err := newShardFile(sh, f, true, align, memAl)
	if err != nil {
		return nil, err
	}
	// Some filesystems accept O_DIRECT at open and refuse it at read: probe.
	if sh.Size > 0 {
		buf := alignedBuf(int(align), memAl)
		if _, err := unix.Pread(fd, buf, 0); err != nil {
			f.Close()
			return nil, err
		}
	}
	return sf, nil
}

func newShardFile(sh *Shard, f *os.File, direct bool, align, memAl int64) (*shardFile, error) {
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("shard %s: %w", sh.Path, err)
	}
	if fi.Size() != sh.Size {
		f.Close()
		return nil, fmt.Errorf("shard %s: %w (size %d, was %d)", sh.Path, ErrShardChanged, fi.Size(), sh.Size)
	}
	return &shardFile{f: f, direct: direct, align: align, memAl: memAl, size: fi.Size(), mtime: fi.ModTime()}, nil
}

// pageSize is the page of the backing page cache.
var pageSize = int64(os.Getpagesize())

// alignedBuf returns n bytes whose address is a multiple of memAl.
func alignedBuf(n int, memAl int64) []byte {
	if memAl <= 1 {
		return make([]byte, n)
	}
	b := make([]byte, n+int(memAl))
	skip := int(memAl-int64(uintptr(unsafe.Pointer(&b[0])))%memAl) % int(memAl)
	return b[skip : skip+n : skip+n]
}

// ReadTable reads n bytes of t's data at off. Under O_DIRECT the returned
// slice is a window of a larger aligned buffer: no copy is made.
func (s *Store) ReadTable(t *Table, off int64, n int) ([]byte, error) {
	if off < 0 || n < 0 || off > t.DataLen || int64(n) > t.DataLen-off { // no off+n: it can overflow
		return nil, fmt.Errorf("table %s: read [%d, +%d) outside its %d data bytes", t.Name, off, n, t.DataLen)
	}
	sf := s.files[t.Shard]
	if sf == nil {
		return nil, fmt.Errorf("table %s: shard %s is not open", t.Name, t.Shard.Path)
	}
	abs := t.DataStart + off
	s.slots <- struct{}{}
	if s.readHook != nil {
		s.readHook()
	}
	var buf []byte
	var err error
	if tm := s.st.Timings; tm != nil {
		start := time.Now()
		buf, err = sf.read(abs, n, s.st)
		tm.BackingRead(t.ID, time.Since(start))
	} else {
		buf, err = sf.read(abs, n, s.st)
	}
	<-s.slots
	if err != nil {
		s.st.BackingErrors.Add(1)
		return nil, fmt.Errorf("table %s: shard %s: offset %d: %w", t.Name, t.Shard.Path, abs, err)
	}
	return buf, nil
}

func (sf *shardFile) read(abs int64, n int, st *stats.Counters) ([]byte, error) {
	start, end := abs, abs+int64(n)
	if sf.direct {
		start = abs / sf.align * sf.align
		end = (end + sf.align - 1) / sf.align * sf.align
	}
	buf := alignedBuf(int(end-start), sf.memAl)
	fd := int(sf.f.Fd())
	st.BackingReads.Add(1)
	st.BackingBytes.Add(uint64(len(buf)))
	got, err := preadFull(fd, buf, start)
	if !sf.direct {
		// The rows now live in engramfs's page cache; drop the shard's copy.
		// The kernel drops only pages wholly inside the range, and table
		// data starts at any shard offset, so widen it to whole pages.
		// (A length of 0 would mean "to the end of the file".)
		if lo, hi := start/pageSize*pageSize, (end+pageSize-1)/pageSize*pageSize; hi > lo {
			_ = unix.Fadvise(fd, lo, hi-lo, unix.FADV_DONTNEED)
		}
	}
	if err != nil {
		return nil, err
	}
	// The tail of an aligned superset may lie past the end of the file.
	if int64(got) < abs+int64(n)-start {
		return nil, fmt.Errorf("%w: short read: %d of %d bytes (the shard is shorter than at mount)", ErrShardChanged, got, abs+int64(n)-start)
	}
	if err := sf.check(); err != nil {
		return nil, err
	}
	return buf[abs-start : abs-start+int64(n)], nil
}

// check refuses data read from a shard that was truncated or rewritten in
// place since mount: our offsets came from its old header. One fstat costs
// well under a microsecond against ~60 µs for the read it guards.
func (sf *shardFile) check() error {
	var s unix.Stat_t
	if err := unix.Fstat(int(sf.f.Fd()), &s); err != nil {
		return err
	}
	if s.Size != sf.size || !time.Unix(s.Mtim.Unix()).Equal(sf.mtime) {
		return fmt.Errorf("%w (size %d, was %d; mtime %v, was %v)", ErrShardChanged, s.Size, sf.size,
			time.Unix(s.Mtim.Unix()), sf.mtime)
	}
	return nil
}

// preadFull reads until buf is full, EOF, or an error; EINTR and short reads
// are retried.
func preadFull(fd int, buf []byte, off int64) (int, error) {
	done := 0
	for done < len(buf) {
		n, err := unix.Pread(fd, buf[done:], off+int64(done))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return done, err
		}
		if n == 0 {
			return done, nil
		}
		done += n
	}
	return done, nil
}

// Close closes every shard file.
func (s *Store) Close() error {
	var first error
	for sh, sf := range s.files {
		if err := sf.f.Close(); err != nil && first == nil {
			first = fmt.Errorf("shard %s: %w", sh.Path, err)
		}
	}
	s.files = nil
	return first
}

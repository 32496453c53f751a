package backing

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/internal/stats"
)

// IOMode says how local shard files are read.
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

// LocalSource is a model directory on a local filesystem or NFS.
type LocalSource struct {
	dir    string
	mode   IOMode
	engine ioengine.Engine // nil: only metadata reads (model loading)
	st     *stats.Counters // may be nil

	// forceAlign, set only by tests, makes O_DIRECT reads align to at least
	// this many bytes (4K-sector NVMe), whatever the host's disk reports.
	forceAlign int64
}

// NewLocalSource serves the files of dir. engine runs the data-path reads
// of the shards it opens, and they are counted in st; both may be nil when
// the source only loads a model.
func NewLocalSource(dir string, mode IOMode, engine ioengine.Engine, st *stats.Counters) *LocalSource {
	if st == nil {
		st = &stats.Counters{}
	}
	return &LocalSource{dir: dir, mode: mode, engine: engine, st: st}
}

var _ Source = (*LocalSource)(nil)

func (s *LocalSource) String() string { return s.dir }

// List returns the names in the directory that end in suffix, sorted.
func (s *LocalSource) List(suffix string) ([]string, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("model directory %s: %w", s.dir, err)
	}
	var names []string // sorted, as ReadDir returns them
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), suffix) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// ReadFile reads a small file of the directory.
func (s *LocalSource) ReadFile(name string, limit int64) ([]byte, error) {
	path := filepath.Join(s.dir, name)
	f, err := OpenRegular(path, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: over the limit of %d bytes", path, limit)
	}
	return b, nil
}

// Open opens shard name: with O_DIRECT where the mode allows and the
// filesystem accepts it, else buffered with FADV_RANDOM.
func (s *LocalSource) Open(name string) (ShardFile, error) {
	path := filepath.Join(s.dir, name)
	if s.mode != IOBuffered {
		sf, err := s.openDirect(path)
		if err == nil {
			return sf, nil
		}
		if s.mode == IODirect {
			return nil, fmt.Errorf("shard %s: O_DIRECT: %w", path, err)
		}
	}
	f, err := OpenRegular(path, 0)
	if err != nil {
		return nil, fmt.Errorf("shard: %w", err)
	}
	// FADV_RANDOM turns off readahead for this open file (NFS included).
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		f.Close()
		return nil, fmt.Errorf("shard %s: fadvise random: %w", path, err)
	}
	return s.newShard(path, f, false, 1, 1)
}

func (s *LocalSource) openDirect(path string) (*localShard, error) {
	f, align, memAl, err := OpenDirect(path, s.forceAlign)
	if err != nil {
		return nil, err
	}
	sf, err := s.newShard(path, f, true, align, memAl)
	if err != nil {
		return nil, err
	}
	if sf.id.Size > 0 {
		if err := ProbeDirect(f, align, memAl); err != nil {
			f.Close()
			return nil, err
		}
	}
	return sf, nil
}

// OpenDirect opens path read-only with O_DIRECT and returns the offset and
// memory alignments its reads need: STATX_DIOALIGN where the kernel reports
// it, else 4096 for both; at least minAlign either way. It refuses a file
// whose filesystem reports no O_DIRECT support. Some filesystems take
// O_DIRECT at open and refuse it at read: ProbeDirect tells.
func OpenDirect(path string, minAlign int64) (f *os.File, align, memAl int64, err error) {
	f, err = OpenRegular(path, unix.O_DIRECT)
	if err != nil {
		return nil, 0, 0, err
	}
	fd := int(f.Fd())
	align, memAl = 4096, 4096
	var sx unix.Statx_t
	if unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &sx) == nil && sx.Mask&unix.STATX_DIOALIGN != 0 {
		if sx.Dio_offset_align == 0 {
			f.Close()
			return nil, 0, 0, errors.New("the filesystem does not support O_DIRECT on this file")
		}
		align, memAl = int64(sx.Dio_offset_align), max(int64(sx.Dio_mem_align), 1)
	}
	return f, max(align, minAlign), max(memAl, minAlign), nil
}

// OpenRegular opens path read-only (with flags added, e.g. O_DIRECT) and
// refuses anything but a regular file, without blocking on it: a FIFO
// named as a shard, the index or the state file blocked the mount in
// open(2) until a writer came, which was never. It opens with O_NONBLOCK
// (a FIFO then opens at once), checks with fstat, and clears O_NONBLOCK
// again: io_uring would answer a read of an O_NONBLOCK file that has to
// wait for the disk with EAGAIN instead of waiting.
func OpenRegular(path string, flags int) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK|flags, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %s, not a regular file", path, fileKind(st.Mode))
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "fcntl", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// fileKind names the type of a file that is not a regular one.
func fileKind(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFSOCK:
		return "a socket"
	}
	return fmt.Sprintf("a file of type %#o", mode&unix.S_IFMT)
}

// ProbeDirect reads the first align bytes of f, opened by OpenDirect, with
// O_DIRECT (a file shorter than that reads short, without an error).
func ProbeDirect(f *os.File, align, memAl int64) error {
	_, err := unix.Pread(int(f.Fd()), AlignedBuf(int(align), memAl), 0)
	return err
}

func (s *LocalSource) newShard(path string, f *os.File, direct bool, align, memAl int64) (*localShard, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("shard %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		f.Close()
		return nil, fmt.Errorf("shard %s: not a regular file", path)
	}
	return &localShard{path: path, f: f, fd: int(f.Fd()), direct: direct, align: align, memAl: memAl,
		id: statIdentity(&st), engine: s.engine, st: s.st}, nil
}

func statIdentity(st *unix.Stat_t) Identity {
	return Identity{Size: st.Size, MTime: time.Unix(st.Mtim.Unix()), CTime: time.Unix(st.Ctim.Unix()),
		Dev: st.Dev, Inode: st.Ino}
}

// localShard is one open shard file.
type localShard struct {
	path   string
	f      *os.File
	fd     int
	direct bool
	align  int64 // O_DIRECT offset and length alignment
	memAl  int64 // O_DIRECT buffer alignment
	id     Identity
	engine ioengine.Engine
	st     *stats.Counters
	bufs   slab // read buffers
	// checked is the ioengine epoch of the last identity check that passed:
	// every read of it or before was read before that check (checkAfter).
	checked atomic.Uint64

	// Close waits for the reads in flight: once the fd is closed its number
	// may name another file, and a late read would return its bytes.
	mu       sync.RWMutex
	closed   bool // GUARDED_BY(mu)
	inflight sync.WaitGroup
}

func (sf *localShard) Identity() Identity { return sf.id }

// Direct reports whether the shard is read with O_DIRECT.
func (sf *localShard) Direct() bool { return sf.direct }

// ReadAt reads through the page cache-free path too (O_DIRECT needs the
// aligned superset), for headers.
func (sf *localShard) ReadAt(p []byte, off int64) (int, error) {
	if !sf.direct {
		return sf.f.ReadAt(p, off)
	}
	start := off / sf.align * sf.align
	end := (off + int64(len(p)) + sf.align - 1) / sf.align * sf.align
	buf := AlignedBuf(int(end-start), sf.memAl)
	got, err := PreadFull(sf.fd, buf, start)
	n := copy(p, buf[min(int64(got), off-start):got])
	if err == nil && n < len(p) {
		err = io.EOF
	}
	return n, err
}

// Submit reads through the engine: one request per read, of the aligned
// superset under O_DIRECT.
func (sf *localShard) Submit(reads ...*ShardRead) {
	if sf.engine == nil {
		for _, r := range reads {
			r.Done(nil, fmt.Errorf("shard %s: opened without a read engine", sf.path))
		}
		return
	}
	sf.mu.RLock()
	if sf.closed {
		sf.mu.RUnlock()
		for _, r := range reads {
			r.Done(nil, fmt.Errorf("shard %s: %w", sf.path, ErrClosed))
		}
		return
	}
	sf.inflight.Add(len(reads))
	sf.mu.RUnlock()
	reqs := make([]*ioengine.Req, len(reads))
	var bytes uint64
	for i, r := range reads {
		start, end := r.Off, r.Off+int64(r.Len)
		if sf.direct {
			start = start / sf.align * sf.align
			end = (end + sf.align - 1) / sf.align * sf.align
		}
		buf := sf.bufs.get(int(end-start), sf.memAl)
		bytes += uint64(len(buf))
		req := &ioengine.Req{Fd: sf.fd, Off: start, Buf: buf, Demand: r.Demand}
		req.Done = func(n int, err error) {
			data, err := sf.complete(r, start, buf, n, err, req.Epoch)
			sf.inflight.Done()
			r.Done(data, err)
		}
		reqs[i] = req
	}
	sf.st.BackingReads.Add(uint64(len(reqs)))
	sf.st.BackingBytes.Add(bytes)
	sf.engine.Submit(reqs...)
}

// ReadSync runs reads with pread on the calling goroutine.
func (sf *localShard) ReadSync(reads ...*ShardRead) {
	sf.mu.RLock()
	closed := sf.closed
	if !closed {
		sf.inflight.Add(1)
	}
	sf.mu.RUnlock()
	if closed {
		for _, r := range reads {
			r.Done(nil, fmt.Errorf("shard %s: %w", sf.path, ErrClosed))
		}
		return
	}
	type answer struct {
		data []byte
		err  error
	}
	answers := make([]answer, len(reads))
	for i, r := range reads {
		start, end := r.Off, r.Off+int64(r.Len)
		if sf.direct {
			start = start / sf.align * sf.align
			end = (end + sf.align - 1) / sf.align * sf.align
		}
		buf := sf.bufs.get(int(end-start), sf.memAl)
		sf.st.BackingReads.Add(1)
		sf.st.BackingBytes.Add(uint64(len(buf)))
		n, err := PreadFull(sf.fd, buf, start)
		answers[i].data, answers[i].err = sf.complete(r, start, buf, n, err, ioengine.Observe())
	}
	sf.inflight.Done()
	for i, r := range reads {
		r.Done(answers[i].data, answers[i].err)
	}
}

// complete turns an engine completion (of ioengine epoch epoch) into the
// read's answer.
func (sf *localShard) complete(r *ShardRead, start int64, buf []byte, n int, err error, epoch uint64) ([]byte, error) {
	if errors.Is(err, ioengine.ErrClosed) {
		err = ErrClosed
	}
	if !sf.direct {
		// The rows now live in engramfs's page cache; drop the shard's copy.
		// The kernel drops only pages wholly inside the range, and table
		// data starts at any shard offset, so widen it to whole pages.
		end := start + int64(len(buf))
		if lo, hi := start/pageSize*pageSize, (end+pageSize-1)/pageSize*pageSize; hi > lo {
			_ = unix.Fadvise(sf.fd, lo, hi-lo, unix.FADV_DONTNEED)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("shard %s: offset %d: %w", sf.path, r.Off, err)
	}
	// The tail of an aligned superset may lie past the end of the file.
	if want := r.Off + int64(r.Len) - start; int64(n) < want {
		return nil, fmt.Errorf("shard %s: offset %d: %w: short read: %d of %d bytes (the shard is shorter than at mount)",
			sf.path, r.Off, ErrShardChanged, n, want)
	}
	if err := sf.checkAfter(epoch); err != nil {
		return nil, fmt.Errorf("shard %s: %w", sf.path, err)
	}
	lo := r.Off - start
	return buf[lo : lo+int64(r.Len) : lo+int64(r.Len)], nil
}

// checkAfter is check for a read of ioengine epoch epoch: one check that
// began after the read completed covers it, so the reads of a batch of
// completions share one fstat. An fstat a read costs a system call on the
// reaper's thread, in the path of every read the batch answers (on these
// VMs a system call is several µs; the serving loop made 90,000 of them
// in 38 s, as many as its NOTIFY_STOREs). A failed check is never shared.
func (sf *localShard) checkAfter(epoch uint64) error {
	if epoch != 0 && epoch <= sf.checked.Load() {
		return nil
	}
	now := ioengine.Epoch()
	if err := sf.check(); err != nil {
		return err
	}
	for {
		c := sf.checked.Load()
		if c >= now || sf.checked.CompareAndSwap(c, now) {
			return nil
		}
	}
}

// check refuses data read from a shard that was truncated or rewritten in
// place since mount: our offsets came from its old header. It runs after the
// read, so bytes that pass were read before any change.
func (sf *localShard) check() error {
	var st unix.Stat_t
	if err := unix.Fstat(sf.fd, &st); err != nil {
		return err
	}
	if now := statIdentity(&st); !now.Equal(sf.id) {
		return fmt.Errorf("%w (now %v; at mount %v)", ErrShardChanged, now, sf.id)
	}
	return nil
}

// Close fails later reads with ErrClosed and closes the file once the reads
// in flight have completed.
func (sf *localShard) Close() error {
	sf.mu.Lock()
	if sf.closed {
		sf.mu.Unlock()
		return nil
	}
	sf.closed = true
	sf.mu.Unlock()
	sf.inflight.Wait()
	return sf.f.Close()
}

// pageSize is the page of the backing page cache.
var pageSize = int64(os.Getpagesize())

// slab hands out read buffers carved from shared chunks: one allocation per
// chunk, not per read, and no alignment padding per read (an O_DIRECT page
// took an 8 KiB allocation for its 4 KiB). Reads were the daemon's largest
// source of garbage: under a prefill hint, allocation and the GC it drove
// were a quarter of the daemon's CPU. A chunk is freed by the GC once no
// buffer carved from it is referenced (they are all short-lived: copied
// into the page cache or a FUSE reply). Safe for concurrent use.
type slab struct {
	mu  sync.Mutex
	cur []byte // GUARDED_BY(mu): the rest of the current chunk, aligned
}

// slabChunk is the size of one chunk; larger reads get their own buffer.
const slabChunk = 256 << 10

// get returns n bytes (capacity n) whose address is a multiple of memAl.
func (s *slab) get(n int, memAl int64) []byte {
	al := int(max(memAl, 1))
	if n > slabChunk/4 {
		return AlignedBuf(n, memAl)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.cur) < n {
		s.cur = AlignedBuf(slabChunk, memAl)
	}
	b := s.cur[:n:n]
	s.cur = s.cur[min(len(s.cur), (n+al-1)/al*al):]
	return b
}

// AlignedBuf returns n bytes whose address is a multiple of memAl (an O_DIRECT
// buffer; the object store's mirror reads use it too).
func AlignedBuf(n int, memAl int64) []byte {
	if memAl <= 1 {
		return make([]byte, n)
	}
	b := make([]byte, n+int(memAl))
	skip := int(memAl-int64(uintptr(unsafe.Pointer(&b[0])))%memAl) % int(memAl)
	return b[skip : skip+n : skip+n]
}

// PreadFull reads until buf is full, EOF, or an error; EINTR and short reads
// are retried.
func PreadFull(fd int, buf []byte, off int64) (int, error) {
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

package s3source

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/internal/stats"
)

// MirrorConfig is the local SSD mirror of fetched pages: a tier between the
// object store and RAM. Dir "" turns it off.
type MirrorConfig struct {
	Dir string
	// Size is the budget of mirrored bytes: least recently used 2 MiB
	// extents are punched out of the mirror files beyond it.
	Size int64
	// Engine reads mirrored pages: the read engine local shards use
	// (io_uring, or a pread pool), with O_DIRECT where the mirror's
	// filesystem takes it. nil: the mirror runs its own engine, of
	// mirrorQueueDepth reads in flight.
	Engine ioengine.Engine
	// FillRate, when not 0, turns on the background fill lane: the pages
	// of open shards not mirrored yet are fetched into the mirror at most
	// this many bytes a second, in GET slots nobody waits for, while the
	// budget has room (filler).
	FillRate int64
	// Log hears what the mirror discards, fails to write or finds
	// damaged (rate-limited); nil: nothing is logged.
	Log *zap.Logger
}

// MirrorExtent is the unit of the mirror's eviction: 2 MiB of a shard.
const MirrorExtent = 2 << 20

// The mirror of a shard is two files in the mirror directory, named after
// the shard (path-escaped):
//
//   - NAME.data: sparse, the object's bytes at the object's offsets;
//   - NAME.meta: a header (magic, page size, the object's size and ETag),
//     then at mirrorHeader a bitmap, one bit per page of NAME.data, then
//     at the next page boundary (crcBase) the CRC32C of every page, 4
//     bytes each, little-endian (the last page's over its short length).
//
// A bit is set only after its page is durable: pwrite, fdatasync, then
// write its checksum and bit and fdatasync NAME.meta. A bit is cleared,
// and the clearing made durable, before its page is punched out. So a
// crash anywhere leaves no bit over bytes that were not written: at worst
// a page mirrored but not marked, which is fetched again. Every read of a
// mirrored page checks its bytes against the checksum: bytes damaged on
// disk (random writes, a punched hole: 2,977 of 3,000 rows were wrong,
// silently, before the checksums) are read from the object instead, the
// page is unmarked and mirrored again (mirror_checksum_failures). The
// checksums of mirrored pages are kept in memory too: 4 bytes a page, 0.1%
// of the mirrored bytes. A mirror whose ETag or size is not the object's
// at open, or of an older format, is discarded.
const (
	mirrorPage   = 4096
	mirrorExtent = MirrorExtent
	extentPages  = mirrorExtent / mirrorPage
	mirrorHeader = 4096 // bytes of NAME.meta before the bitmap
	mirrorMagic  = "EGMIRR02"
	// mirrorMagicV1 is the format before checksums: discarded at open.
	mirrorMagicV1 = "EGMIRR01"
	// mirrorQueue bounds the pages waiting to be written: the mirror is
	// best effort, and a full queue drops (never blocks a read).
	mirrorQueue = 4096
	mirrorBatch = 512 // writes per fdatasync at most
	// mirrorQueueDepth is the depth of the mirror's own read engine, when
	// it is given none.
	mirrorQueueDepth = 64
	// mirrorMaxDamaged bounds the damaged pages waiting for the writer to
	// unmark them; past it a damaged page is still never served, only
	// fetched again on each read until the writer catches up.
	mirrorMaxDamaged = 65536
)

// crcTable is CRC32C (Castagnoli), hardware-accelerated on amd64 and arm64:
// ~0.3 µs for a 4 KiB page.
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// mirror is the mirror directory of one Source. Its writer goroutine is the
// only one to write, set bits, clear bits and punch holes.
type mirror struct {
	dir    string
	budget int64 // GUARDED_BY(mu): the budget in force (see lowerBudgetLocked)
	st     *stats.Counters
	log    *zap.Logger // rate-limited: writes and reads fail in bursts
	sys    mirrorSys   // the writer's system calls on mirror files
	lock   *os.File    // flock(LOCK_EX) on DIR/.lock: one daemon per mirror
	clock  atomic.Int64

	engine    ioengine.Engine
	ownEngine bool // the mirror made engine: close it
	// buffered says why mirror files are read through the page cache
	// (their filesystem refused O_DIRECT; tmpfs does); "": O_DIRECT.
	buffered atomic.Pointer[string]

	mu    sync.Mutex
	files map[string]*mirrorFile // GUARDED_BY(mu): by shard name
	used  int64                  // GUARDED_BY(mu): bytes of pages whose bit is set

	qmu    sync.RWMutex
	closed bool // GUARDED_BY(qmu)
	queue  chan mirrorWrite
	done   chan struct{}

	// noBits (tests): write and sync pages but never set their bits, as
	// a crash between the write and the bit would.
	noBits bool
	// noDirect (tests): open mirror files as if O_DIRECT failed.
	noDirect bool
}

// mirrorWrite is pages [off, off+len(data)) of f as of etag, or, with
// barrier set, a request to close barrier once every earlier write is
// settled.
type mirrorWrite struct {
	f       *mirrorFile
	etag    string
	off     int64
	data    []byte
	barrier chan struct{}
	// fill: from the fill lane: written only while the budget has room
	// (it never evicts), and the extent's LRU stamp is left as it was.
	fill bool
}

// mirrorFile is the mirror of one shard.
type mirrorFile struct {
	m          *mirror
	name       string
	data, meta *os.File // data: written (buffered), punched, truncated
	size       int64
	pages      int64
	ext        []*extent // by extent index

	// Pages are read from rfd: data opened again with O_DIRECT (direct),
	// else data itself; in reads of whole mirror pages (readBuf), into
	// buffers aligned to memAl.
	rfd     *os.File
	rfdNum  int // rfd's number: File.Fd costs two fcntl calls each time
	direct  bool
	memAl   int64
	crcBase int64 // offset of the checksums in NAME.meta

	mu   sync.RWMutex
	etag string   // GUARDED_BY(mu): "" once the object is known changed
	bits []uint64 // GUARDED_BY(mu): bit p%64 of bits[p/64]: page p is mirrored
	// crcs[e][i] is the checksum of page e*extentPages+i, for mirrored
	// pages; crcs[e] is nil while extent e holds none.
	crcs [][]uint32 // GUARDED_BY(mu)

	// damaged are pages whose bytes failed their checksum, found by reads
	// (which hold no lock of f's then), for the writer to unmark; until it
	// has, they count as not mirrored. ndamaged = len(damaged), read
	// without the lock on every read.
	dmu      sync.Mutex
	damaged  map[int64]struct{} // GUARDED_BY(dmu)
	ndamaged atomic.Int64
	// gen grows, under mu.Lock, when etag changes (a reset empties the
	// data file, an invalidation disowns it).
	gen atomic.Uint64
}

// extent is 2 MiB of a mirror file: the unit of eviction.
type extent struct {
	pages int64        // GUARDED_BY(m.mu): its pages whose bit is set
	stamp atomic.Int64 // the mirror's clock when last read or written
	// gen grows, under f.mu.Lock, before the extent's bits are cleared to
	// punch it: a read that started before sees it changed when it ends.
	gen atomic.Uint64
}

// Mirror is the mirror's configuration (Dir "": none).
func (s *Source) Mirror() MirrorConfig { return s.cfg.Mirror }

func openMirror(cfg MirrorConfig, st *stats.Counters) (*mirror, error) {
	if cfg.Size < mirrorExtent {
		return nil, fmt.Errorf("mirror %s: a budget of %d bytes is under one %d-byte extent", cfg.Dir, cfg.Size, mirrorExtent)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("mirror: %w", err)
	}
	log := cfg.Log
	if log == nil {
		log = zap.NewNop()
	}
	budget, err := fitBudget(cfg.Dir, cfg.Size, log)
	if err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(cfg.Dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("mirror: %w", err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("mirror %s: in use by another process (%v)", cfg.Dir, err)
	}
	m := &mirror{
		dir: cfg.Dir, budget: budget, st: st, lock: lock, engine: cfg.Engine, sys: osSys{},
		log: log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
			return zapcore.NewSamplerWithOptions(c, time.Second, 3, 0)
		})),
		files: map[string]*mirrorFile{},
		queue: make(chan mirrorWrite, mirrorQueue), done: make(chan struct{}),
	}
	if m.engine == nil {
		e, _, err := ioengine.New("auto", mirrorQueueDepth)
		if err != nil {
			lock.Close()
			return nil, fmt.Errorf("mirror: %w", err)
		}
		m.engine, m.ownEngine = e, true
	}
	st.MirrorBudgetBytes.Store(budget)
	go m.writer()
	return m, nil
}

// fitBudget returns the budget the mirror directory's filesystem can hold:
// size, or less when the filesystem's free space plus what the mirror holds
// already is less (with a warning). A budget above the filesystem never
// evicted: the writes failed with ENOSPC and the mirror stopped mirroring
// for good. 5% is left to the mirror's own metadata and the filesystem's.
func fitBudget(dir string, size int64, log *zap.Logger) (int64, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return 0, fmt.Errorf("mirror %s: statfs: %w", dir, err)
	}
	held := int64(0)
	if files, err := filepath.Glob(filepath.Join(dir, "*.data")); err == nil {
		for _, p := range files {
			var st unix.Stat_t
			if unix.Stat(p, &st) == nil {
				held += st.Blocks * 512
			}
		}
	}
	room := (int64(sfs.Bavail)*int64(sfs.Bsize) + held) / 20 * 19
	if size <= room {
		return size, nil
	}
	fit := room / mirrorExtent * mirrorExtent
	if fit < mirrorExtent {
		return 0, fmt.Errorf("mirror %s: its filesystem has room for %d bytes (%d free, %d mirrored), not one %d-byte extent",
			dir, room, int64(sfs.Bavail)*int64(sfs.Bsize), held, mirrorExtent)
	}
	log.Warn("s3 mirror: --s3-mirror-size is more than the mirror's filesystem can hold: using what it can",
		zap.String("mirror", dir), zap.Int64("budget", size), zap.Int64("filesystem_free", int64(sfs.Bavail)*int64(sfs.Bsize)),
		zap.Int64("mirrored", held), zap.Int64("budget_used", fit))
	return fit, nil
}

// mirrorSys is the system calls the writer makes on mirror files: tests
// record their order or fail them.
type mirrorSys interface {
	pwrite(f *os.File, b []byte, off int64) error
	fdatasync(f *os.File) error
}

type osSys struct{}

func (osSys) pwrite(f *os.File, b []byte, off int64) error {
	_, err := f.WriteAt(b, off)
	return err
}

func (osSys) fdatasync(f *os.File) error {
	for {
		if err := unix.Fdatasync(int(f.Fd())); err != unix.EINTR {
			return err
		}
	}
}

// Buffered says why the mirror's pages are read through the page cache
// ("": they are read with O_DIRECT, or no shard is open yet).
func (s *Source) MirrorBuffered() string {
	if s.mir == nil {
		return ""
	}
	if why := s.mir.buffered.Load(); why != nil {
		return *why
	}
	return ""
}

// close stops the writer once the queued writes are settled, and closes
// the files.
func (m *mirror) close() error {
	m.qmu.Lock()
	if m.closed {
		m.qmu.Unlock()
		return nil
	}
	m.closed = true
	close(m.queue)
	m.qmu.Unlock()
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	if m.ownEngine {
		errs = append(errs, m.engine.Close())
	}
	for _, f := range m.files {
		if f.direct {
			errs = append(errs, f.rfd.Close())
		}
		errs = append(errs, f.data.Close(), f.meta.Close())
	}
	errs = append(errs, m.lock.Close())
	return errors.Join(errs...)
}

// send queues w unless the queue is full or closed.
func (m *mirror) send(w mirrorWrite, wait bool) bool {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	if m.closed {
		return false
	}
	if wait {
		m.queue <- w
		return true
	}
	select {
	case m.queue <- w:
		return true
	default:
		return false
	}
}

// sync waits until every write queued before it is settled (and the budget
// enforced).
func (m *mirror) sync() {
	ch := make(chan struct{})
	if m.send(mirrorWrite{barrier: ch}, true) {
		<-ch
	}
}

// open returns the mirror of shard name as the object is now (size, etag):
// the existing one, or a fresh one when there is none or it mirrors other
// bytes.
func (m *mirror) open(name string, size int64, etag string) (*mirrorFile, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f, ok := m.files[name]; ok {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.size == size && f.etag == etag {
			return f, nil
		}
		// The object changed: discard the mirror. Pages queued for the old
		// ETag are dropped by the writer.
		if f.size != size {
			return nil, fmt.Errorf("mirror of %s: the object's size changed from %d to %d under the mount", name, f.size, size)
		}
		return f, m.resetLocked(f, etag)
	}
	base := filepath.Join(m.dir, url.PathEscape(name))
	data, err := os.OpenFile(base+".data", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("mirror: %w", err)
	}
	// Mirror reads are a page or a row: no readahead around them (it read
	// 128 KiB for each 4 KiB hit, and cached it a second time).
	if err := unix.Fadvise(int(data.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		data.Close()
		return nil, fmt.Errorf("mirror: fadvise %s: %w", data.Name(), err)
	}
	meta, err := os.OpenFile(base+".meta", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		data.Close()
		return nil, fmt.Errorf("mirror: %w", err)
	}
	pages := (size + mirrorPage - 1) / mirrorPage
	words := (pages + 63) / 64
	f := &mirrorFile{
		m: m, name: name, data: data, meta: meta, size: size, pages: pages,
		ext:     make([]*extent, (size+mirrorExtent-1)/mirrorExtent),
		bits:    make([]uint64, words),
		crcs:    make([][]uint32, (size+mirrorExtent-1)/mirrorExtent),
		crcBase: mirrorHeader + (8*words+mirrorPage-1)/mirrorPage*mirrorPage,
		rfd:     data, rfdNum: int(data.Fd()), memAl: 1,
	}
	for i := range f.ext {
		f.ext[i] = &extent{}
	}
	if why := f.load(etag); why == "" {
		f.etag = etag
		for p := int64(0); p < pages; p++ {
			if f.bits[p/64]&(1<<(p%64)) != 0 {
				f.ext[p/extentPages].pages++
				m.used += mirrorPage
			}
		}
	} else {
		if why != "new" {
			m.log.Info("s3 mirror: discarding a shard's mirror", zap.String("shard", name), zap.String("reason", why))
		}
		if err := m.resetLocked(f, etag); err != nil {
			data.Close()
			meta.Close()
			return nil, err
		}
	}
	if rfd, memAl, err := m.openDirect(base + ".data"); err == nil {
		f.rfd, f.rfdNum, f.direct, f.memAl = rfd, int(rfd.Fd()), true, memAl
	} else {
		why := err.Error()
		m.buffered.CompareAndSwap(nil, &why)
	}
	m.files[name] = f
	if m.used > m.budget {
		m.send(mirrorWrite{}, false) // the writer evicts
	}
	return f, nil
}

// load reads NAME.meta, with f.bits and f.crcs filled: "" when it mirrors
// this object (same format, page size, size and ETag), else why not
// ("new": there was none).
func (f *mirrorFile) load(etag string) string {
	hdr := make([]byte, mirrorHeader)
	if n, err := f.meta.ReadAt(hdr, 0); n == 0 {
		return "new"
	} else if err != nil {
		return fmt.Sprintf("its header is short or unreadable: %v", err)
	}
	n := int(binary.LittleEndian.Uint32(hdr[12:]))
	switch {
	case bytes.Equal(hdr[:8], []byte(mirrorMagicV1)):
		return "written before mirrored pages had checksums (format " + mirrorMagicV1 + "): its bytes cannot be checked"
	case !bytes.Equal(hdr[:8], []byte(mirrorMagic)) || binary.LittleEndian.Uint32(hdr[8:]) != mirrorPage:
		return "not a mirror of this format"
	case int64(binary.LittleEndian.Uint64(hdr[16:])) != f.size || n > mirrorHeader-24 || string(hdr[24:24+n]) != etag:
		return "the object changed since it was mirrored (size or ETag)"
	}
	raw := make([]byte, 8*len(f.bits))
	if _, err := f.meta.ReadAt(raw, mirrorHeader); err != nil {
		return fmt.Sprintf("its bitmap is unreadable: %v", err)
	}
	for i := range f.bits {
		f.bits[i] = binary.LittleEndian.Uint64(raw[8*i:])
	}
	if k := f.pages % 64; k != 0 && len(f.bits) > 0 {
		f.bits[len(f.bits)-1] &= 1<<k - 1
	}
	// The checksums of the extents that hold pages.
	for e := range f.crcs {
		first, last := int64(e)*extentPages, min(int64(e+1)*extentPages, f.pages)
		if !f.anyBitLocked(first, last) {
			continue
		}
		raw := make([]byte, 4*(last-first))
		// Short at the end of the file: checksums a crash kept from the
		// disk while their bits got there read as 0, and their pages fail
		// the check and are fetched again.
		if _, err := f.meta.ReadAt(raw, f.crcBase+4*first); err != nil && !errors.Is(err, io.EOF) {
			return fmt.Sprintf("its checksums are unreadable: %v", err)
		}
		f.crcs[e] = make([]uint32, extentPages)
		for i := range last - first {
			f.crcs[e][i] = binary.LittleEndian.Uint32(raw[4*i:])
		}
	}
	return ""
}

// anyBitLocked reports whether any page of [first, last) is mirrored.
func (f *mirrorFile) anyBitLocked(first, last int64) bool {
	for p := first; p < last; p++ {
		if f.bits[p/64]&(1<<(p%64)) != 0 {
			return true
		}
	}
	return false
}

// resetLocked discards f's mirror and makes it the (empty) mirror of the
// object as of etag: the new header and an empty bitmap are durable before
// the data file is emptied. Callers hold m.mu and f.mu.
func (m *mirror) resetLocked(f *mirrorFile, etag string) error {
	if len(etag) > mirrorHeader-24 {
		return fmt.Errorf("mirror of %s: ETag of %d bytes", f.name, len(etag))
	}
	for _, e := range f.ext {
		m.used -= e.pages * mirrorPage
		e.pages = 0
	}
	clear(f.bits)
	clear(f.crcs)
	f.etag = etag
	f.gen.Add(1)
	hdr := make([]byte, mirrorHeader+8*len(f.bits))
	copy(hdr, mirrorMagic)
	binary.LittleEndian.PutUint32(hdr[8:], mirrorPage)
	binary.LittleEndian.PutUint32(hdr[12:], uint32(len(etag)))
	binary.LittleEndian.PutUint64(hdr[16:], uint64(f.size))
	copy(hdr[24:], etag)
	if err := f.meta.Truncate(0); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	if err := m.sys.pwrite(f.meta, hdr, 0); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	if err := m.sys.fdatasync(f.meta); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	if err := f.data.Truncate(0); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	if err := f.data.Truncate(f.size); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	return nil
}

// coveredLocked reports whether every page of [off, off+n) is mirrored
// (and not found damaged since).
func (f *mirrorFile) coveredLocked(off int64, n int) bool {
	first, last := off/mirrorPage, (off+int64(n)-1)/mirrorPage
	for p := first; p <= last; p++ {
		if f.bits[p/64]&(1<<(p%64)) == 0 {
			return false
		}
	}
	if f.ndamaged.Load() > 0 {
		f.dmu.Lock()
		defer f.dmu.Unlock()
		for p := first; p <= last; p++ {
			if _, bad := f.damaged[p]; bad {
				return false
			}
		}
	}
	return true
}

// crcsLocked returns the checksums of the pages of [off, off+n), which are
// mirrored.
func (f *mirrorFile) crcsLocked(off int64, n int) []uint32 {
	first, last := off/mirrorPage, (off+int64(n)-1)/mirrorPage
	out := make([]uint32, 0, last-first+1)
	for p := first; p <= last; p++ {
		out = append(out, f.crcs[p/extentPages][p%extentPages])
	}
	return out
}

// pageCRC is the checksum of page bytes b.
func pageCRC(b []byte) uint32 { return crc32.Checksum(b, crcTable) }

// read returns [off, off+n) of the object as of etag from the mirror, or
// false when any of it is not mirrored (any more). It waits for the read.
func (f *mirrorFile) read(etag string, off int64, n int) ([]byte, bool) {
	f.mu.RLock()
	if f.etag != etag || !f.coveredLocked(off, n) {
		f.mu.RUnlock()
		return nil, false
	}
	start, buf := f.readBuf(off, n)
	crcs := f.crcsLocked(off, n)
	got, err := backing.PreadFull(f.rfdNum, buf, start)
	f.mu.RUnlock()
	return f.answer(off, n, start, buf, got, err, crcs)
}

// readBuf returns the offset and an aligned buffer for a read of the whole
// mirror pages of [off, off+n): a page's checksum needs all of its bytes.
// (Reads aligned to the O_DIRECT offset alignment alone, 512 on ext4,
// read 4.5 KiB for a table's page at an unaligned shard offset, not 8 KiB;
// whole pages cost BenchmarkMirrorStep 4.2-5.1 ms a 128-read step against
// 3.4-3.9 ms, 1.11-1.18× a local shard's step, on a busy machine.) Mirror
// pages are multiples of that alignment, so the read stays O_DIRECT.
func (f *mirrorFile) readBuf(off int64, n int) (int64, []byte) {
	start := off / mirrorPage * mirrorPage
	end := (off + int64(n) + mirrorPage - 1) / mirrorPage * mirrorPage
	return start, backing.AlignedBuf(int(end-start), f.memAl)
}

// answer turns got bytes read into buf at start (whole pages) into [off,
// off+n), or false: when the read failed, or a page's bytes do not match
// its checksum in crcs (the page is then marked damaged, for the writer to
// unmark). The last page may be short: the file ends with the object.
func (f *mirrorFile) answer(off int64, n int, start int64, buf []byte, got int, err error, crcs []uint32) ([]byte, bool) {
	if err != nil || int64(got) < min(start+int64(len(buf)), f.size)-start {
		return nil, false
	}
	bad := false
	for i, want := range crcs {
		lo := int64(i) * mirrorPage
		if pageCRC(buf[lo:min(lo+mirrorPage, f.size-start)]) != want {
			f.markDamaged(start/mirrorPage + int64(i))
			bad = true
		}
	}
	if bad {
		return nil, false
	}
	f.touch(off, int64(n))
	f.m.st.MirrorHits.Add(1)
	f.m.st.MirrorBytesRead.Add(uint64(n))
	lo := off - start
	return buf[lo : lo+int64(n) : lo+int64(n)], true
}

// submit reads the reads wholly inside mirrored pages of the object as of
// etag through the mirror's engine, each answered by hit(r, data) (or
// miss(r) should its read fail), and returns the others. done runs once
// every read submitted has completed (at once when none was).
//
// No lock is held during the reads (a read's completion may submit reads
// of its own: a lock held until then could wait on itself). Instead a read
// notes the generations of its file and extents when it checks the bits,
// and its bytes count only if they are the same once it completed: an
// eviction bumps its extent's generation before it clears the bits and
// punches the bytes, a reset or invalidation the file's, so a read that
// may have seen a punched page's zeros, or a reset file, is a miss.
func (f *mirrorFile) submit(etag string, reads []*backing.ShardRead, hit func(r *backing.ShardRead, data []byte), miss func(r *backing.ShardRead), done func()) (rest []*backing.ShardRead) {
	var reqs []*ioengine.Req
	var pending atomic.Int64
	f.mu.RLock()
	ok := f.etag == etag
	gen := f.gen.Load()
	for _, r := range reads {
		if !ok || !f.coveredLocked(r.Off, r.Len) {
			rest = append(rest, r)
			continue
		}
		start, buf := f.readBuf(r.Off, r.Len)
		crcs := f.crcsLocked(r.Off, r.Len)
		extGen := f.extentGens(r.Off, r.Len)
		reqs = append(reqs, &ioengine.Req{Fd: f.rfdNum, Off: start, Buf: buf, Done: func(got int, err error) {
			if f.gen.Load() != gen || f.extentGens(r.Off, r.Len) != extGen {
				miss(r)
			} else if data, ok := f.answer(r.Off, r.Len, start, buf, got, err, crcs); ok {
				hit(r, data)
			} else {
				miss(r)
			}
			if pending.Add(-1) == 0 {
				done()
			}
		}})
	}
	f.mu.RUnlock()
	if len(reqs) == 0 {
		done()
		return rest
	}
	pending.Store(int64(len(reqs)))
	f.m.engine.Submit(reqs...)
	return rest
}

// extentGens sums the generations of the extents of [off, off+n): each only
// grows, so the sum changes when any does.
func (f *mirrorFile) extentGens(off int64, n int) uint64 {
	var sum uint64
	for e := off / mirrorExtent; e <= (off+int64(n)-1)/mirrorExtent; e++ {
		sum += f.ext[e].gen.Load()
	}
	return sum
}

// openDirect opens path for reads with O_DIRECT, if its filesystem takes
// them at mirror page offsets, and returns the memory alignment its
// buffers need (backing.OpenDirect).
func (m *mirror) openDirect(path string) (*os.File, int64, error) {
	if m.noDirect {
		return nil, 0, errors.New("O_DIRECT off (test)")
	}
	f, align, memAl, err := backing.OpenDirect(path, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("open %s with O_DIRECT: %w", path, err)
	}
	if mirrorPage%align != 0 {
		f.Close()
		return nil, 0, fmt.Errorf("%s: O_DIRECT needs offsets aligned to %d bytes", path, align)
	}
	// The file has its size already: a hole reads as zeros.
	if err := backing.ProbeDirect(f, align, memAl); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("read %s with O_DIRECT: %w", path, err)
	}
	return f, memAl, nil
}

// markDamaged records that page p's bytes failed their checksum: it is not
// served from now on, and the writer unmarks it (so the GET that answers
// the read mirrors it again). It takes no lock a writer holds across I/O:
// it runs in read completions.
func (f *mirrorFile) markDamaged(p int64) {
	f.m.st.MirrorChecksumFailures.Add(1)
	f.m.log.Warn("s3 mirror: a mirrored page does not match its checksum: read from the object instead, and mirrored again",
		zap.String("shard", f.name), zap.Int64("offset", p*mirrorPage), zap.String("mirror_file", f.data.Name()))
	f.dmu.Lock()
	if f.damaged == nil {
		f.damaged = map[int64]struct{}{}
	}
	if len(f.damaged) < mirrorMaxDamaged {
		f.damaged[p] = struct{}{}
		f.ndamaged.Store(int64(len(f.damaged)))
	}
	f.dmu.Unlock()
	f.m.send(mirrorWrite{}, false) // the writer unmarks it
}

func (f *mirrorFile) touch(off, n int64) {
	now := f.m.clock.Add(1)
	for e := off / mirrorExtent; e <= (off+n-1)/mirrorExtent; e++ {
		f.ext[e].stamp.Store(now)
	}
}

// put queues the whole pages of buf (bytes [off, off+len(buf)) of the
// object as of etag) that are not mirrored yet. It copies them: buf
// belongs to the readers.
func (f *mirrorFile) put(etag string, off int64, buf []byte) {
	lo := (off + mirrorPage - 1) / mirrorPage * mirrorPage
	end := off + int64(len(buf))
	hi := end / mirrorPage * mirrorPage
	if end == f.size {
		hi = end // the last page, short
	}
	if hi <= lo {
		return
	}
	f.mu.RLock()
	skip := f.etag != etag || f.coveredLocked(lo, int(hi-lo))
	f.mu.RUnlock()
	if skip {
		return
	}
	data := make([]byte, hi-lo)
	copy(data, buf[lo-off:hi-off])
	f.m.send(mirrorWrite{f: f, etag: etag, off: lo, data: data}, false)
}

// putFill queues pages fetched by the fill lane, waiting for room in the
// queue (the lane has nothing better to do).
func (f *mirrorFile) putFill(etag string, off int64, buf []byte) {
	f.m.send(mirrorWrite{f: f, etag: etag, off: off, data: buf, fill: true}, true)
}

// full reports whether n more mirrored bytes would not fit the budget.
func (m *mirror) full(n int64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.used+n > m.budget
}

// unmirrored returns the first page at or after page from that is not
// mirrored, if the mirror is of the object as of etag.
func (f *mirrorFile) unmirrored(etag string, from int64) (int64, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.etag != etag {
		return 0, false
	}
	for p := from; p < f.pages; p++ {
		if w := f.bits[p/64]; w == ^uint64(0) && p%64 == 0 {
			p += 63 // a whole word mirrored
		} else if w&(1<<(p%64)) == 0 {
			return p, true
		}
	}
	return 0, false
}

// invalidate stops serving the mirror of the object as of etag: it
// changed. The next open with the new ETag discards the mirror.
func (f *mirrorFile) invalidate(etag string) {
	f.mu.Lock()
	if f.etag == etag {
		f.etag = ""
		f.gen.Add(1)
	}
	f.mu.Unlock()
}

// writer writes batches of queued pages: pwrite each, fdatasync each file,
// then set and persist the bits, then enforce the budget.
func (m *mirror) writer() {
	defer close(m.done)
	batch := make([]mirrorWrite, 0, mirrorBatch)
	for w := range m.queue {
		batch = append(batch[:0], w)
	fill:
		for len(batch) < mirrorBatch {
			select {
			case w, ok := <-m.queue:
				if !ok {
					break fill
				}
				batch = append(batch, w)
			default:
				break fill
			}
		}
		m.flush(batch)
		for _, w := range batch {
			if w.barrier != nil {
				close(w.barrier)
			}
		}
		clear(batch)
	}
}

func (m *mirror) flush(batch []mirrorWrite) {
	// 0. Unmark the pages reads found damaged; their bits reach the disk
	// with the rest of step 3.
	m.mu.Lock()
	dirty := map[*mirrorFile][]pageRun{} // bitmap and checksums to persist
	for _, f := range m.files {
		if f.ndamaged.Load() > 0 {
			dirty[f] = append(dirty[f], m.unmarkDamaged(f)...)
		}
	}
	m.mu.Unlock()

	// 1. Write the pages (under f.mu: a reset never runs meanwhile), with
	// their checksums. A fill write that would not fit the budget is
	// dropped.
	written := batch[:0:0]
	var sums [][]uint32 // by written
	synced := map[*mirrorFile]bool{}
	var filling int64
	for _, w := range batch {
		if w.f == nil {
			continue
		}
		if w.fill {
			n := int64(len(w.data))
			if m.full(filling + n) {
				continue
			}
			filling += n
		}
		f := w.f
		ok, err := m.write(w)
		if errors.Is(err, unix.ENOSPC) {
			// Make room and try once more: the write had nowhere to go,
			// and dropped, it would be fetched again at the next read.
			m.writeFailed(f, "write", w.off, err, int64(len(w.data)))
			ok, err = m.write(w)
		}
		if err != nil {
			m.writeFailed(f, "write", w.off, err, 0)
			continue
		}
		if ok {
			written = append(written, w)
			sums = append(sums, pageCRCs(w.data))
			synced[f] = false
		}
	}
	// 2. Make them durable; then drop them from the page cache, which
	// O_DIRECT reads pass by (kept, every mirrored page would be in RAM
	// twice: here and in the mount's page cache). Only then may a bit
	// say they are there (TestMirrorBitsFollowDurableData).
	for f := range synced {
		err := m.sys.fdatasync(f.data)
		if err != nil {
			m.writeFailed(f, "fdatasync", 0, err, 0)
		}
		synced[f] = err == nil
	}
	for _, w := range written {
		if w.f.direct && synced[w.f] {
			_ = unix.Fadvise(int(w.f.data.Fd()), w.off, int64(len(w.data)), unix.FADV_DONTNEED)
		}
	}
	// 3. Set their checksums and bits, and persist them.
	m.mu.Lock()
	if !m.noBits {
		for i, w := range written {
			f := w.f
			if !synced[f] {
				continue
			}
			f.mu.Lock()
			first, last := w.off/mirrorPage, (w.off+int64(len(w.data))-1)/mirrorPage
			if w.fill {
				var add int64
				for p := first; p <= last; p++ {
					if f.bits[p/64]&(1<<(p%64)) == 0 {
						add += mirrorPage
					}
				}
				if m.used+add > m.budget {
					f.mu.Unlock()
					continue // the fill lane never makes the mirror evict
				}
			}
			if f.etag == w.etag {
				for p := first; p <= last; p++ {
					e := p / extentPages
					if f.crcs[e] == nil {
						f.crcs[e] = make([]uint32, extentPages)
					}
					f.crcs[e][p%extentPages] = sums[i][p-first]
					if f.bits[p/64]&(1<<(p%64)) == 0 {
						f.bits[p/64] |= 1 << (p % 64)
						f.ext[e].pages++
						m.used += mirrorPage
					}
				}
				dirty[f] = append(dirty[f], pageRun{first, last + 1})
				m.st.MirrorBytesWritten.Add(uint64(len(w.data)))
			}
			f.mu.Unlock()
			if !w.fill {
				f.touch(w.off, int64(len(w.data)))
			}
		}
	}
	m.mu.Unlock()
	for f, runs := range dirty {
		f.mu.RLock()
		err := f.persistLocked(runs)
		f.mu.RUnlock()
		if err == nil {
			err = m.sys.fdatasync(f.meta)
		}
		if err != nil {
			m.writeFailed(f, "write of the bitmap", 0, err, 0)
		}
	}
	// 4. The budget.
	m.mu.Lock()
	m.evictLocked(0)
	m.mu.Unlock()
}

// write writes w's pages to its data file, unless the object changed (ok
// false): under f.mu, so a reset never runs meanwhile.
func (m *mirror) write(w mirrorWrite) (ok bool, err error) {
	w.f.mu.RLock()
	defer w.f.mu.RUnlock()
	if w.f.etag != w.etag {
		return false, nil
	}
	return true, m.sys.pwrite(w.f.data, w.data, w.off)
}

// pageRun is pages [first, end) of a mirror file.
type pageRun struct{ first, end int64 }

// pageCRCs returns the checksum of each page of b (the last may be short).
func pageCRCs(b []byte) []uint32 {
	out := make([]uint32, 0, (len(b)+mirrorPage-1)/mirrorPage)
	for lo := 0; lo < len(b); lo += mirrorPage {
		out = append(out, pageCRC(b[lo:min(lo+mirrorPage, len(b))]))
	}
	return out
}

// unmarkDamaged clears the bits of the pages of f that reads found damaged,
// and forgets them, returning the runs to persist. A damaged page's extent
// is not punched: the GET that answered its read mirrors it again. Callers
// hold m.mu; only the writer calls it.
func (m *mirror) unmarkDamaged(f *mirrorFile) []pageRun {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dmu.Lock()
	damaged := f.damaged
	f.damaged = nil
	f.ndamaged.Store(0)
	f.dmu.Unlock()
	var runs []pageRun
	for p := range damaged {
		if f.bits[p/64]&(1<<(p%64)) != 0 {
			f.bits[p/64] &^= 1 << (p % 64)
			f.ext[p/extentPages].pages--
			m.used -= mirrorPage
			runs = append(runs, pageRun{p, p + 1})
		}
	}
	return runs
}

// writeFailed counts and logs a failed write or sync of f's files. On
// ENOSPC it lowers the budget to what the filesystem can hold now (its
// free space and what the mirror holds, as at open) and evicts until room
// more bytes fit: a mirror whose budget was above what its filesystem
// could hold never evicted, its writes failed silently, and it stopped
// mirroring for good. Callers hold no lock of m's.
func (m *mirror) writeFailed(f *mirrorFile, op string, off int64, err error, room int64) {
	m.st.MirrorWriteErrors.Add(1)
	fields := []zap.Field{zap.String("shard", f.name), zap.String("op", op), zap.Int64("offset", off), zap.Error(err)}
	if !errors.Is(err, unix.ENOSPC) {
		m.log.Warn("s3 mirror: a write failed: those pages are not mirrored", fields...)
		return
	}
	var sfs unix.Statfs_t
	m.mu.Lock()
	if unix.Statfs(m.dir, &sfs) == nil {
		fit := (int64(sfs.Bavail)*int64(sfs.Bsize) + m.used) / 20 * 19 / mirrorPage * mirrorPage
		if fit < m.budget {
			m.budget = fit
			m.st.MirrorBudgetBytes.Store(fit)
		}
	}
	budget := m.budget
	m.evictLocked(max(room, 1))
	m.mu.Unlock()
	m.log.Warn("s3 mirror: no space left on the mirror's filesystem: budget lowered to what it holds, extents evicted to make room",
		append(fields, zap.Int64("budget", budget))...)
}

// persistLocked writes the checksums, then the bitmap words, of runs to
// NAME.meta.
func (f *mirrorFile) persistLocked(runs []pageRun) error {
	slices.SortFunc(runs, func(a, b pageRun) int { return cmp.Compare(a.first, b.first) })
	merged := runs[:0:0]
	for _, r := range runs {
		if k := len(merged) - 1; k >= 0 && r.first <= merged[k].end {
			merged[k].end = max(merged[k].end, r.end)
			continue
		}
		merged = append(merged, r)
	}
	for _, r := range merged {
		raw := make([]byte, 4*(r.end-r.first))
		for p := r.first; p < r.end; p++ {
			if c := f.crcs[p/extentPages]; c != nil {
				binary.LittleEndian.PutUint32(raw[4*(p-r.first):], c[p%extentPages])
			}
		}
		if err := f.m.sys.pwrite(f.meta, raw, f.crcBase+4*r.first); err != nil {
			return err
		}
	}
	lo, hi := int64(math.MaxInt64), int64(0)
	for _, r := range merged {
		lo, hi = min(lo, r.first/64), max(hi, (r.end-1)/64+1)
	}
	return f.persistBitsLocked(lo, hi)
}

// persistBitsLocked writes bitmap words [lo, hi) to NAME.meta.
func (f *mirrorFile) persistBitsLocked(lo, hi int64) error {
	if hi <= lo {
		return nil
	}
	raw := make([]byte, 8*(hi-lo))
	for i := lo; i < hi; i++ {
		binary.LittleEndian.PutUint64(raw[8*(i-lo):], f.bits[i])
	}
	return f.m.sys.pwrite(f.meta, raw, mirrorHeader+8*lo)
}

// evictLocked punches out least recently used extents until the mirrored
// bytes and room more fit the budget. Each extent's bits are cleared,
// durably, before its bytes are punched. Callers hold m.mu; only the writer
// calls it.
func (m *mirror) evictLocked(room int64) {
	for m.used+room > m.budget {
		var vf *mirrorFile
		var vi int
		var vs int64 = math.MaxInt64
		for _, f := range m.files {
			for i, e := range f.ext {
				if e.pages > 0 && e.stamp.Load() < vs {
					vf, vi, vs = f, i, e.stamp.Load()
				}
			}
		}
		if vf == nil {
			return
		}
		start := int64(vi) * mirrorExtent
		end := min(start+mirrorExtent, vf.size)
		vf.mu.Lock()
		vf.ext[vi].gen.Add(1)
		first, last := start/mirrorPage, (end-1)/mirrorPage
		for p := first; p <= last; p++ {
			vf.bits[p/64] &^= 1 << (p % 64)
		}
		vf.crcs[vi] = nil
		err := vf.persistBitsLocked(first/64, last/64+1)
		if err == nil {
			err = m.sys.fdatasync(vf.meta)
		}
		vf.mu.Unlock()
		m.used -= vf.ext[vi].pages * mirrorPage
		vf.ext[vi].pages = 0
		m.st.MirrorEvictions.Add(1)
		if err != nil {
			continue // the bits may still be on disk: keep the bytes
		}
		_ = unix.Fallocate(int(vf.data.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, start, end-start)
	}
}

package fs

import (
	"context"
	"errors"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/stats"
)

// FaultSink hears of the data pages that FUSE reads brought in
// (prefetch.Prefetcher: the one place that decides what a fault means for
// late prefetches, hint accuracy and the hot tier). It must not block: it
// is called from the Read handler, after the pages are loaded.
type FaultSink interface {
	Faulted(keys []cache.PageKey)
}

// tableFile is layers/<L>/<table>.safetensors: the table's own
// single-tensor safetensors header, padded to a page, then its rows.
type tableFile struct {
	roFile
	t      *backing.Table
	loader *cache.Loader
	into   backing.IntoReader // the readahead's reads; nil: through loader
	st     *stats.Counters
	faults FaultSink   // may be nil
	seen   *cache.Seen // may be nil: the pages this daemon put in the page cache
	log    *zap.Logger // sampled: Read is a hot path
}

// writeCache stores data at off into the file's page cache (NOTIFY_STORE),
// recording the pages as seen first.
func (f *tableFile) writeCache(off int64, data []byte) syscall.Errno {
	f.seen.Mark(f.t.ID, uint64(off)/cache.PageSize, (uint64(len(data))+cache.PageSize-1)/cache.PageSize)
	return f.EmbeddedInode().WriteCache(off, data)
}

var (
	_ = (gofs.NodeOpener)((*tableFile)(nil))
	_ = (gofs.NodeReader)((*tableFile)(nil))
)

// Open keeps the page cache across opens (KEEP_CACHE) and skips FLUSH on
// close (NOFLUSH). Never DIRECT_IO: a shared mmap of a direct-io file fails.
// A reader's handle follows its reads for sequential readahead; the
// daemon's own opens (live files, the pinner) get none.
func (f *tableFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&writeFlags != 0 {
		return nil, 0, syscall.EROFS
	}
	var h gofs.FileHandle
	if !ownOpen(ctx) {
		h = &tableHandle{readAhead{size: f.t.FileSize, trigger: 2*f.t.RowBytes + cache.PageSize,
			fill: f.fill, read: f.readInto, store: f.writeCache}}
	}
	return h, fuse.FOPEN_KEEP_CACHE | noFlush, 0
}

// tableHandle is a reader's open table file.
type tableHandle struct{ ra readAhead }

var _ = (gofs.FileReleaser)((*tableHandle)(nil))

// Release waits for the handle's readahead.
func (h *tableHandle) Release(ctx context.Context) syscall.Errno {
	h.ra.close()
	return 0
}

// Read serves a page fault or read(2) on a table file. With MaxReadAhead 1
// the kernel asks for exactly the faulting page, so a cold fault costs one
// page of backing I/O; a handle that reads sequentially has the pages
// ahead of it pushed (seqread.go), which only changes how many reads reach
// here. This is the untimed node; timedTableFile (timing.go) wraps it when
// metrics are on.
func (f *tableFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	t := f.t
	if off < 0 || off >= t.FileSize || len(dest) == 0 {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), t.FileSize)
	f.st.FuseReads.Add(1)
	f.st.FuseReadBytes.Add(uint64(end - off))
	if h, ok := fh.(*tableHandle); ok {
		h.ra.observe(off, end)
	}

	hdrLen := int64(len(t.FileHeader))
	if end <= hdrLen {
		return fuse.ReadResultData(t.FileHeader[off:end]), 0
	}
	first := uint64(max(off, hdrLen)) / cache.PageSize
	last := uint64(end-1) / cache.PageSize
	pages, err := f.loader.Load(t.ID, first, last-first+1, cache.OriginFault)
	if err != nil {
		f.log.Error("read failed", zap.String("table", t.Name), zap.Int64("offset", off), zap.Int("bytes", len(dest)), zap.Error(err))
		return nil, syscall.EIO
	}
	// Seen once read (the loader counts a read of a page seen before as a
	// read again) and before the reply puts it in the page cache.
	f.seen.Mark(t.ID, first, last-first+1)
	if f.faults != nil {
		keys := make([]cache.PageKey, len(pages))
		for i := range keys {
			keys[i] = cache.PageKey{Table: t.ID, Page: first + uint64(i)}
		}
		f.faults.Faulted(keys)
	}
	if off >= hdrLen && len(pages) == 1 {
		// The common case, one faulting page: hand the loader's buffer to
		// go-fuse, no copy.
		base := int64(first) * cache.PageSize
		return fuse.ReadResultData(pages[0][off-base : end-base]), 0
	}
	return fuse.ReadResultData(dest[:f.copyOut(dest[:end-off], off, first, pages)]), 0
}

// copyOut copies the file's bytes at off into out from the header and the
// data pages that start at page first.
func (f *tableFile) copyOut(out []byte, off int64, first uint64, pages [][]byte) int {
	t, end := f.t, off+int64(len(out))
	n := 0
	if off < int64(len(t.FileHeader)) {
		n = copy(out, t.FileHeader[off:])
	}
	base := int64(first) * cache.PageSize
	for i, p := range pages {
		pageOff := base + int64(i)*cache.PageSize
		lo := max(off, pageOff) - pageOff
		hi := min(end, pageOff+int64(len(p))) - pageOff
		if lo < hi {
			n += copy(out[n:], p[lo:hi])
		}
	}
	return n
}

// fill reads b at off for the readahead: through the loader, as prefetch
// work (shared with any fault on the same pages, counted as prefetch).
func (f *tableFile) fill(b []byte, off int64) (int, error) {
	t := f.t
	end := min(off+int64(len(b)), t.FileSize)
	if off >= end {
		return 0, nil
	}
	first := max(uint64(off), uint64(len(t.FileHeader))) / cache.PageSize
	last := uint64(end-1) / cache.PageSize
	var pages [][]byte
	if first <= last && end > int64(len(t.FileHeader)) {
		var err error
		if pages, err = f.loader.Load(t.ID, first, last-first+1, cache.OriginPrefetch); err != nil {
			return 0, err
		}
	}
	return f.copyOut(b[:end-off], off, first, pages), nil
}

// readInto reads [off, off+n) of the file into buf for the readahead:
// the data straight from its shard (backing.IntoReader), not through the
// loader, whose per-page flights, buffers and copy cost more CPU than the
// read. A window over the header, or a source that cannot, is fill's.
func (f *tableFile) readInto(buf []byte, off, n int64) ([]byte, error) {
	t := f.t
	hdrLen := int64(len(t.FileHeader))
	if f.into == nil || off < hdrLen {
		return nil, errors.ErrUnsupported
	}
	n = min(n, t.FileSize-off)
	if n <= 0 {
		return nil, nil
	}
	if again := f.seen.Count(t.ID, uint64(off)/cache.PageSize, uint64(n+cache.PageSize-1)/cache.PageSize); again > 0 {
		f.st.BackingAgain.Add(again)
	}
	return f.into.ReadInto(t, off-hdrLen, int(n), buf)
}

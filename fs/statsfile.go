package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/internal/stats"
)

// statsFile is .engramfs/stats: one JSON object of counters, taken when the
// file is opened, so one read loop sees one consistent document.
type statsFile struct {
	roFile
	st *stats.Counters
}

type statsHandle struct{ data []byte }

var (
	_ = (gofs.NodeOpener)((*statsFile)(nil))
	_ = (gofs.NodeReader)((*statsFile)(nil))
)

// Open uses DIRECT_IO: the size in GETATTR is 0 and the content changes, so
// nothing may be cached and reads run until EOF.
func (f *statsFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&writeFlags != 0 {
		return nil, 0, syscall.EROFS
	}
	return &statsHandle{data: f.st.JSON()}, fuse.FOPEN_DIRECT_IO | noFlush, 0
}

func (f *statsFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	h, ok := fh.(*statsHandle)
	if !ok {
		return nil, syscall.EBADF
	}
	return fuse.ReadResultData(window(h.data, off, len(dest))), 0
}

package fs

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

// Hinter receives decoded hint frames (prefetch.Prefetcher).
type Hinter interface {
	Submit(class hints.Class, layer int, rows []uint64, b *prefetch.Barrier)
}

// controlFile is .engramfs/control: hint frames are written to it, and fsync
// on a handle is a barrier for that handle's frames.
type controlFile struct {
	roFile
	r *root
}

// controlHandle is one open of the control file: its own frame stream and
// its own barrier.
type controlHandle struct {
	mu  sync.Mutex // serialises writes: the stream is ordered per handle
	dec *hints.Decoder
	b   *prefetch.Barrier
	// layer names what the frames since the last fsync asked for, for the
	// barrier-wait histogram's label: one layer, stats.BarrierSeveralLayers
	// or stats.BarrierNoLayer. GUARDED_BY(mu)
	layer int
}

var (
	_ = (gofs.NodeOpener)((*controlFile)(nil))
	_ = (gofs.NodeWriter)((*controlFile)(nil))
	_ = (gofs.NodeReader)((*controlFile)(nil))
	_ = (gofs.NodeFsyncer)((*controlFile)(nil))
	_ = (gofs.NodeSetattrer)((*controlFile)(nil))
)

// Open admits the daemon's own user only: with allow_other, other users
// could otherwise steer what the daemon reads and pins. DIRECT_IO, so every
// write reaches us as written (no page cache for a stream).
func (c *controlFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if caller, ok := fuse.FromContext(ctx); ok && caller.Uid != c.r.o.uid {
		return nil, 0, syscall.EACCES
	}
	return &controlHandle{dec: hints.NewDecoder(c.r.o.Model), b: prefetch.NewBarrier(), layer: stats.BarrierNoLayer}, fuse.FOPEN_DIRECT_IO, 0
}

// Setattr accepts the truncate of `echo ... > control` (there is nothing to
// truncate) and refuses every other change.
func (c *controlFile) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok && sz == 0 && in.Valid&^(fuse.FATTR_SIZE|fuse.FATTR_FH|fuse.FATTR_LOCKOWNER|fuse.FATTR_MTIME|fuse.FATTR_CTIME|fuse.FATTR_MTIME_NOW) == 0 {
		out.Attr = c.attr
		return 0
	}
	return syscall.EROFS
}

// Read: the control file has nothing to read.
func (c *controlFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultData(nil), 0
}

// Write feeds the handle's frame stream. A bad frame fails the write that
// delivers its first bad field with EINVAL (frames completed before it in
// the same write are still accepted) and resets the stream.
func (c *controlFile) Write(ctx context.Context, fh gofs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	h, ok := fh.(*controlHandle)
	if !ok {
		return 0, syscall.EBADF
	}
	o := c.r.o
	h.mu.Lock()
	frames, err := h.dec.Write(data)
	for _, f := range frames {
		switch h.layer {
		case stats.BarrierNoLayer:
			h.layer = f.Layer
		case f.Layer, stats.BarrierSeveralLayers:
		default:
			h.layer = stats.BarrierSeveralLayers
		}
		o.Stats.HintFrames.Add(1)
		o.Stats.HintRows.Add(uint64(len(f.Rows)))
		if o.Hints != nil {
			o.Hints.Submit(f.Class, f.Layer, f.Rows, h.b)
		}
	}
	h.mu.Unlock()
	if err != nil {
		o.Stats.HintRejected.Add(1)
		o.hotLog.Warn("hint frame rejected", zap.Error(err))
		if errors.Is(err, hints.ErrBadFrame) {
			return 0, syscall.EINVAL
		}
		return 0, syscall.EIO
	}
	return uint32(len(data)), 0
}

// Fsync returns once every frame accepted on this handle so far is resident
// (0) or has failed (EIO).
func (c *controlFile) Fsync(ctx context.Context, fh gofs.FileHandle, flags uint32) syscall.Errno {
	h, ok := fh.(*controlHandle)
	if !ok {
		return syscall.EBADF
	}
	var err error
	if tm := c.r.o.Stats.Timings; tm != nil {
		h.mu.Lock()
		layer := h.layer
		h.layer = stats.BarrierNoLayer
		h.mu.Unlock()
		start := time.Now()
		err = h.b.Wait(ctx)
		tm.BarrierWaited(layer, time.Since(start))
	} else {
		err = h.b.Wait(ctx)
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return syscall.EINTR
	default:
		return syscall.EIO
	}
}

// Store pushes data into the page cache of table id at off (NOTIFY_STORE).
// It implements prefetch.Pusher; never call it from a Read handler.
func (s *Server) Store(id uint32, off int64, data []byte) error {
	if int(id) >= len(s.root.tables) {
		return syscall.EINVAL
	}
	switch errno := s.root.tables[id].EmbeddedInode().WriteCache(off, data); errno {
	case 0:
		return nil
	case syscall.ENOENT:
		return prefetch.ErrNotLookedUp
	default:
		return errno
	}
}

package fs

import (
	"context"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

// Timing for the histograms of --metrics-addr is a wrapper chosen once,
// when the tree is built (as gcsfuse's internal/fs/wrappers/monitoring.go
// wraps its file system), not a branch in each handler: with metrics off
// the fault path reads no clock and tests no flag.

// timedTableFile is a table file whose reads are timed.
type timedTableFile struct {
	*tableFile
	tm stats.Timings
}

var _ = (gofs.NodeReader)((*timedTableFile)(nil))

// timeTable returns f itself, or f timed when tm is set.
func timeTable(f *tableFile, tm stats.Timings) gofs.InodeEmbedder {
	if tm == nil {
		return f
	}
	return &timedTableFile{tableFile: f, tm: tm}
}

// Read is tableFile.Read, timed from the request to the reply.
func (f *timedTableFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	start := time.Now()
	res, errno := f.tableFile.Read(ctx, fh, dest, off)
	f.tm.FaultServed(f.t.ID, time.Since(start))
	return res, errno
}

// timeBarrier returns wait itself, or wait timed when tm is set: the wait
// is reported under the one layer the handle's frames named since its
// previous barrier (or stats.BarrierSeveralLayers, stats.BarrierNoLayer).
func timeBarrier(wait func(context.Context, *controlHandle) (prefetch.Status, error), tm stats.Timings) func(context.Context, *controlHandle) (prefetch.Status, error) {
	if tm == nil {
		return wait
	}
	return func(ctx context.Context, h *controlHandle) (prefetch.Status, error) {
		h.mu.Lock()
		layer := h.layer
		h.layer = stats.BarrierNoLayer
		h.mu.Unlock()
		start := time.Now()
		st, err := wait(ctx, h)
		tm.BarrierWaited(layer, time.Since(start))
		return st, err
	}
}

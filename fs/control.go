package fs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"unicode/utf8"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

// HintSink receives decoded hint frames (prefetch.Prefetcher). (The
// clients' side, which sends frames, is hints/client.Hinter.)
type HintSink interface {
	// SubmitPart queues the rows one write delivered of a frame; frameEnd
	// says the frame is complete. It never waits for fetches or queue room.
	SubmitPart(b *prefetch.Barrier, class hints.Class, layer int, rows []uint64, frameEnd bool)
	// Release drops the work only b's handle waited for: it was closed.
	Release(b *prefetch.Barrier)
	Config() prefetch.Config
}

// controlFile is .engramfs/control: hint frames are written to it, and read(2)
// on a handle is the barrier for that handle's frames (fsync too, at a cost:
// see Fsync).
type controlFile struct {
	roFile
	r *root
	// wait is the barrier's wait, chosen once when the tree is built:
	// waitBarrier, or a timed one when metrics are on (timing.go).
	wait func(ctx context.Context, h *controlHandle) (prefetch.Status, error)
}

// ControlSize is the size the control file reports. The kernel takes the
// inode lock exclusively for a direct-io write that reaches past EOF
// (fs/fuse/file.c: fuse_dio_wr_exclusive_lock -> fuse_io_past_eof), even
// with FOPEN_PARALLEL_DIRECT_WRITES; a stream file writes at position 0, so
// a size above any write keeps every write on the shared lock. The file
// reports no blocks, so du counts none of it (a 132 MiB model's mount was
// 1.1T to du -sh).
const ControlSize = 1 << 40

// statusLineMax bounds the barrier's JSON line; a read must offer this much.
const statusLineMax = 256

// DefaultControlHandles is how many control-file handles may be open at
// once (--control-handles). A node runs a few ranks with one or two handles
// each; the bound is for a client that leaks handles, since each may hold
// --decode-queue pages of decode work and one write more (measured: 131 B
// of heap a queued page, so ~13 MB a handle at the default bound and 4096 B
// rows, ~830 MB for 64 handles all full; docs/design.md, Hints).
const DefaultControlHandles = 64

// controlHandle is one open of the control file: its own frame stream and
// its own barrier.
type controlHandle struct {
	c   *controlFile
	mu  sync.Mutex // serialises writes: the stream is ordered per handle
	dec *hints.Decoder
	b   *prefetch.Barrier
	// layer names what the frames since the last barrier asked for, for the
	// barrier-wait histogram's label: one layer, stats.BarrierSeveralLayers
	// or stats.BarrierNoLayer. GUARDED_BY(mu)
	layer int
	// rejected is why the last frame rejected since the previous barrier
	// was: the write's EINVAL carries no text, so the barrier's status line
	// does (hints.Status.Error). Atomic, not under mu: a barrier must not
	// wait for a write in progress on the handle.
	rejected atomic.Pointer[string]
}

// takeRejected returns the reason of the last rejected frame and forgets it.
func (h *controlHandle) takeRejected() string {
	if r := h.rejected.Swap(nil); r != nil {
		return *r
	}
	return ""
}

var (
	_ = (gofs.NodeOpener)((*controlFile)(nil))
	_ = (gofs.NodeWriter)((*controlFile)(nil))
	_ = (gofs.NodeReader)((*controlFile)(nil))
	_ = (gofs.NodeFsyncer)((*controlFile)(nil))
	_ = (gofs.NodeSetattrer)((*controlFile)(nil))
	_ = (gofs.NodeIoctler)((*controlFile)(nil))
	_ = (gofs.FileReleaser)((*controlHandle)(nil))
)

// Open admits the daemon's own user only: with allow_other, other users
// could otherwise steer what the daemon reads and pins.
//
// DIRECT_IO: every write reaches us as written (no page cache for a
// stream), and reads are barriers, not data. PARALLEL_DIRECT_WRITES: the
// kernel takes the control inode's lock shared for our writes
// (fuse_dio_lock), so one rank's write never waits for another's. STREAM:
// writes and reads happen at position 0 (no pread/pwrite), which with
// ControlSize keeps every write inside the file, as the shared lock needs.
// NOFLUSH: see noFlush.
func (c *controlFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if caller, ok := fuse.FromContext(ctx); ok && caller.Uid != c.r.o.uid {
		return nil, 0, syscall.EACCES
	}
	if !c.takeHandle() {
		return nil, 0, syscall.ENFILE
	}
	h := &controlHandle{c: c, dec: hints.NewStreamDecoder(c.r.o.Model), b: prefetch.NewBarrier(), layer: stats.BarrierNoLayer}
	return h, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES | fuse.FOPEN_STREAM | noFlush, 0
}

// noFlush is FOPEN_NOFLUSH, which every file of the tree is opened with:
// the kernel then sends no FLUSH at each close(2) of a handle, a round trip
// to the daemon that does nothing here (nothing is written back). Without
// it a close, or an exec that closes a close-on-exec handle, waits for a
// daemon: after a crash it hung until a successor served, and a process
// that held a hint handle and started that successor itself never returned
// from starting it (TestCrashTakeoverHinterReopens).
const noFlush = fuse.FOPEN_NOFLUSH

// takeHandle counts one more open handle, or refuses it (counted, logged)
// when Options.ControlHandles are open already.
func (c *controlFile) takeHandle() bool {
	o := c.r.o
	limit := int64(o.ControlHandles)
	if limit <= 0 {
		limit = DefaultControlHandles
	}
	if o.Stats.ControlHandles.Add(1) <= limit {
		return true
	}
	o.Stats.ControlHandles.Add(-1)
	o.Stats.ControlHandlesRefused.Add(1)
	o.hotLog.Warn("control file open refused: too many handles open", zap.Int64("control_handles", limit))
	return false
}

// Release ends the handle: the frames it hinted that nobody else waits for
// are dropped (the process that sent them may have been killed, and the
// pages would be fetched for nobody), and its slot is free again. A partial
// frame is dropped with the decoder.
func (h *controlHandle) Release(ctx context.Context) syscall.Errno {
	o := h.c.r.o
	if o.hints != nil {
		o.hints.Release(h.b)
	}
	o.Stats.ControlHandles.Add(-1)
	return 0
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

// Read is the barrier: it blocks until every frame accepted on this handle
// before the read has settled, then returns one line of JSON with the counts
// since the previous barrier (prefetch.Status) and, in "error", why a frame
// was rejected or pages failed. With nothing accepted or rejected since the
// previous barrier it returns 0 bytes at once (so `cat` ends). A signal
// interrupts the wait (EINTR); the counts are kept for the next barrier.
func (c *controlFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	h, ok := fh.(*controlHandle)
	if !ok {
		return nil, syscall.EBADF
	}
	if h.b.Idle() && h.rejected.Load() == nil {
		return fuse.ReadResultData(nil), 0
	}
	if len(dest) < statusLineMax {
		return nil, syscall.EINVAL
	}
	st, errno := c.barrier(ctx, h)
	if errno != 0 {
		return nil, errno
	}
	line, err := statusLine(st, len(dest))
	if err != nil {
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(line), 0
}

// barrier waits for h's frames, and adds the reason of the last frame
// rejected since the previous barrier to the status.
func (c *controlFile) barrier(ctx context.Context, h *controlHandle) (prefetch.Status, syscall.Errno) {
	st, err := c.wait(ctx, h)
	if err != nil {
		return st, syscall.EINTR
	}
	if r := h.takeRejected(); r != "" {
		if st.Error != "" {
			r += "; " + st.Error
		}
		st.Error = r
	}
	return st, 0
}

// statusLine is st as one line of JSON of at most max bytes (max >=
// statusLineMax): a reason too long for the reader's buffer is cut short,
// ending in "...", never the counts.
func statusLine(st prefetch.Status, max int) ([]byte, error) {
	line, err := json.Marshal(st)
	if err != nil || len(line) < max || st.Error == "" {
		return append(line, '\n'), err
	}
	// Keep the runes whose JSON (escapes included) fits the room left.
	reason := st.Error
	st.Error = "..."
	bare, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	room := max - 1 - len(bare)
	keep := 0
	for keep < len(reason) && room > 0 {
		_, n := utf8.DecodeRuneInString(reason[keep:])
		esc, _ := json.Marshal(reason[keep : keep+n])
		if room -= len(esc) - 2; room >= 0 {
			keep += n
		}
	}
	st.Error = reason[:keep] + "..."
	if line, err = json.Marshal(st); err != nil || len(line) >= max {
		st.Error = "" // not even "..." fits: the counts go alone
		line, err = json.Marshal(st)
	}
	return append(line, '\n'), err
}

// waitBarrier is the untimed barrier wait.
func waitBarrier(ctx context.Context, h *controlHandle) (prefetch.Status, error) {
	return h.b.Status(ctx)
}

// Write feeds the handle's frame stream: it decodes and queues, and never
// waits for a fetch or for queue room. The rows of a frame are queued as
// their writes arrive, so no frame is ever held whole. A bad frame fails the
// write that delivers its first bad field with EINVAL (frames and rows
// before it are still accepted) and resets the stream; the next barrier's
// status line says why (the errno cannot). While the handle has
// more decode work queued than prefetch.Config.DecodeQueuePages, a write
// that starts a decode frame is refused with EAGAIN before a byte of it is
// decoded, so the client sends the same frame again; a frame already begun
// is always finished, a write at a time as the backlog has room
// (decodeRoom). Prefill work is never refused: the oldest is dropped,
// counted, instead.
func (c *controlFile) Write(ctx context.Context, fh gofs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	h, ok := fh.(*controlHandle)
	if !ok {
		return 0, syscall.EBADF
	}
	h.mu.Lock()
	errno := c.take(ctx, h, data)
	h.mu.Unlock()
	if errno != 0 {
		return 0, errno
	}
	return uint32(len(data)), 0
}

// take decodes data into the handle's stream and queues what it completes,
// as Write does: EAGAIN or EINTR from decodeRoom, nothing taken; EINVAL
// when a bad frame was rejected (h.rejected says why, for the next
// barrier).
//
// REQUIRES(h.mu)
func (c *controlFile) take(ctx context.Context, h *controlHandle, data []byte) syscall.Errno {
	o := c.r.o
	if errno := c.decodeRoom(ctx, h, data); errno != 0 {
		return errno
	}
	parts, err := h.dec.Write(data)
	for _, f := range parts {
		if !f.More {
			switch h.layer {
			case stats.BarrierNoLayer:
				h.layer = f.Layer
			case f.Layer, stats.BarrierSeveralLayers:
			default:
				h.layer = stats.BarrierSeveralLayers
			}
			o.Stats.HintFrames.Add(1)
		}
		o.Stats.HintRows.Add(uint64(len(f.Rows)))
		if o.hints != nil {
			o.hints.SubmitPart(h.b, f.Class, f.Layer, f.Rows, !f.More)
		}
	}
	if err == nil {
		return 0
	}
	c.reject(h, err.Error())
	if errors.Is(err, hints.ErrBadFrame) {
		return syscall.EINVAL
	}
	return syscall.EIO
}

// reject keeps why a frame of h was rejected for its next barrier.
func (c *controlFile) reject(h *controlHandle, reason string) {
	h.rejected.Store(&reason)
	c.r.o.Stats.HintRejected.Add(1)
	c.r.o.hotLog.Warn("hint frame rejected", zap.String("reason", reason))
}

// Ioctl answers the step (hints.StepCmd): the frames of the request's
// buffer taken as a write takes them, then the handle's barrier, whose
// status line goes back in the same buffer. One FUSE request where a write
// per frame and a read are one each: a decode step whose pages are all
// resident costs little more than its round trips. A rejected frame does
// not fail the call: the line says why, as the barrier after a failed
// write would. The frames must begin and end at frame boundaries of the
// handle's stream (EINVAL, with the reason in the next barrier's line,
// otherwise): a step never finishes or leaves a frame half written.
func (c *controlFile) Ioctl(ctx context.Context, fh gofs.FileHandle, cmd uint32, arg uint64, input []byte, output []byte) (int32, syscall.Errno) {
	h, ok := fh.(*controlHandle)
	if !ok {
		return 0, syscall.EBADF
	}
	size, ok := hints.StepSize(cmd)
	if !ok {
		return 0, syscall.ENOTTY
	}
	if len(input) != size || len(output) != size {
		return 0, syscall.EINVAL
	}
	frames, err := hints.StepFrames(input)
	if err != nil {
		return 0, syscall.EINVAL
	}
	h.mu.Lock()
	if !h.dec.AtFrameStart() {
		h.mu.Unlock()
		c.reject(h, "a step began inside a frame that earlier writes on the handle left unfinished")
		return 0, syscall.EINVAL
	}
	errno := c.take(ctx, h, frames)
	cut := errno == 0 && !h.dec.AtFrameStart()
	if cut {
		// The rows of the cut frame decoded so far are queued, as a bad
		// frame's before its bad field are.
		h.dec.Reset()
		c.reject(h, fmt.Sprintf("a step's last frame is cut short (%d bytes of frames)", len(frames)))
	}
	h.mu.Unlock()
	switch {
	case cut:
		return 0, syscall.EINVAL
	case errno == syscall.EAGAIN || errno == syscall.EINTR:
		return 0, errno // nothing taken
	}
	// Taken, or a frame rejected (EINVAL, EIO): the line says why.
	st, errno := c.barrier(ctx, h)
	if errno != 0 {
		return 0, errno
	}
	line, err := statusLine(st, size-4)
	if err != nil {
		return 0, syscall.EIO
	}
	if err := hints.PutStepStatus(output, line); err != nil {
		return 0, syscall.EIO
	}
	c.r.o.Stats.HintSteps.Add(1)
	return 0, 0
}

// decodeRoom bounds the handle's decode backlog before a write of decode
// rows is decoded. A write that starts a decode frame while the backlog is
// at --decode-queue is refused with EAGAIN, nothing of it taken. A write
// that continues a decode frame waits until the workers bring the backlog
// under the bound: a frame already begun is always finished, but a frame
// larger than the bound is taken a write at a time as room comes, so a
// handle holds at most the bound plus one write's pages (one 1M-row frame
// queued all its 1,048,448 pages at once when only a frame's start was
// checked). A signal interrupts the wait: EINTR, nothing of this write
// taken, and the stream reset (the kernel reports the writes before it as
// a short write, the end of that frame for the clients).
// Prefill frames are never held back: their queue drops the oldest work.
//
// REQUIRES(h.mu)
func (c *controlFile) decodeRoom(ctx context.Context, h *controlHandle, data []byte) syscall.Errno {
	o := c.r.o
	if o.hints == nil {
		return 0
	}
	if class, ok := h.dec.NextClass(data); !ok || class != hints.Decode {
		return 0
	}
	limit := o.hints.Config().DecodeQueuePages
	if h.dec.AtFrameStart() {
		if h.b.DecodeBacklog() >= limit {
			o.Stats.HintRefused.Add(1)
			return syscall.EAGAIN
		}
		return 0
	}
	if err := h.b.WaitDecodeRoom(ctx, limit); err != nil {
		// The kernel returns the requests taken before this one as a
		// short write, which the clients treat as an error and never
		// resend: the rest of the frame is not coming, so the next write
		// starts a new one.
		h.dec.Reset()
		return syscall.EINTR
	}
	return 0
}

// Fsync waits as the read barrier does and returns 0, or EIO if pages
// failed since the previous barrier; dropped prefill pages are not
// failures. It is kept for existing clients, but it serializes the node:
// the kernel holds the control inode's lock for the whole FUSE fsync
// (fuse_fsync), and every other handle's writes wait behind it (measured:
// a 72-row decode write stalled 963 ms behind another process's 1 s
// prefill fsync). Clients use the read barrier.
func (c *controlFile) Fsync(ctx context.Context, fh gofs.FileHandle, flags uint32) syscall.Errno {
	h, ok := fh.(*controlHandle)
	if !ok {
		return syscall.EBADF
	}
	st, errno := c.barrier(ctx, h)
	switch {
	case errno != 0:
		return errno
	case st.Failed > 0:
		return syscall.EIO
	}
	return 0
}

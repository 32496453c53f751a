// Package client sends hints to a mounted engramfs from Go programs.
//
// Each call writes binary frames (see package hints) to the mount's
// .engramfs/control file, one write(2) per frame, so the filesystem can start
// fetching a frame's rows as soon as it arrives. Barrier and Wait are the
// read barrier: read(2) on the handle, which blocks this handle only (fsync
// would also wait, but holds the control file's inode lock, so every other
// rank's hints would wait behind it).
//
// A frame the filesystem rejects (a row out of range, an unknown layer)
// fails its write with EINVAL, which carries no text; the call then reads
// the barrier, whose status line says why, and returns an error wrapping
// ErrRejected and syscall.EINVAL with the reason ("row 99999 out of range
// (layer 0 has 16384 rows)"). The counts that barrier read are kept for the
// next Barrier.
//
// From another module, require the engramfs module and point it at a
// checkout (the module is not published):
//
//	go mod edit -require=github.com/engramfs/engramfs@v0.0.0 \
//	    -replace=github.com/engramfs/engramfs=/path/to/engramfs
//	go mod tidy
//
// then import "github.com/engramfs/engramfs/hints/client".
package client

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/engramfs/engramfs/hints"
)

// maxKeptBuf bounds the frame buffer a Hinter keeps between calls: enough for
// a 40K-row prefill chunk (320 KiB), not for a rare 4M-row frame (32 MiB).
const maxKeptBuf = 1 << 20

// EAGAIN means the handle has more decode work queued than the filesystem
// holds for one handle; nothing of the frame was taken, so it is sent again,
// backing off up to maxRetrySleep, for at most retryTimeout.
const (
	maxRetrySleep = 10 * time.Millisecond
	retryTimeout  = time.Minute
)

// ErrFailed is wrapped by the error of a barrier whose pages failed.
var ErrFailed = errors.New("hinted pages failed")

// ErrRejected is wrapped by the error of a frame the filesystem rejected;
// the error says why.
var ErrRejected = errors.New("rejected by the mount")

// Hinter writes hints to one handle of a mount's control file. It is safe for
// concurrent use; frames of concurrent calls are never interleaved.
type Hinter struct {
	f    atomic.Pointer[os.File] // replaced by reopen
	path string

	noStep atomic.Bool // the filesystem answered the step's ioctl ENOTTY

	mu  sync.Mutex
	buf []byte // GUARDED_BY(mu)
	// carried is what the barrier read after a rejected frame counted: it
	// belongs to the next Barrier. GUARDED_BY(mu)
	carried hints.Status
}

// Open opens the control file of the engramfs mounted at mount.
func Open(mount string) (*Hinter, error) {
	path := filepath.Join(mount, ".engramfs", "control")
	// Read and write: reading the handle is the barrier.
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("hint open: %w", err)
	}
	h := &Hinter{path: path}
	h.f.Store(f)
	return h, nil
}

// staleHandle reports whether err means the handle no longer reaches a
// daemon that knows it, while the mount may: a daemon that took the mount
// over without this handle (EBADF: after a crash, or one too old to carry
// handles over), a remount (ESTALE), or a dead mount (ENOTCONN).
func staleHandle(err error) bool {
	return errors.Is(err, syscall.EBADF) || errors.Is(err, syscall.ESTALE) || errors.Is(err, syscall.ENOTCONN)
}

// reopen replaces the handle f that failed with a new one, once: a
// concurrent call that already replaced it does nothing. Frames accepted
// on the old handle are not waited for by the new one's barrier.
func (h *Hinter) reopen(f *os.File) error {
	nf, err := os.OpenFile(h.path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("hint reopen: %w", err)
	}
	if !h.f.CompareAndSwap(f, nf) {
		nf.Close()
		return nil
	}
	f.Close()
	return nil
}

// Prefill asks for rows of layer that a coming chunk will need. The filesystem
// may drop them when its queues are full.
func (h *Hinter) Prefill(layer int, rows []uint64) error {
	return h.send(hints.Prefill, layer, rows)
}

// Decode asks for rows of layer that this step needs; they are served before
// any queued prefill work and never dropped.
func (h *Hinter) Decode(layer int, rows []uint64) error {
	return h.send(hints.Decode, layer, rows)
}

func (h *Hinter) send(c hints.Class, layer int, rows []uint64) error {
	// The frame holds a u16: a larger layer would silently name another one.
	if layer < 0 || layer > hints.MaxLayer {
		return fmt.Errorf("hint %s layer %d: layer out of range 0..%d", c, layer, hints.MaxLayer)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for len(rows) > 0 {
		chunk := rows[:min(len(rows), hints.MaxRowsPerFrame)]
		rows = rows[len(chunk):]
		h.buf = hints.AppendBinary(h.buf[:0], c, layer, chunk)
		f := h.f.Load()
		err := h.writeFrame(f, h.buf)
		if staleHandle(err) {
			// Nothing of the frame was taken: send it on a new handle.
			if rerr := h.reopen(f); rerr != nil {
				return fmt.Errorf("hint %s layer %d: %w (%v)", c, layer, err, rerr)
			}
			err = h.writeFrame(h.f.Load(), h.buf)
		}
		if errors.Is(err, syscall.EINVAL) {
			err = h.whyRejected(err)
		}
		if err != nil {
			return fmt.Errorf("hint %s layer %d: %w", c, layer, err)
		}
	}
	if cap(h.buf) > maxKeptBuf {
		h.buf = nil
	}
	return nil
}

// writeFrame writes one frame in one write(2). os.File.Write would send the
// rest of a short write again, and the filesystem would decode it as a new
// stream (a short write means it refused part of the frame and reset the
// stream), so the write is made here.
func (h *Hinter) writeFrame(f *os.File, frame []byte) error {
	return h.untilTaken(f, "write", func(fd int) error {
		n, err := syscall.Write(fd, frame)
		if err == nil && n != len(frame) {
			return fmt.Errorf("short write: %d of %d bytes of a frame taken: %w", n, len(frame), syscall.EIO)
		}
		return err
	})
}

// untilTaken makes the system call op on f's descriptor until the
// filesystem takes what it sends: again at once after EINTR, and after
// EAGAIN (the handle's decode backlog is full; nothing was taken) backing
// off, for at most retryTimeout. Its error is an *os.PathError.
func (h *Hinter) untilTaken(f *os.File, what string, op func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return &os.PathError{Op: what, Path: h.path, Err: os.ErrClosed}
	}
	sleep, deadline := 50*time.Microsecond, time.Time{}
	for {
		var oerr error
		if err := rc.Control(func(fd uintptr) {
			for {
				if oerr = op(int(fd)); oerr != syscall.EINTR {
					return
				}
			}
		}); err != nil {
			// The only failure of RawConn.Control: the file was closed.
			return &os.PathError{Op: what, Path: h.path, Err: os.ErrClosed}
		}
		if oerr == syscall.EAGAIN {
			if deadline.IsZero() {
				deadline = time.Now().Add(retryTimeout)
			} else if time.Now().After(deadline) {
				return &os.PathError{Op: what, Path: h.path, Err: oerr}
			}
			time.Sleep(sleep)
			sleep = min(2*sleep, maxRetrySleep)
			continue
		}
		if oerr != nil {
			return &os.PathError{Op: what, Path: h.path, Err: oerr}
		}
		return nil
	}
}

// Step sends rows[i] of layers[i] as decode hints and waits for them,
// returning what Barrier would: in one ioctl(2) (hints.StepCmd), one
// request to the filesystem where Decode for each layer and then Barrier
// make one each. A step too large for the ioctl (more than ~2,000 rows), or
// a filesystem without it, is sent as Decode calls and a Barrier.
func (h *Hinter) Step(layers []int, rows [][]uint64) (hints.Status, error) {
	if len(layers) != len(rows) {
		return hints.Status{}, fmt.Errorf("hint step: %d layers, %d row lists", len(layers), len(rows))
	}
	for _, l := range layers {
		if l < 0 || l > hints.MaxLayer {
			return hints.Status{}, fmt.Errorf("hint step layer %d: layer out of range 0..%d", l, hints.MaxLayer)
		}
	}
	h.mu.Lock()
	if !h.noStep.Load() {
		if buf, ok := hints.DecodeStepBuffer(h.buf, layers, rows); ok {
			h.buf = buf
			if st, err, done := h.step(buf); done {
				h.mu.Unlock()
				return h.conclude(st, err)
			}
		}
	}
	h.mu.Unlock()
	for i, l := range layers {
		if err := h.Decode(l, rows[i]); err != nil {
			return hints.Status{}, err
		}
	}
	return h.Barrier()
}

// step makes the ioctl. done is false when the filesystem has no step
// (ENOTTY: nothing was taken), and the caller sends the frames otherwise.
// After EINTR untilTaken sends the step again: its frames were taken, and
// naming them again counts them twice in Status.Frames, their pages once.
//
// REQUIRES(h.mu)
func (h *Hinter) step(buf []byte) (st hints.Status, err error, done bool) {
	cmd := uintptr(hints.StepCmd(len(buf)))
	ioctl := func(fd int) error {
		_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), cmd, uintptr(unsafe.Pointer(&buf[0])))
		if errno != 0 {
			return errno
		}
		return nil
	}
	f := h.f.Load()
	err = h.untilTaken(f, "step", ioctl)
	if staleHandle(err) {
		// Nothing was taken: send it on a new handle.
		if rerr := h.reopen(f); rerr != nil {
			return st, fmt.Errorf("hint step: %w (%v)", err, rerr), true
		}
		err = h.untilTaken(h.f.Load(), "step", ioctl)
	}
	switch {
	case errors.Is(err, syscall.ENOTTY):
		h.noStep.Store(true)
		return st, nil, false
	case errors.Is(err, syscall.EINVAL):
		return st, fmt.Errorf("hint step: %w", h.whyRejected(err)), true
	case err != nil:
		return st, fmt.Errorf("hint step: %w", err), true
	}
	line, err := hints.StepStatus(buf)
	if err == nil {
		err = json.Unmarshal(line, &st)
	}
	if err != nil {
		return st, fmt.Errorf("hint step: the status line: %w", err), true
	}
	return st, nil, true
}

// whyRejected reads why the filesystem rejected a frame (the write's
// EINVAL carries no text; the barrier's status line does) and keeps the
// barrier's counts for the next Barrier. It waits for this handle's
// earlier frames, as any barrier does.
//
// REQUIRES(h.mu)
func (h *Hinter) whyRejected(werr error) error {
	st, err := h.readStatus()
	if err != nil {
		return fmt.Errorf("%w (the reason was not read: %v)", werr, err)
	}
	reason := st.Error
	if st.Failed == 0 {
		st.Error = "" // said now; nothing more for the next barrier
	}
	h.carried.Add(st)
	if reason == "" {
		return werr // a daemon that does not say
	}
	return fmt.Errorf("%w: %s: %w", ErrRejected, reason, werr)
}

// readStatus is one barrier read: the status line, or the zero Status when
// nothing was sent since the previous barrier.
func (h *Hinter) readStatus() (hints.Status, error) {
	var st hints.Status
	buf := make([]byte, 4096)
	f := h.f.Load()
	n, err := f.Read(buf) // EINTR is retried by os.File
	if staleHandle(err) {
		// The frames of the old handle cannot be waited for any more; the
		// next ones go to a new handle.
		if rerr := h.reopen(f); rerr != nil {
			return st, fmt.Errorf("hint barrier: %w (%v)", err, rerr)
		}
		return st, nil
	}
	switch {
	case errors.Is(err, io.EOF) || (err == nil && n == 0):
		return st, nil // nothing sent since the previous barrier
	case err != nil:
		return st, err
	}
	if err := json.Unmarshal(buf[:n], &st); err != nil {
		return st, fmt.Errorf("status line %q: %w", buf[:n], err)
	}
	return st, nil
}

// Barrier returns once every frame accepted so far on this handle has
// settled, with the counts since the previous barrier. Its error wraps
// ErrFailed if pages failed, or ErrRejected if a frame was rejected that no
// call has reported (another writer's on the handle), and says why; the
// status is returned too.
func (h *Hinter) Barrier() (hints.Status, error) {
	st, err := h.readStatus()
	if err != nil {
		err = fmt.Errorf("hint barrier: %w", err)
	}
	return h.conclude(st, err)
}

// conclude adds the counts carried from a rejected frame's barrier to st,
// the status of a barrier (or step) whose system call returned err, and
// says what went wrong.
func (h *Hinter) conclude(st hints.Status, err error) (hints.Status, error) {
	h.mu.Lock()
	h.carried.Add(st)
	st, h.carried = h.carried, hints.Status{}
	h.mu.Unlock()
	switch {
	case err != nil:
		return st, err
	case st.Failed > 0 && st.Error == "": // a daemon that does not say
		return st, fmt.Errorf("hint barrier: %d of %d pages: %w", st.Failed, st.Pages, ErrFailed)
	case st.Failed > 0:
		return st, fmt.Errorf("hint barrier: %d of %d pages (%s): %w", st.Failed, st.Pages, st.Error, ErrFailed)
	case st.Error != "":
		return st, fmt.Errorf("hint barrier: %w: %s", ErrRejected, st.Error)
	}
	return st, nil
}

// Wait is Barrier without the counts.
func (h *Hinter) Wait() error {
	_, err := h.Barrier()
	return err
}

// Close closes the control handle.
func (h *Hinter) Close() error {
	if err := h.f.Load().Close(); err != nil {
		return fmt.Errorf("hint close: %w", err)
	}
	return nil
}

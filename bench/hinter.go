package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	mfs "github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/hints"
)

// Barrier kinds: how path 5 waits for its hints.
const (
	BarrierRead  = "read"  // read(2) on the control handle: one JSON line once its frames settled
	BarrierFsync = "fsync" // fsync on the control handle (a daemon without the read barrier)
)

// hinter writes binary hint frames to one handle of the control file and
// waits for them with the read barrier when the daemon has one, else with
// fsync. (hints/client's Hinter opens the file write-only and waits with
// fsync, which holds the control inode's lock for the whole wait.)
type hinter struct {
	f       *os.File
	fd      int    // f's number: File.Fd costs two fcntl calls each time
	barrier string // BarrierRead or BarrierFsync
	stream  bool   // the handle has no offsets: read(2), not pread
	why     string // how the barrier was chosen

	mu  sync.Mutex
	buf []byte // GUARDED_BY(mu)
	// rbuf is the barrier's read buffer; Wait is not called concurrently
	// with itself.
	rbuf []byte
	// noStep: the daemon answered the step's ioctl ENOTTY (one older
	// than it), so steps go as writes and a barrier. GUARDED_BY(mu)
	noStep bool
}

// openHinter opens the control file of the mount at mp read-write and
// detects the read barrier: a read of the fresh handle, with nothing
// pending, returns a JSON line at once on a daemon that has it, and 0 bytes
// on one that does not.
func openHinter(mp string) (*hinter, error) {
	path := filepath.Join(mp, mfs.ControlDir, mfs.ControlFile)
	h := &hinter{rbuf: make([]byte, 64<<10)}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		// A daemon whose control file admits writes only.
		wf, werr := os.OpenFile(path, os.O_WRONLY, 0)
		if werr != nil {
			return nil, fmt.Errorf("hint open: %w", werr)
		}
		h.f, h.fd, h.barrier = wf, int(wf.Fd()), BarrierFsync
		h.why = fmt.Sprintf("fsync: the control file does not open for reading (%v)", err)
		return h, nil
	}
	h.f, h.fd = f, int(f.Fd())
	n, err := h.readBarrier()
	switch {
	case errors.Is(err, unix.ESPIPE):
		// A stream handle (FOPEN_STREAM): a daemon with the read barrier,
		// which answers an idle barrier with 0 bytes at once.
		h.barrier, h.stream = BarrierRead, true
		h.why = "read(2) on the control handle (a stream)"
	case err != nil:
		f.Close()
		return nil, fmt.Errorf("hint open: a read of a fresh control handle: %w", err)
	case n == 0:
		h.barrier = BarrierFsync
		h.why = "fsync: a read of a fresh control handle returned 0 bytes (the daemon has no read barrier)"
	default:
		if _, err := parseBarrier(h.rbuf[:n]); err != nil {
			f.Close()
			return nil, fmt.Errorf("hint open: a read of a fresh control handle: %w", err)
		}
		h.barrier = BarrierRead
		h.why = "read(2) on the control handle"
	}
	return h, nil
}

// readBarrier reads the handle once, at offset 0: the barrier's line, or 0
// bytes from a daemon without one.
func (h *hinter) readBarrier() (int, error) {
	for {
		var n int
		var err error
		if h.stream {
			n, err = unix.Read(h.fd, h.rbuf)
		} else {
			n, err = unix.Pread(h.fd, h.rbuf, 0)
		}
		if err == unix.EINTR {
			continue
		}
		return n, err
	}
}

// parseBarrier decodes a read barrier's reply: one line of JSON, what
// settled since the previous barrier on the handle.
func parseBarrier(b []byte) (hints.Status, error) {
	var r hints.Status
	line := bytes.TrimSpace(b)
	if bytes.IndexByte(line, '\n') >= 0 {
		return r, fmt.Errorf("barrier reply is not one line: %q", b)
	}
	if err := json.Unmarshal(line, &r); err != nil {
		return r, fmt.Errorf("barrier reply %q: %w", b, err)
	}
	return r, nil
}

// Prefill and Decode send one class of hint for rows of layer.
func (h *hinter) Prefill(layer int, rows []uint64) error { return h.send(hints.Prefill, layer, rows) }
func (h *hinter) Decode(layer int, rows []uint64) error  { return h.send(hints.Decode, layer, rows) }

func (h *hinter) send(c hints.Class, layer int, rows []uint64) error {
	if layer < 0 || layer > hints.MaxLayer {
		return fmt.Errorf("hint %s layer %d: layer out of range 0..%d", c, layer, hints.MaxLayer)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for len(rows) > 0 {
		chunk := rows[:min(len(rows), hints.MaxRowsPerFrame)]
		rows = rows[len(chunk):]
		h.buf = hints.AppendBinary(h.buf[:0], c, layer, chunk)
		if _, err := h.f.Write(h.buf); err != nil {
			return fmt.Errorf("hint %s layer %d: %w", c, layer, err)
		}
	}
	return nil
}

// Wait returns once every frame sent on this handle has settled; an error
// if one of them failed.
func (h *hinter) Wait() error {
	_, err := h.WaitStatus()
	return err
}

// WaitStatus is Wait, with what the read barrier said settled (the zero
// Status from a daemon whose barrier is fsync).
func (h *hinter) WaitStatus() (hints.Status, error) {
	if h.barrier == BarrierFsync {
		if err := h.f.Sync(); err != nil {
			return hints.Status{}, fmt.Errorf("hint wait (fsync): %w", err)
		}
		return hints.Status{}, nil
	}
	n, err := h.readBarrier()
	if err != nil {
		return hints.Status{}, fmt.Errorf("hint wait (read barrier): %w", err)
	}
	if n == 0 {
		return hints.Status{}, errors.New("hint wait (read barrier): the read returned 0 bytes")
	}
	r, err := parseBarrier(h.rbuf[:n])
	if err != nil {
		return r, fmt.Errorf("hint wait: %w", err)
	}
	if r.Failed > 0 {
		return r, fmt.Errorf("hint wait (read barrier): %d of %d pages failed", r.Failed, r.Pages)
	}
	return r, nil
}

// Step sends rows[j] of layers[j] as decode frames and waits for them:
// one ioctl (hints.StepCmd) on a daemon that has the step and when the
// frames fit it, else a write a frame and the barrier (WaitStatus).
func (h *hinter) Step(layers []int, rows [][]uint64) (hints.Status, error) {
	h.mu.Lock()
	if !h.noStep && h.barrier == BarrierRead {
		if buf, ok := hints.DecodeStepBuffer(h.buf, layers, rows); ok {
			h.buf = buf
			st, err := h.step(buf)
			if err != unix.ENOTTY {
				h.mu.Unlock()
				return st, err
			}
			h.noStep = true
		}
	}
	h.mu.Unlock()
	for j, l := range layers {
		if err := h.Decode(l, rows[j]); err != nil {
			return hints.Status{}, err
		}
	}
	return h.WaitStatus()
}

// step is the ioctl: ENOTTY as it is, from a daemon without the step.
//
// REQUIRES(h.mu)
func (h *hinter) step(buf []byte) (hints.Status, error) {
	for {
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(h.fd), uintptr(hints.StepCmd(len(buf))), uintptr(unsafe.Pointer(&buf[0])))
		switch errno {
		case 0:
		case unix.EINTR, unix.EAGAIN:
			continue // the bench's decode backlog never fills; EINTR: the frames were taken, and naming them again is harmless
		case unix.ENOTTY:
			return hints.Status{}, errno
		default:
			return hints.Status{}, fmt.Errorf("hint step: %w", errno)
		}
		line, err := hints.StepStatus(buf)
		if err != nil {
			return hints.Status{}, fmt.Errorf("hint step: %w", err)
		}
		r, err := parseBarrier(line)
		if err != nil {
			return r, fmt.Errorf("hint step: %w", err)
		}
		if r.Failed > 0 {
			return r, fmt.Errorf("hint step: %d of %d pages failed", r.Failed, r.Pages)
		}
		return r, nil
	}
}

func (h *hinter) Close() error { return h.f.Close() }

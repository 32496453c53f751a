// Package client sends hints to a mounted engramfs from Go programs.
//
// Each call writes binary frames (see package hints) to the mount's
// .engramfs/control file, one write(2) per frame, so the filesystem can start
// fetching a frame's rows as soon as it arrives.
package client

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/engramfs/engramfs/hints"
)

// maxKeptBuf bounds the frame buffer a Hinter keeps between calls: enough for
// a 40K-row prefill chunk (320 KiB), not for a rare 4M-row frame (32 MiB).
const maxKeptBuf = 1 << 20

// Hinter writes hints to one handle of a mount's control file. It is safe for
// concurrent use; frames of concurrent calls are never interleaved.
type Hinter struct {
	f *os.File

	mu  sync.Mutex
	buf []byte // GUARDED_BY(mu)
}

// Open opens the control file of the engramfs mounted at mount.
func Open(mount string) (*Hinter, error) {
	f, err := os.OpenFile(filepath.Join(mount, ".engramfs", "control"), os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("hint open: %w", err)
	}
	return &Hinter{f: f}, nil
}

// Prefill asks for rows of layer that a coming chunk will need. The filesystem
// may drop them when its queues are full.
func (h *Hinter) Prefill(layer int, rows []uint64) error {
	return h.send(hints.Prefill, layer, rows)
}

// Decode asks for rows of layer that this step needs; they are served before
// any queued prefill work.
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
		if _, err := h.f.Write(h.buf); err != nil {
			return fmt.Errorf("hint %s layer %d: %w", c, layer, err)
		}
	}
	if cap(h.buf) > maxKeptBuf {
		h.buf = nil
	}
	return nil
}

// Wait returns once every frame accepted so far on this handle is resident in
// the page cache; its error wraps EIO if one of them failed.
func (h *Hinter) Wait() error {
	if err := h.f.Sync(); err != nil {
		return fmt.Errorf("hint wait: %w", err)
	}
	return nil
}

// Close closes the control handle.
func (h *Hinter) Close() error {
	if err := h.f.Close(); err != nil {
		return fmt.Errorf("hint close: %w", err)
	}
	return nil
}

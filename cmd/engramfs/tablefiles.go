package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/engramfs/engramfs/fs"
)

// tableFiles is every table file of the mount, opened by the daemon itself
// through the mount once it answers. Two reasons:
//
//   - NOTIFY_STORE answers ENOENT for an inode the kernel has not looked up
//     (measured on a fresh mount: `engramfs hint MNT --decode 14 1 2 3 4 5`
//     read 6 pages from disk and stored none). An open file keeps its
//     dentry, and so the inode, known to the kernel for the mount's life:
//     every push lands, whether or not a reader has opened the file yet.
//   - A page whose prefetch a fault cancelled is confirmed resident by
//     reading one byte of it through the page cache (Confirm).
//
// They are closed before unmounting: an open file keeps the mount busy.
type tableFiles struct {
	files []*os.File
}

// openTableFiles opens every table file of srv read-only.
func openTableFiles(srv *fs.Server, n int) (*tableFiles, error) {
	t := &tableFiles{}
	for id := range n {
		f, err := os.Open(srv.TablePath(uint32(id)))
		if err != nil {
			t.close()
			return nil, fmt.Errorf("looking up the table files: %w", err)
		}
		t.files = append(t.files, f)
	}
	return t, nil
}

// confirm reads one byte at off of table through the page cache: when it
// returns, the page is resident (a read the kernel still has in flight for
// it is waited for, an evicted page is faulted in again). Only from the
// prefetcher's pushers, never from a FUSE Read handler.
func (t *tableFiles) confirm(table uint32, off int64) error {
	if int(table) >= len(t.files) {
		return fmt.Errorf("table %d: no such table", table)
	}
	var b [1]byte
	if _, err := t.files[table].ReadAt(b[:], off); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	return nil
}

func (t *tableFiles) close() {
	for _, f := range t.files {
		_ = f.Close()
	}
	t.files = nil
}

// bindFiles gives the pusher the table files to confirm pages with.
func (p *latePusher) bindFiles(t *tableFiles) { p.mu.Lock(); p.files = t; p.mu.Unlock() }

// Confirm implements prefetch.Confirmer.
func (p *latePusher) Confirm(table uint32, off int64) error {
	p.mu.RLock()
	t := p.files
	p.mu.RUnlock()
	if t == nil {
		return nil // not mounted yet: nothing can have faulted
	}
	return t.confirm(table, off)
}

package fs

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/pagecache"
	"github.com/engramfs/engramfs/internal/testenv"
)

// Invalidate drops a page from the page cache, mapped or not: after a
// Store of other bytes, read(2) and a mapping see them; after Invalidate
// the page is not resident and a read sees the backing's bytes again (the
// pinner's recharge relies on it). Before Serve and after Close it is
// ErrNotServing; a table that does not exist is an error.
func TestInvalidateDropsPagesFromEveryMapping(t *testing.T) {
	srv, m, _, _ := newTestServer(t)
	tb := m.Tables[0]
	off := int64(tb.DataPage()+1) * cache.PageSize
	if err := srv.Invalidate(tb.ID, off, cache.PageSize); !errors.Is(err, ErrNotServing) {
		t.Fatalf("Invalidate before Serve: %v, want ErrNotServing", err)
	}
	testenv.RequireFUSE(t)
	mp := t.TempDir()
	if err := srv.Serve(mp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Unmount() })
	if err := srv.Invalidate(uint32(len(m.Tables)), 0, cache.PageSize); err == nil {
		t.Error("Invalidate of a table that does not exist succeeded")
	}

	f, err := os.Open(filepath.Join(mp, tb.Path()))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	read := func() []byte {
		b := make([]byte, cache.PageSize)
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		return b
	}
	want := read()
	mapped, err := unix.Mmap(int(f.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mapped)
	page := mapped[off : off+cache.PageSize]
	if !bytes.Equal(page, want) {
		t.Fatal("the mapping and read(2) disagree")
	}
	other := bytes.Repeat([]byte{0xA5}, cache.PageSize)
	if err := srv.Store(tb.ID, off, other); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(read(), other) || !bytes.Equal(page, other) {
		t.Fatal("a Store over a cached page is not what read(2) and the mapping see")
	}
	if err := srv.Invalidate(tb.ID, off, cache.PageSize); err != nil {
		t.Fatal(err)
	}
	// The page is gone, mapped or not. (Not touched through the mapping:
	// a fault on this process's own mount cannot be stopped for the
	// garbage collector, and its handler needs the world running.)
	if n, err := pagecache.Count(page); err != nil || n != 0 {
		t.Errorf("after Invalidate: %d pages resident (%v), want none", n, err)
	}
	if !bytes.Equal(read(), want) {
		t.Error("after Invalidate, read(2) still sees the stored bytes")
	}
	srv.Close()
	if err := srv.Invalidate(tb.ID, off, cache.PageSize); !errors.Is(err, ErrNotServing) {
		t.Fatalf("Invalidate after Close: %v, want ErrNotServing", err)
	}
}

package fs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
	"github.com/engramfs/engramfs/prefetch"
)

// newTestServer builds (does not mount) a server of its own over the model,
// store and loader of a small test tree (helpers_test.go).
func newTestServer(t *testing.T) (*Server, *backing.Model, *cache.Loader, *stats.Counters) {
	t.Helper()
	tr := newTree(t, treeConfig{rows: 64})
	srv, err := New(Options{Model: tr.model, Loader: tr.loader, Stats: tr.st})
	if err != nil {
		t.Fatal(err)
	}
	return srv, tr.model, tr.loader, tr.st
}

// Before Serve there is no page cache to push into: a push is a clear
// error, never a panic, and a prefetch that runs into it settles as failed.
func TestPushBeforeServeIsErrNotServing(t *testing.T) {
	srv, m, loader, st := newTestServer(t)
	tb := m.Tables[0]
	off := int64(tb.DataPage()) * cache.PageSize
	if err := srv.Store(tb.ID, off, make([]byte, cache.PageSize)); !errors.Is(err, ErrNotServing) {
		t.Fatalf("Store before Serve: %v, want ErrNotServing", err)
	}
	if err := srv.Confirm(tb.ID, off); !errors.Is(err, ErrNotServing) {
		t.Fatalf("Confirm before Serve: %v, want ErrNotServing", err)
	}

	pf := prefetch.New(prefetch.DefaultConfig(4), m, loader, srv, nil, st, nil)
	defer pf.Close()
	srv.Connect(pf, pf)
	b := prefetch.NewBarrier()
	pf.Submit(hints.Decode, 0, []uint64{1, 2, 3}, b)
	s, err := b.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if s.Pages == 0 || s.Failed != s.Pages || s.Resident != 0 {
		t.Fatalf("barrier %+v: want every page failed", s)
	}

	// Nothing to wait for or to unmount yet.
	srv.Wait()
	if err := srv.Unmount(); err != nil {
		t.Fatalf("Unmount before Serve: %v", err)
	}
	if mp, path := srv.Mountpoint(), srv.TablePath(0); mp != "" || path != "" {
		t.Fatalf("before Serve: mountpoint %q, table path %q", mp, path)
	}
}

// The two phases against a real mount: Serve returns with every table file
// known to the kernel, so a push into a file no reader has opened lands
// (NOTIFY_STORE answers ENOENT for an inode never looked up); faults reach
// the connected sink; Close stops pushes; Unmount leaves no mount.
func TestServeLifecycle(t *testing.T) {
	testenv.RequireFUSE(t)
	srv, m, _, _ := newTestServer(t)
	faults := &faultLog{}
	srv.Connect(nil, faults)
	mp := t.TempDir()
	var before unix.Stat_t
	if err := unix.Stat(mp, &before); err != nil {
		t.Fatal(err)
	}
	if err := srv.Serve(mp); err != nil {
		t.Fatal(err)
	}
	unmounted := false
	t.Cleanup(func() {
		if !unmounted {
			_ = srv.Unmount()
		}
	})
	if err := srv.Serve(mp); err == nil {
		t.Fatal("a second Serve succeeded")
	}

	// The last table: nobody but Serve has opened it.
	tb := m.Tables[len(m.Tables)-1]
	first := tb.DataPage()
	data := make([]byte, cache.PageSize)
	if err := srv.Store(tb.ID, int64(first)*cache.PageSize, data); err != nil {
		t.Fatalf("Store on a fresh mount, file never opened by a reader: %v", err)
	}
	if err := srv.Confirm(tb.ID, int64(first)*cache.PageSize); err != nil {
		t.Fatalf("Confirm: %v", err)
	}

	// A read of another page through the mount reaches the fault sink.
	other := m.Tables[0]
	f, err := os.Open(filepath.Join(mp, other.Path()))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, cache.PageSize)
	want := cache.PageKey{Table: other.ID, Page: other.DataPage() + 1}
	_, err = f.ReadAt(buf, int64(want.Page)*cache.PageSize)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	heard := faults.take()
	found := false
	for _, k := range heard {
		found = found || k == want
	}
	if !found {
		t.Fatalf("fault sink heard %v, want %v among them", heard, want)
	}

	srv.Close()
	if err := srv.Store(tb.ID, int64(first)*cache.PageSize, data); !errors.Is(err, ErrNotServing) {
		t.Fatalf("Store after Close: %v, want ErrNotServing", err)
	}
	if err := srv.Unmount(); err != nil {
		t.Fatalf("Unmount: %v", err)
	}
	unmounted = true
	srv.Wait()
	var after unix.Stat_t
	if err := unix.Stat(mp, &after); err != nil {
		t.Fatal(err)
	}
	if after.Dev != before.Dev {
		t.Fatalf("after Unmount the mountpoint is still on device %d (was %d)", after.Dev, before.Dev)
	}
}

package fs

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/testenv"
)

// A mount stacked on the server's own is not a detach, and Unmount leaves
// both alone then; a lazy detach from outside is one. Before, the watcher
// compared the path's device (a cover changes it) and a stop unmounted the
// path's top mount: the cover.
func TestDetachedTellsCoveredFromGone(t *testing.T) {
	testenv.RequireFUSE(t)
	srv, _, _, _ := newTestServer(t)
	core, logs := observer.New(zap.InfoLevel)
	srv.log = zap.New(core)
	mp := t.TempDir()
	if err := srv.Serve(mp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mp, unix.MNT_DETACH); _ = srv.Unmount() })
	own := srv.own
	detached := srv.Detached()
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-detached:
		t.Fatal("a mount stacked on ours was taken for a detach")
	case <-time.After(3 * watchInterval):
	}
	if logs.FilterMessageSnippet("covered").Len() == 0 {
		t.Error("the cover was not logged")
	}
	// A stop while covered unmounts nothing: not the tmpfs on top, not ours.
	if err := srv.Unmount(); err != nil {
		t.Fatalf("Unmount while covered: %v", err)
	}
	ms, err := procfs.Mounts()
	if err != nil {
		t.Fatal(err)
	}
	if top, ok := procfs.Top(ms, own.path); !ok || top.FSType != "tmpfs" {
		t.Fatalf("the cover is gone after Unmount: top %+v", top)
	}
	if _, ok := procfs.ByID(ms, own.id); !ok {
		t.Fatal("our covered mount was unmounted")
	}
	// Uncovered and detached from outside: a detach.
	if err := unix.Unmount(mp, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	select {
	case <-detached:
	case <-time.After(20 * watchInterval):
		t.Fatal("a lazy detach from outside was not seen")
	}
}

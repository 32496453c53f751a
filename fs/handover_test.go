package fs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/testenv"
)

// A second server of the same model takes a live mount over: a reader that
// keeps reading sees no error, a mapping made before the handover faults
// its cold pages in with the right bytes from the successor (same node
// IDs), handles opened before it (stats, control) keep working (same
// handle numbers), and the successor unmounts as a daemon that mounted.
func TestHandoverKeepsTheSession(t *testing.T) {
	testenv.RequireFUSE(t)
	old, m, loader, st := newTestServer(t)
	old.Connect(nil, nil)
	mp := t.TempDir()
	var before unix.Stat_t
	if err := unix.Stat(mp, &before); err != nil {
		t.Fatal(err)
	}
	if err := old.Serve(mp); err != nil {
		t.Fatal(err)
	}
	succ, err := New(Options{Model: m, Loader: loader, Stats: st, Log: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))})
	if err != nil {
		t.Fatal(err)
	}
	succ.Connect(nil, nil)
	serving := old
	t.Cleanup(func() { _ = serving.Unmount() })

	// Before: a mapping of the last table, none of its data pages touched;
	// a stats handle and a control handle open.
	tb := m.Tables[len(m.Tables)-1]
	tf, err := os.Open(filepath.Join(mp, tb.Path()))
	if err != nil {
		t.Fatal(err)
	}
	defer tf.Close()
	mapped, err := unix.Mmap(int(tf.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mapped)
	statsF, err := os.Open(filepath.Join(mp, ControlDir, StatsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer statsF.Close()
	ctl, err := os.OpenFile(filepath.Join(mp, ControlDir, ControlFile), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	frame := hints.AppendBinary(nil, hints.Decode, m.Layers[0], []uint64{1, 2})
	if _, err := ctl.Write(frame); err != nil {
		t.Fatalf("control write before the handover: %v", err)
	}

	// A reader that never stops: every round opens and reads the stats
	// file (direct I/O: every read reaches a daemon) and the manifest.
	var (
		stop   atomic.Bool
		rounds atomic.Int64
		errs   []error
		mu     sync.Mutex
		wg     sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			for _, p := range []string{filepath.Join(mp, ControlDir, StatsFile), filepath.Join(mp, ManifestFile)} {
				if _, err := os.ReadFile(p); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
			rounds.Add(1)
		}
	}()
	for rounds.Load() < 20 {
		time.Sleep(time.Millisecond)
	}

	var handles []Handle
	handover := func() (*os.File, Session, error) {
		dev, sess, err := old.Handover(2 * time.Second)
		if err != nil {
			return nil, sess, err
		}
		handles = sess.Handles
		// What a successor process receives: a descriptor of its own.
		fd, err := unix.Dup(int(dev.Fd()))
		return os.NewFile(uintptr(fd), "/dev/fuse"), sess, err
	}
	if err := succ.TakeOver(mp, handover, false); err != nil {
		t.Fatal(err)
	}
	if len(handles) < 2 {
		t.Fatalf("session lists %v: want at least the stats and control handles", handles)
	}
	serving = succ
	if !old.Finish(5 * time.Second) {
		t.Fatal("the old server still has requests in flight 5 s after the handover")
	}
	old.Release()
	after := rounds.Load()
	deadline := time.Now().Add(30 * time.Second)
	for rounds.Load() < after+20 {
		if time.Now().After(deadline) {
			t.Fatalf("the reader made %d rounds in 30 s after the takeover", rounds.Load()-after)
		}
		time.Sleep(time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("the reader saw %d errors across the handover, first: %v", len(errs), errs[0])
	}

	// The mapping's cold pages come from the successor, right bytes. They
	// are touched from inside a system call (pwrite from the mapping): a
	// goroutine faulting on its own process's FUSE mapping holds its P, and
	// a garbage collection waiting for it stops the daemon that would serve
	// the fault (seen under -race).
	scratch, err := os.CreateTemp(t.TempDir(), "page")
	if err != nil {
		t.Fatal(err)
	}
	defer scratch.Close()
	got := make([]byte, cache.PageSize)
	for p := tb.DataPage(); p < tb.Pages(); p++ {
		off := int64(p) * cache.PageSize
		pages, err := loader.Load(tb.ID, p, 1, cache.OriginFault)
		if err != nil {
			t.Fatal(err)
		}
		want := pages[0]
		if _, err := scratch.WriteAt(mapped[off:off+int64(len(want))], 0); err != nil {
			t.Fatalf("page %d through the old mapping: %v", p, err)
		}
		if _, err := scratch.ReadAt(got[:len(want)], 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[:len(want)], want) {
			t.Fatalf("page %d of %s through the old mapping: wrong bytes after the handover", p, tb.Name)
		}
	}
	// The handles opened before the handover still work.
	if _, err := statsF.Read(make([]byte, 1<<16)); err != nil {
		t.Fatalf("stats handle opened before the handover: %v", err)
	}
	if _, err := ctl.Write(frame); err != nil {
		t.Fatalf("control handle opened before the handover: %v", err)
	}
	// A handle the successor never heard of is EBADF, not a panic (EIO).
	succ.rawFS.mu.Lock()
	for fh := range succ.rawFS.handles {
		delete(succ.rawFS.handles, fh)
	}
	succ.rawFS.mu.Unlock()
	if _, err := ctl.Write(frame); !errors.Is(err, unix.EBADF) {
		t.Fatalf("control write on a handle the daemon does not know: %v, want EBADF", err)
	}

	if err := succ.Unmount(); err != nil {
		t.Fatalf("the successor's unmount: %v", err)
	}
	serving = old // released: its Unmount does nothing
	var gone unix.Stat_t
	if err := unix.Stat(mp, &gone); err != nil {
		t.Fatal(err)
	}
	if gone.Dev != before.Dev {
		t.Fatalf("after the successor's Unmount the mountpoint is still on device %d", gone.Dev)
	}
}

// A handover whose successor never takes the mount (it died, or refused)
// leaves it with the server, which serves it again: the same handles, and
// a reader blocked meanwhile only waits.
func TestResumeAfterAFailedHandover(t *testing.T) {
	testenv.RequireFUSE(t)
	srv, _, _, _ := newTestServer(t)
	srv.Connect(nil, nil)
	mp := t.TempDir()
	if err := srv.Serve(mp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Unmount() })
	var st unix.Stat_t
	if err := unix.Stat(mp, &st); err != nil {
		t.Fatal(err)
	}
	// If nobody serves the mount again, every call on it would block: the
	// test's own closes included. Aborting the connection fails them.
	abort := func() {
		p := fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", unix.Minor(st.Dev))
		if err := os.WriteFile(p, []byte("1"), 0); err != nil {
			t.Errorf("aborting the unserved connection: %v", err)
		}
	}
	statsF, err := os.Open(filepath.Join(mp, ControlDir, StatsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer statsF.Close()
	if _, _, err := srv.Handover(time.Second); err != nil {
		t.Fatal(err)
	}
	// Nobody reads the connection now: this read waits for the resume.
	read := make(chan error, 1)
	go func() { _, err := os.ReadFile(filepath.Join(mp, ManifestFile)); read <- err }()
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		if err != nil {
			t.Fatalf("a read across the failed handover: %v", err)
		}
	case <-time.After(30 * time.Second):
		abort()
		t.Fatal("a read across the failed handover was not answered within 30 s of the resume")
	}
	if _, err := statsF.Read(make([]byte, 1<<16)); err != nil {
		t.Fatalf("a handle opened before the failed handover: %v", err)
	}
	if err := srv.Unmount(); err != nil {
		t.Fatalf("unmount after the resume: %v", err)
	}
}

package tests

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/hints"
)

// A decode frame far larger than --decode-queue is not queued whole: the
// kernel hands it over in writes of at most max_write (256 KiB, 32K rows),
// the first is taken and every later one waits until the handle's backlog
// is under the bound again. A signal ends the wait: the write(2) returns
// what was taken (a short write) and nothing more is queued. One 1M-row
// frame queued 1,048,448 pages at once when only a frame's start was
// checked.
func TestDecodeFrameOverTheQueueWaitsForRoom(t *testing.T) {
	spec := geometries()["flash"]
	spec.Rows = 200_000 // 12,500 weight pages and 391 scale pages a layer
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=1s", "--queue-depth", "1", "--decode-queue", "256")
	ctl := openControl(t, d)
	rows := make([]uint64, spec.Rows)
	for i := range rows {
		rows[i] = uint64(i)
	}
	frame := hints.AppendBinary(nil, hints.Decode, 0, rows) // 1.6 MB: 7 writes of the kernel's
	type result struct {
		n   int
		err error
	}
	tids, done := make(chan int, 1), make(chan result, 1)
	go func() {
		runtime.LockOSThread() // the thread stays ours: the signal goes to it
		tids <- syscall.Gettid()
		n, err := syscall.Write(int(ctl.Fd()), frame)
		done <- result{n, err}
	}()
	tid := <-tids
	deadline := time.Now().Add(30 * time.Second)
	for d.Stats(t).PrefetchPagesQueued == 0 {
		if time.Now().After(deadline) {
			t.Fatal("nothing of the frame queued within 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var r result
wait:
	for {
		select {
		case r = <-done:
			break wait
		case <-time.After(50 * time.Millisecond):
			if time.Now().After(deadline) {
				t.Fatal("the write waiting for room was not interrupted by a signal within 30 s")
			}
			// Any signal interrupts a FUSE request; SIGURG is one the Go
			// runtime ignores.
			if err := syscall.Tgkill(os.Getpid(), tid, syscall.SIGURG); err != nil {
				t.Fatal(err)
			}
		}
	}
	queued := d.Stats(t).PrefetchPagesQueued
	t.Logf("write: %d of %d bytes, %v; %d pages queued", r.n, len(frame), r.err, queued)
	if r.err == nil && r.n == len(frame) {
		t.Fatalf("the whole %d-row decode frame was taken at once (%d pages queued) past a 256-page bound", len(rows), queued)
	}
	if r.err != nil && !errors.Is(r.err, syscall.EINTR) {
		t.Fatalf("write: %v, want a short write or EINTR", r.err)
	}
	// The first write (32K rows: 2,048 weight and 64 scale pages) and the
	// pages answered meanwhile (16 a second at most here).
	if limit := uint64(256 + 2*2112); queued > limit {
		t.Fatalf("%d pages queued, want at most %d (the bound and a write)", queued, limit)
	}
}

// Open control handles are bounded by --control-handles: past it an open
// fails with ENFILE, counted, and closing one frees its slot.
func TestControlHandlesAreBounded(t *testing.T) {
	d := Mount(t, Synth(t, geometries()["4096B"]), "--control-handles", "2")
	path := filepath.Join(d.Mountpoint, ".engramfs", "control")
	a := openControl(t, d)
	openControl(t, d)
	if f, err := os.OpenFile(path, os.O_WRONLY, 0); !errors.Is(err, syscall.ENFILE) {
		if err == nil {
			f.Close()
		}
		t.Fatalf("third open with --control-handles 2: %v, want ENFILE", err)
	}
	if s := d.Stats(t); s.ControlHandles != 2 || s.ControlHandlesRefused != 1 {
		t.Fatalf("control_handles %d, control_handles_refused %d; want 2 and 1", s.ControlHandles, s.ControlHandlesRefused)
	}
	a.Close()
	deadline := time.Now().Add(30 * time.Second)
	for { // the kernel sends RELEASE after close(2) returns
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err == nil {
			f.Close()
			break
		}
		if !errors.Is(err, syscall.ENFILE) || time.Now().After(deadline) {
			t.Fatalf("open after closing a handle: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The prefill a hinter queued is dropped when its handle closes (its
// process exited or was killed): not fetched for nobody, counted in
// prefetch_pages_released.
func TestClosedHandlesPrefillIsDropped(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=1s", "--queue-depth", "1")
	ctl := openControl(t, d)
	rows := make([]uint64, spec.Rows)
	for i := range rows {
		rows[i] = uint64(i)
	}
	if _, err := syscall.Write(int(ctl.Fd()), hints.AppendBinary(nil, hints.Prefill, 0, rows)); err != nil {
		t.Fatal(err)
	}
	queued := d.Stats(t).PrefetchPagesQueued
	ctl.Close()
	var s = d.Stats(t)
	deadline := time.Now().Add(30 * time.Second)
	for s.PrefetchPagesReleased == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("nothing released within 30 s of closing the handle (%d pages queued)", queued)
		}
		time.Sleep(10 * time.Millisecond)
		s = d.Stats(t)
	}
	// The in-flight budget (2 × queue depth, 16 at least) was being
	// read; the rest was dropped.
	if s.PrefetchPagesReleased+64 < queued {
		t.Fatalf("%d of %d queued pages released; want all but those in flight", s.PrefetchPagesReleased, queued)
	}
}

// A stop while only a control handle is open detaches the mount lazily and
// says so without blaming a reader's mapping: "a reader still maps a file"
// was logged when nothing but the control file was open.
func TestBusyUnmountNamesTheControlHandles(t *testing.T) {
	d := Mount(t, Synth(t, geometries()["4096B"]))
	openControl(t, d)
	d.Stop(t)
	log := d.Log()
	if strings.Contains(log, "a reader still maps a file") {
		t.Fatalf("the lazy detach blamed a reader's mapping with only a control handle open:\n%s", log)
	}
	if !strings.Contains(log, "detached it lazily") || !strings.Contains(log, "control_handles_open") {
		t.Fatalf("no lazy detach naming the open control handles logged:\n%s", log)
	}
}

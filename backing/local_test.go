package backing

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// OpenRegular never waits on a special file, says what it is, and hands
// back a regular file in blocking mode (io_uring answers a read of an
// O_NONBLOCK file that must wait for the disk with EAGAIN).
func TestOpenRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for path, kind := range map[string]string{fifo: "a FIFO", dir: "a directory", "/dev/null": "a character device"} {
		done := make(chan error, 1)
		go func() {
			f, err := OpenRegular(path, 0)
			if f != nil {
				f.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), kind+", not a regular file") || !strings.Contains(err.Error(), path) {
				t.Errorf("OpenRegular(%s): %v; want it named as %s, not a regular file", path, err, kind)
			}
		case <-time.After(time.Minute):
			// Let the open go, with a writer.
			if w, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
				w.Close()
			}
			t.Fatalf("OpenRegular(%s) blocked for a minute", path)
		}
	}
	reg := filepath.Join(dir, "shard")
	if err := os.WriteFile(reg, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := OpenRegular(reg, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK != 0 {
		t.Errorf("a regular file opened with flags %#x (%v): O_NONBLOCK left set", fl, err)
	}
	if _, err := OpenRegular(filepath.Join(dir, "missing"), 0); !os.IsNotExist(err) {
		t.Errorf("a missing file: %v, want an error matching fs.ErrNotExist", err)
	}
}

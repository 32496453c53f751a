package client

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/engramfs/engramfs/hints"
)

// fakeMount makes a directory whose .engramfs/control is a regular file, so
// the bytes a client writes can be read back.
func fakeMount(t *testing.T) (mount, control string) {
	t.Helper()
	mount = t.TempDir()
	control = filepath.Join(mount, ".engramfs", "control")
	if err := os.Mkdir(filepath.Dir(control), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(control, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return mount, control
}

type everyLayer struct{}

func (everyLayer) LayerRows(int) (uint64, bool) { return math.MaxUint64, true }

// decodeFile decodes what the client wrote, as the filesystem would.
func decodeFile(t *testing.T, control string) []hints.Frame {
	t.Helper()
	data, err := os.ReadFile(control)
	if err != nil {
		t.Fatal(err)
	}
	frames, err := hints.NewDecoder(everyLayer{}).Write(data)
	if err != nil {
		t.Fatalf("decoding %d bytes written: %v", len(data), err)
	}
	return frames
}

func TestFramesDecodeBack(t *testing.T) {
	mount, control := fakeMount(t)
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		send func(int, []uint64) error
		hints.Frame
	}{
		{h.Prefill, hints.Frame{Class: hints.Prefill, Layer: 3, Rows: []uint64{0, 1, 1 << 40, math.MaxUint64 - 1}}},
		{h.Decode, hints.Frame{Class: hints.Decode, Layer: hints.MaxLayer, Rows: []uint64{7}}},
		{h.Decode, hints.Frame{Class: hints.Decode, Layer: 0}}, // no rows: nothing is written
	}
	var want []hints.Frame
	for _, s := range steps {
		if err := s.send(s.Layer, s.Rows); err != nil {
			t.Fatal(err)
		}
		if len(s.Rows) > 0 {
			want = append(want, s.Frame)
		}
	}
	if err := h.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if got := decodeFile(t, control); !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %v, want %v", got, want)
	}
}

func TestSplitsAtMaxRowsPerFrame(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 32 MiB")
	}
	mount, control := fakeMount(t)
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	rows := make([]uint64, hints.MaxRowsPerFrame+2)
	rows[len(rows)-1] = 42
	if err := h.Prefill(1, rows); err != nil {
		t.Fatal(err)
	}
	got := decodeFile(t, control)
	if len(got) != 2 || len(got[0].Rows) != hints.MaxRowsPerFrame || !reflect.DeepEqual(got[1].Rows, []uint64{0, 42}) {
		t.Fatalf("got %d frames, want one of %d rows and one of rows [0 42]", len(got), hints.MaxRowsPerFrame)
	}
	if h.buf != nil {
		t.Fatalf("kept a %d-byte frame buffer", cap(h.buf))
	}
}

func TestErrors(t *testing.T) {
	if _, err := Open(t.TempDir()); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "control") {
		t.Errorf("Open without a control file: %v", err)
	}

	mount, control := fakeMount(t)
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	for _, layer := range []int{-1, hints.MaxLayer + 1} {
		if err := h.Decode(layer, []uint64{1}); err == nil || !strings.Contains(err.Error(), "layer out of range") {
			t.Errorf("Decode(%d): %v", layer, err)
		}
	}
	if fi, _ := os.Stat(control); fi.Size() != 0 {
		t.Errorf("rejected hints wrote %d bytes", fi.Size())
	}
	h.Close()
	if err := h.Prefill(3, []uint64{1}); !errors.Is(err, os.ErrClosed) || !strings.HasPrefix(err.Error(), "hint prefill layer 3: write ") {
		t.Errorf("Prefill after Close: %v", err)
	}
}

// A write error is the syscall's, with the class and layer in front.
func TestWriteErrorContext(t *testing.T) {
	if _, err := os.Stat("/dev/full"); err != nil {
		t.Skip("needs /dev/full")
	}
	mount, control := fakeMount(t)
	os.Remove(control)
	if err := os.Symlink("/dev/full", control); err != nil {
		t.Fatal(err)
	}
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	err = h.Decode(3, []uint64{1})
	want := "hint decode layer 3: write " + control + ": no space left on device"
	if !errors.Is(err, syscall.ENOSPC) || err.Error() != want {
		t.Fatalf("Decode to a full device: %v, want %q", err, want)
	}
}

func python(t *testing.T) string {
	t.Helper()
	// Debian's python3 has numpy, so prefer it over one earlier in PATH.
	if _, err := os.Stat("/usr/bin/python3"); err == nil {
		return "/usr/bin/python3"
	}
	p, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found: skipping the Python client's tests")
	}
	return p
}

func pythonCmd(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(python(t), append([]string{"-B"}, args...)...)
	cmd.Dir = filepath.Join("..", "python")
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

func TestPythonUnittest(t *testing.T) {
	out, err := pythonCmd(t, "-m", "unittest", "-v", "test_engramfs_hints").CombinedOutput()
	if err != nil {
		t.Fatalf("python unittest: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

// The Python client's frames decode in Go to what it was asked to send.
func TestPythonFramesDecodeInGo(t *testing.T) {
	mount, control := fakeMount(t)
	script := `
import sys
import engramfs_hints as eh
try:
    import numpy
except ImportError:
    numpy = None
with eh.Hinter(sys.argv[1]) as h:
    h.prefill(3, [0, 1, 2**40, 2**64 - 2])
    h.decode(0, range(5))
    h.decode(65535, numpy.arange(3, dtype=numpy.uint32) if numpy is not None else [0, 1, 2])
    h.wait()
`
	if out, err := pythonCmd(t, "-c", script, mount).CombinedOutput(); err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	want := []hints.Frame{
		{Class: hints.Prefill, Layer: 3, Rows: []uint64{0, 1, 1 << 40, math.MaxUint64 - 1}},
		{Class: hints.Decode, Layer: 0, Rows: []uint64{0, 1, 2, 3, 4}},
		{Class: hints.Decode, Layer: 65535, Rows: []uint64{0, 1, 2}},
	}
	if got := decodeFile(t, control); !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %v, want %v", got, want)
	}
}

// A status line read back from the handle is the barrier's answer; a failed
// page is an error that still carries the counts.
func TestBarrierParsesTheStatusLine(t *testing.T) {
	mount, control := fakeMount(t)
	if err := os.WriteFile(control, []byte(`{"frames":2,"pages":9,"resident":7,"pinned":1,"dropped":0,"failed":1}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	st, err := h.Barrier()
	if !errors.Is(err, ErrFailed) || st.Pages != 9 || st.Resident != 7 || st.Failed != 1 {
		t.Fatalf("Barrier: %+v, %v", st, err)
	}
	// Nothing more to read: nothing pending.
	if st, err := h.Barrier(); err != nil || st != (hints.Status{}) {
		t.Fatalf("idle Barrier: %+v, %v", st, err)
	}
}

// The status line's reason reaches the caller: a rejected frame's as
// ErrRejected, failed pages' with ErrFailed.
func TestBarrierSaysWhy(t *testing.T) {
	for _, c := range []struct {
		line, want string
		is         error
	}{
		{`{"frames":0,"pages":0,"resident":0,"pinned":0,"dropped":0,"failed":0,"error":"hint frame: row 99999 out of range (layer 0 has 16384 rows)"}`,
			"hint barrier: rejected by the mount: hint frame: row 99999 out of range (layer 0 has 16384 rows)", ErrRejected},
		{`{"frames":1,"pages":2,"resident":0,"pinned":0,"dropped":0,"failed":2,"error":"pages failed: table t: read: input/output error"}`,
			"hint barrier: 2 of 2 pages (pages failed: table t: read: input/output error): hinted pages failed", ErrFailed},
	} {
		mount, control := fakeMount(t)
		if err := os.WriteFile(control, []byte(c.line+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		h, err := Open(mount)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := h.Barrier(); !errors.Is(err, c.is) || err.Error() != c.want {
			t.Errorf("Barrier: %v, want %q", err, c.want)
		}
		h.Close()
	}
}

// The Python client installs as the README says, `pip install
// ./hints/python`, with no package index (--no-index: build isolation has
// nothing to fetch, the backend is the standard library's) into a fresh
// venv (Debian's python3-venv), imports from there, not from the source
// tree, and leaves the checkout as it was (setuptools left build/ and
// *.egg-info in it).
func TestPythonClientPipInstalls(t *testing.T) {
	const python = "/usr/bin/python3"
	if err := exec.Command(python, "-c", "import venv, ensurepip").Run(); err != nil {
		if os.Getenv("ENGRAMFS_REQUIRE_FUSE") == "1" {
			t.Fatalf("%s needs venv and ensurepip (Debian: python3-venv): %v", python, err)
		}
		t.Skipf("%s needs venv and ensurepip: %v", python, err)
	}
	venv := filepath.Join(t.TempDir(), "venv")
	if out, err := exec.Command(python, "-m", "venv", venv).CombinedOutput(); err != nil {
		t.Fatalf("venv: %v\n%s", err, out)
	}
	src, err := filepath.Abs(filepath.Join("..", "python"))
	if err != nil {
		t.Fatal(err)
	}
	before := treeOf(t, src)
	pip := exec.Command(filepath.Join(venv, "bin", "pip"), "install", "--no-index", "--disable-pip-version-check", "./hints/python")
	pip.Dir = filepath.Join(src, "..", "..")
	pip.Env = append(os.Environ(), "PIP_NO_CACHE_DIR=1")
	if out, err := pip.CombinedOutput(); err != nil {
		t.Fatalf("pip install: %v\n%s", err, out)
	}
	if after := treeOf(t, src); !reflect.DeepEqual(after, before) {
		t.Errorf("pip install changed the checkout's hints/python:\nbefore %v\nafter  %v", before, after)
	}
	check := exec.Command(filepath.Join(venv, "bin", "python"), "-c",
		"import engramfs_hints, sys; assert '/site-packages/' in engramfs_hints.__file__, engramfs_hints.__file__; print(engramfs_hints.__file__)")
	check.Dir = t.TempDir()
	out, err := check.CombinedOutput()
	if err != nil {
		t.Fatalf("import from the venv: %v\n%s", err, out)
	}
	t.Logf("installed: %s", out)
}

// treeOf lists the files under dir with their sizes and modes, byte code
// caches aside (ignored by git, and written by any import).
func treeOf(t *testing.T, dir string) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == "__pycache__" {
			return filepath.SkipDir
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		files[strings.TrimPrefix(path, dir)] = fmt.Sprintf("%v %d", fi.Mode(), fi.Size())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// Another module uses the client as its package doc says: a require and a
// replace pointing at a checkout, no package index (the client imports the
// standard library and package hints alone, so nothing is downloaded).
func TestUsableFromAnotherModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	main := `package main

import (
	"fmt"
	"os"

	"github.com/engramfs/engramfs/hints/client"
)

func main() {
	_, err := client.Open(os.Args[1])
	fmt.Println(err)
}
`
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(goBin, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=mod", "GOWORK=off")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("mod", "init", "example.com/ranks")
	run("mod", "edit", "-require=github.com/engramfs/engramfs@v0.0.0", "-replace=github.com/engramfs/engramfs="+root)
	run("mod", "tidy")
	if out := run("run", ".", dir); !strings.Contains(out, "hint open: open "+dir+"/.engramfs/control: no such file or directory") {
		t.Fatalf("the program printed %q", out)
	}
}

// A handle the daemon no longer knows (EBADF: a successor without it, after
// a crash) is reopened once: the frame goes out on the new handle, and a
// barrier on the stale one returns with nothing to wait for.
func TestReopensAStaleHandle(t *testing.T) {
	mount, control := fakeMount(t)
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	stale := func(flag int) {
		t.Helper()
		// A write on a read-only descriptor, or a read on a write-only one,
		// fails with EBADF as a handle the daemon does not know does.
		f, err := os.OpenFile(control, flag, 0)
		if err != nil {
			t.Fatal(err)
		}
		h.f.Swap(f).Close()
	}
	stale(os.O_RDONLY)
	if err := h.Decode(3, []uint64{7, 8}); err != nil {
		t.Fatalf("Decode on a stale handle: %v, want it sent on a new one", err)
	}
	if got := decodeFile(t, control); len(got) != 1 || !reflect.DeepEqual(got[0].Rows, []uint64{7, 8}) {
		t.Fatalf("control file holds %+v, want the one frame", got)
	}
	stale(os.O_WRONLY)
	if err := h.Wait(); err != nil {
		t.Fatalf("barrier on a stale handle: %v, want nothing to wait for", err)
	}
	// The reopened handle reads and writes.
	if err := h.Prefill(1, []uint64{1}); err != nil {
		t.Fatal(err)
	}
}

// TestStepFallsBackToWrites: a control file without the step's ioctl
// (here a regular file: ENOTTY) gets the step's frames as writes.
func TestStepFallsBackToWrites(t *testing.T) {
	mount, control := fakeMount(t)
	h, err := Open(mount)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	want := []hints.Frame{
		{Class: hints.Decode, Layer: 0, Rows: []uint64{1, 2}},
		{Class: hints.Decode, Layer: 7, Rows: []uint64{1 << 40}},
	}
	for range 2 { // the second after the client learned there is no step
		if _, err := h.Step([]int{0, 7}, [][]uint64{want[0].Rows, want[1].Rows}); err != nil {
			t.Fatal(err)
		}
	}
	if got := decodeFile(t, control); !reflect.DeepEqual(got, append(want, want...)) {
		t.Fatalf("decoded %v, want %v twice", got, want)
	}
	if _, err := h.Step([]int{0}, nil); err == nil {
		t.Error("a step of 1 layer and 0 row lists was sent")
	}
	if _, err := h.Step([]int{hints.MaxLayer + 1}, [][]uint64{{1}}); err == nil {
		t.Error("a step of a layer out of range was sent")
	}
}

package tests

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/testenv"
)

// modelDirWithExtras is a synthetic model directory with what real ones
// hold beside the shards (a nested directory, a symlink into a blob store
// inside it), and what the mount must not serve: a symlink out of it, a
// FIFO, and files at the mount's own names.
func modelDirWithExtras(t *testing.T) (dir string, served, absent []string) {
	t.Helper()
	spec := backing.DefaultSynth()
	spec.Rows = 1500
	dir = Synth(t, spec)
	write := func(name, data string) {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("original/tokenizer.model", strings.Repeat("sentencepiece ", 5000))
	write("blobs/9f86d08", `{"bos_token": "<s>"}`)
	outside := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(outside, []byte("outside the model"), 0o600); err != nil {
		t.Fatal(err)
	}
	for target, link := range map[string]string{"blobs/9f86d08": "special_tokens_map.json", outside: "leak.json"} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mkfifo(filepath.Join(dir, "pipe"), 0o644); err != nil {
		t.Fatal(err)
	}
	write("manifest.json", `{"the model's": "own"}`)
	write(".engramfs/notes", "hidden by the control directory")
	served = append([]string{"original/tokenizer.model", "blobs/9f86d08", "special_tokens_map.json",
		"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}, backing.SynthConfigFiles...)
	return dir, served, []string{"leak.json", "pipe", ".engramfs/notes"}
}

// The mount is the model directory: every file at its path with the same
// bytes (read(2) and mmap), nothing from outside it, the mount's own
// entries where a name is taken twice.
func TestMountIsTheModelDirectory(t *testing.T) {
	dir, served, absent := modelDirWithExtras(t)
	d := Mount(t, dir)
	for _, name := range served {
		want, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(d.Mountpoint, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: %d bytes (%v), want the model directory's %d", name, len(got), err, len(want))
		}
		if len(want) > 0 && !bytes.Equal(testenv.MapFile(t, filepath.Join(d.Mountpoint, name)), want) {
			t.Errorf("%s: mapped bytes differ", name)
		}
	}
	for _, name := range absent {
		if _, err := os.Lstat(filepath.Join(d.Mountpoint, name)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: %v, want it absent from the mount", name, err)
		}
		if !strings.Contains(d.Log(), name) {
			t.Errorf("%s: the daemon's log does not say why it is not served", name)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(d.Mountpoint, "manifest.json")); !bytes.Contains(b, []byte(`"layers"`)) {
		t.Errorf("manifest.json is not the mount's:\n%s", b)
	}
	if _, err := os.OpenFile(filepath.Join(d.Mountpoint, "config.json"), os.O_WRONLY, 0); !errors.Is(err, syscall.EROFS) {
		t.Errorf("open config.json for writing: %v, want EROFS", err)
	}
	// Passthrough where the kernel allows it (6.9+, root): the daemon says
	// when it reads the files itself.
	if strings.Contains(d.Log(), "read by the daemon") {
		t.Logf("this kernel or daemon has no FUSE passthrough: the files were read by the daemon")
	}
}

// The same bytes when the daemon reads the files itself (--passthrough=false,
// what a kernel before 6.9 or a daemon without CAP_SYS_ADMIN gets), read
// in large sequential reads and in small ones at odd offsets.
func TestModelFilesServedByTheDaemon(t *testing.T) {
	dir, served, _ := modelDirWithExtras(t)
	d := Mount(t, dir, "--passthrough=false")
	for _, name := range served {
		want, _ := os.ReadFile(filepath.Join(dir, name))
		f, err := os.Open(filepath.Join(d.Mountpoint, name))
		if err != nil {
			t.Fatal(err)
		}
		var got bytes.Buffer
		if _, err := io.CopyBuffer(&got, f, make([]byte, 1<<20)); err != nil || !bytes.Equal(got.Bytes(), want) {
			t.Errorf("%s: sequential read of %d bytes (%v), want %d equal bytes", name, got.Len(), err, len(want))
		}
		for _, off := range []int64{int64(len(want)) - 1, 4095, 12345, 0} {
			if off < 0 || off >= int64(len(want)) {
				continue
			}
			b := make([]byte, 777)
			n, err := f.ReadAt(b, off)
			if (err != nil && err != io.EOF) || !bytes.Equal(b[:n], want[off:min(off+777, int64(len(want)))]) {
				t.Errorf("%s: 777 bytes at %d differ (%v)", name, off, err)
			}
		}
		f.Close()
	}
	if !strings.Contains(d.Log(), "read by the daemon") {
		t.Error("the daemon did not say it reads the model files itself")
	}
}

// An engine-shaped loader (config, generation config, tokenizer, index,
// then every tensor the index names, mapped from its file) loads the same
// bytes from the mount as from the model directory: the tables from their
// table files, every other tensor from its shard.
func TestEngineLoaderLoadsTheModelFromTheMount(t *testing.T) {
	python := requireNumpy(t)
	dir, _, _ := modelDirWithExtras(t)
	d := Mount(t, dir)
	load := func(root string) string {
		out, err := exec.Command(python, "python/model_loader.py", root).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				t.Fatalf("model_loader.py %s: %v\n%s", root, err, ee.Stderr)
			}
			t.Fatal(err)
		}
		return string(out)
	}
	want, got := load(dir), load(d.Mountpoint)
	if got != want {
		t.Fatalf("the mount loads other bytes than the model directory:\nmount: %s\nmodel: %s", got, want)
	}
	if !strings.Contains(got, backing.UnrelatedTensor) || strings.Count(got, `"F8_E4M3"`)+strings.Count(got, `"F32"`) != 5 {
		t.Fatalf("the loader did not load every tensor (4 tables and %s): %s", backing.UnrelatedTensor, got)
	}
}

// A table read straight through with large reads gets the daemon's
// readahead: a few FUSE reads instead of one per page, the same bytes.
func TestTableSequentialReadIsReadAhead(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Layers = 1 // one 64 MiB weight table
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	tb := Model(t, d.ModelDir).Tables[1]
	if tb.Kind != "weight" {
		t.Fatalf("table %s is not the weight table", tb.Name)
	}
	path := filepath.Join(d.Mountpoint, tb.Path())
	want := ShardTable(t, d.ModelDir, tb.Name)
	// A page cache dropped from outside during the read (a benchmark
	// beside the suite) evicts the pushed window ahead of the reader, which
	// then reads it a page at a time: not judged, read again.
	untilNoOutsideDrop(t, "a table read straight through", func() error {
		evict(t, path)
		before := d.Stats(t).FuseReads
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var got bytes.Buffer
		if _, err := io.CopyBuffer(&got, f, make([]byte, 1<<20)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes()[len(tb.FileHeader):], want) {
			t.Fatal("the table read straight through differs from the shard")
		}
		pages := uint64(tb.FileSize / 4096)
		if reads := d.Stats(t).FuseReads - before; reads > pages/8 {
			return fmt.Errorf("reading %d pages straight through took %d FUSE reads: no readahead (want under %d)", pages, reads, pages/8)
		}
		return nil
	})
}

// From s3://, the model's other objects are its files too, read in large
// ranged GETs: a shard read straight through costs about a GET per MiB,
// not one per page.
func TestS3MountIsTheModelDirectory(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 2048
	d, dir, _ := s3Model(t, spec, "--cache-size", "0")
	names := append([]string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}, backing.SynthConfigFiles...)
	for _, name := range names {
		want, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		before := d.Stats(t).S3Gets
		got, err := os.ReadFile(filepath.Join(d.Mountpoint, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes (%v), want the object's %d", name, len(got), err, len(want))
		}
		gets, most := d.Stats(t).S3Gets-before, uint64(2*len(want)>>20+4)
		if gets > most {
			t.Errorf("%s: %d GETs for %d bytes, want at most %d (large ranged GETs)", name, gets, len(want), most)
		}
		t.Logf("%s: %d bytes in %d GETs", name, len(want), gets)
	}
	b, err := os.ReadFile(filepath.Join(d.Mountpoint, backing.IndexFile))
	if err != nil || !bytes.Contains(b, []byte(backing.UnrelatedTensor)) {
		t.Errorf("the index does not map %s (%v):\n%s", backing.UnrelatedTensor, err, b)
	}
}

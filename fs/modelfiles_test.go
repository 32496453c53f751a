package fs

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/engramfs/engramfs/backing"
)

func writeModelFile(t *testing.T, dir, name, data string) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// Every file of the model directory is served at its path with its bytes;
// where the mount has an entry of its own at a path, the mount's wins and
// the model's is named in a warning (the index: an info line, it replaces
// the model's by design); directories both have are merged.
func TestTreeServesTheModelDirectory(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	tr := newTree(t, treeConfig{log: zap.New(core), prepare: func(dir string) {
		writeModelFile(t, dir, "manifest.json", `{"model": "its own"}`)
		writeModelFile(t, dir, "layers/0/notes.txt", "merged into the mount's layers/0\n")
		writeModelFile(t, dir, "layers/0/scale.safetensors/x", "under a table file")
		writeModelFile(t, dir, ".engramfs/control", "not the control file")
		writeModelFile(t, dir, ".engramfs/notes", "the control directory is the daemon's")
		writeModelFile(t, dir, "sub/dir/vocab.txt", "nested\n")
	}})

	served := []string{"layers/0/notes.txt", "sub/dir/vocab.txt", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
	served = append(served, backing.SynthConfigFiles...)
	for _, name := range served {
		want, err := os.ReadFile(filepath.Join(tr.dir, name))
		if err != nil {
			t.Fatal(err)
		}
		node := tr.node(name)
		got := tr.readAll(node, tr.open(node, syscall.O_RDONLY).Fh, 128<<10)
		if !bytes.Equal(got, want) {
			t.Errorf("%s: %d bytes served differ from the model directory's %d", name, len(got), len(want))
		}
		if _, s := tr.openAs(tr.caller, node, syscall.O_RDWR); s != fuse.Status(syscall.EROFS) {
			t.Errorf("%s: open for writing: %v, want EROFS", name, s)
		}
	}

	// The mount's own entries.
	man := tr.readAll(tr.node(ManifestFile), tr.open(tr.node(ManifestFile), syscall.O_RDONLY).Fh, 1<<20)
	var m Manifest
	if err := json.Unmarshal(man, &m); err != nil || len(m.Layers) != 2 {
		t.Errorf("manifest.json is not the mount's: %v\n%s", err, man)
	}
	if a, _ := tr.getattr(tr.node("layers/0/scale.safetensors")); a.Mode&syscall.S_IFREG == 0 {
		t.Errorf("layers/0/scale.safetensors: mode %#o, want the table file", a.Mode)
	}
	if got := tr.dirNames(tr.node(ControlDir)); !slices.Equal(got, []string{ControlFile, StatsFile}) {
		t.Errorf(".engramfs lists %v", got)
	}
	if got := tr.dirNames(tr.node("layers/0")); !slices.Equal(got, []string{"notes.txt", "scale.safetensors", "weight.safetensors"}) {
		t.Errorf("layers/0 lists %v", got)
	}

	warned := map[string]bool{}
	for _, e := range logs.FilterMessage("model directory entry not served").All() {
		warned[e.ContextMap()["path"].(string)] = e.Level == zapcore.WarnLevel
	}
	for _, name := range []string{"manifest.json", "layers/0/scale.safetensors/x", ".engramfs/control", ".engramfs/notes"} {
		if !warned[name] {
			t.Errorf("%s: no warning that it is not served (warned: %v)", name, warned)
		}
	}
	if len(warned) != 4 {
		t.Errorf("warned of %v, want exactly the four collisions", warned)
	}
	if logs.FilterMessage("serving the mount's own index in place of the model directory's").Len() != 1 {
		t.Error("no line says the model's index is replaced")
	}
}

// A model-directory file where the mount has a directory is not served.
func TestTreeModelFileNamedLikeAMountDirectory(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	tr := newTree(t, treeConfig{log: zap.New(core), prepare: func(dir string) {
		writeModelFile(t, dir, "layers", "a file named layers")
	}})
	if a, _ := tr.getattr(tr.node("layers")); a.Mode&syscall.S_IFDIR == 0 {
		t.Fatalf("layers: mode %#o, want the mount's directory", a.Mode)
	}
	if logs.FilterField(zap.String("path", "layers")).Len() != 1 {
		t.Errorf("no warning names the file layers: %v", logs.All())
	}
}

// A file not readable by everyone in MODEL_DIR is the daemon's user's alone
// in the mount (with --allow-other, every user's open reaches the daemon).
func TestTreeModelFileModeKept(t *testing.T) {
	tr := newTree(t, treeConfig{prepare: func(dir string) {
		writeModelFile(t, dir, "secret.json", `{"token": "x"}`)
		if err := os.Chmod(filepath.Join(dir, "secret.json"), 0o600); err != nil {
			t.Fatal(err)
		}
	}})
	other := tr.caller
	other.Uid++
	if a, _ := tr.getattr(tr.node("secret.json")); a.Mode != syscall.S_IFREG|0o400 {
		t.Errorf("secret.json: mode %#o, want 0400", a.Mode)
	}
	if _, s := tr.openAs(other, tr.node("secret.json"), syscall.O_RDONLY); s != fuse.Status(syscall.EACCES) {
		t.Errorf("another user's open of a 0600 file: %v, want EACCES", s)
	}
	tr.open(tr.node("secret.json"), syscall.O_RDONLY) // the daemon's user
	if out, s := tr.openAs(other, tr.node("config.json"), syscall.O_RDONLY); s != fuse.OK {
		t.Errorf("another user's open of a 0644 file: %v", s)
	} else {
		in := fuse.ReleaseIn{InHeader: tr.hdr(tr.node("config.json")), Fh: out.Fh}
		tr.raw.Release(nil, &in)
	}
}

// A file changed since the mount is refused at open (ESTALE), never served
// with the size the mount announced.
func TestTreeModelFileChangedIsStale(t *testing.T) {
	tr := newTree(t, treeConfig{})
	node := tr.node("config.json")
	writeModelFile(t, tr.dir, "config.json", `{"rewritten": "under the mount"}`)
	if _, s := tr.openAs(tr.caller, node, syscall.O_RDONLY); s != fuse.Status(syscall.ESTALE) {
		t.Fatalf("open of a rewritten file: %v, want ESTALE", s)
	}
}

// otherProcess is a caller that is not the daemon: its handles read ahead.
func otherProcess(tr *tree) fuse.Caller {
	c := tr.caller
	c.Pid = uint32(os.Getppid())
	return c
}

// A reader's handle that reads a table sequentially has the next window
// read ahead (one backing read per MiB, beyond the pages asked for); a
// random reader's pages and the daemon's own handles cost exactly the pages
// read. (Without a mount the pushes themselves fail: the backing reads are
// what this test sees.)
func TestTableReadAheadOnlyForSequentialReaders(t *testing.T) {
	tr := newTree(t, treeConfig{rows: 16384}) // 64 MiB weight tables
	tb := tableNamed(t, tr.model, "layers.0.engram.embed.weight")
	node := tr.node(tablePath(tb))
	data := int64(tb.DataPage()) * 4096

	// readPages reads pages through a new handle of c; it waits (up to a
	// deadline) for the backing to have read wantBytes before closing the
	// handle, which stops its readahead.
	readPages := func(c fuse.Caller, pages []int64, wantBytes uint64) (reads, bytes uint64) {
		t.Helper()
		out, s := tr.openAs(c, node, syscall.O_RDONLY)
		if s != fuse.OK {
			t.Fatal(s)
		}
		r0, b0 := tr.st.BackingReads.Load(), tr.st.BackingBytes.Load()
		for _, p := range pages {
			tr.mustRead(node, out.Fh, data+p*4096, 4096)
		}
		for deadline := time.Now().Add(10 * time.Second); tr.st.BackingBytes.Load()-b0 < wantBytes && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		if wantBytes == 0 {
			// Time for a readahead that should not be to show up (a
			// release stops a readahead not yet started).
			time.Sleep(200 * time.Millisecond)
		}
		in := fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: out.Fh}
		tr.raw.Release(nil, &in) // waits for the handle's readahead
		return tr.st.BackingReads.Load() - r0, tr.st.BackingBytes.Load() - b0
	}
	seq := make([]int64, 32)
	for i := range seq {
		seq[i] = int64(i)
	}
	if _, b := readPages(otherProcess(tr), seq, 16*4096+1<<20); b < 16*4096+1<<20 {
		t.Errorf("a sequential reader of 32 pages: %d bytes read from backing, want 1 MiB ahead of its first 16", b)
	}
	random := []int64{5000, 17, 9000, 300, 12000, 4444, 1000, 16000, 2, 7777, 8888, 100, 200, 3000, 6000, 15000, 11000, 50}
	if r, b := readPages(otherProcess(tr), random, 0); r != uint64(len(random)) || b != uint64(len(random))*4096 {
		t.Errorf("a random reader of %d pages: %d backing reads of %d bytes, want one page each", len(random), r, b)
	}
	seq2 := make([]int64, 32)
	for i := range seq2 {
		seq2[i] = 8192 + int64(i)
	}
	if r, b := readPages(tr.caller, seq2, 0); r != 32 || b != 32*4096 {
		t.Errorf("the daemon's own handle reading 32 pages: %d backing reads of %d bytes, want one page each", r, b)
	}
}

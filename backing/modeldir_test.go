package backing

import (
	"bytes"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// mustWrite writes data to dir/name, making the directories on the way.
func mustWrite(t *testing.T, dir, name string, data []byte) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// The model's files are listed recursively, sorted, with their bytes'
// identity; symlinks are followed only to regular files inside the
// directory, and nothing that is not a regular file is opened (a FIFO open
// would block the mount forever: the walk returning at all proves it).
func TestLocalFilesListsTheModelDirectory(t *testing.T) {
	dir := synthDir(t, smallSynth())
	outside := t.TempDir()
	mustWrite(t, outside, "secret", []byte("not the model's"))
	mustWrite(t, dir, "sub/deeper/vocab.txt", []byte("a b c\n"))
	mustWrite(t, dir, "blobs/abc123", []byte(`{"tokenizer": true}`))
	mustSymlink(t, "blobs/abc123", filepath.Join(dir, "special_tokens_map.json"))
	mustSymlink(t, filepath.Join(outside, "secret"), filepath.Join(dir, "leak.json"))
	mustSymlink(t, "../../../../../../../../etc/passwd", filepath.Join(dir, "passwd.json"))
	mustSymlink(t, "missing", filepath.Join(dir, "dangling.json"))
	mustSymlink(t, "sub", filepath.Join(dir, "sub-link"))
	if err := unix.Mkfifo(filepath.Join(dir, "pipe"), 0o644); err != nil {
		t.Fatal(err)
	}

	src := NewLocalSource(dir, IOBuffered, nil, nil)
	done := make(chan struct{})
	var files []ModelFile
	var skipped []SkippedFile
	var err error
	go func() {
		defer close(done)
		files, skipped, err = src.Files()
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("listing the model directory hangs (opened the FIFO?)")
	}
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range files {
		names = append(names, f.Name)
	}
	want := append([]string{"blobs/abc123", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
		IndexFile, "special_tokens_map.json", "sub/deeper/vocab.txt"}, SynthConfigFiles...)
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Fatalf("files %v, want %v", names, want)
	}
	reasons := map[string]string{}
	for _, s := range skipped {
		reasons[s.Name] = s.Reason
	}
	for name, reason := range map[string]string{
		"leak.json": "outside the model directory", "passwd.json": "outside the model directory",
		"dangling.json": "does not resolve", "sub-link": "a directory", "pipe": "a FIFO",
	} {
		if !strings.Contains(reasons[name], reason) {
			t.Errorf("%s: skipped with %q, want a reason naming %q", name, reasons[name], reason)
		}
	}
	if len(skipped) != 5 {
		t.Errorf("skipped %v, want the five entries above", skipped)
	}

	// Opening gives the bytes, a symlink's target's included.
	for _, f := range files {
		if f.Name != "special_tokens_map.json" && f.Name != "sub/deeper/vocab.txt" {
			continue
		}
		of, err := src.OpenFile(f)
		if err != nil {
			t.Fatal(err)
		}
		fd := of.Fd()
		got, err := io.ReadAll(io.NewSectionReader(of, 0, f.Identity.Size))
		of.Close()
		want, _ := os.ReadFile(filepath.Join(dir, f.Name))
		if err != nil || !bytes.Equal(got, want) || fd < 0 {
			t.Errorf("%s: read %q (%v), want %q", f.Name, got, err, want)
		}
	}
}

// A file rewritten or replaced since it was listed is refused at open: the
// mount announced its size and must not serve other bytes.
func TestLocalOpenFileRefusesAChangedFile(t *testing.T) {
	dir := synthDir(t, smallSynth())
	src := NewLocalSource(dir, IOBuffered, nil, nil)
	files, _, err := src.Files()
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(files, func(f ModelFile) bool { return f.Name == "config.json" })
	of, err := src.OpenFile(files[i])
	if err != nil {
		t.Fatalf("the listed file: %v", err)
	}
	of.Close()
	mustWrite(t, dir, "config.json", []byte(`{"replaced": true}`))
	if _, err := src.OpenFile(files[i]); !errors.Is(err, ErrShardChanged) {
		t.Fatalf("open after a rewrite: %v, want ErrShardChanged", err)
	}
	if _, err := src.OpenFile(ModelFile{Name: "config.json"}); err == nil {
		t.Fatal("opened a file the source never listed")
	}
}

// The model keeps every tensor that is not a table with its shard (from
// the index, and from the shards' headers without one), the index's
// metadata, and the directory's files.
func TestLoadKeepsTheOtherTensorsAndFiles(t *testing.T) {
	for _, noIndex := range []bool{false, true} {
		dir := synthDir(t, smallSynth())
		if noIndex {
			os.Remove(filepath.Join(dir, IndexFile))
		}
		m, err := Load(dir, DefaultTablePattern)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := m.Others, map[string]string{UnrelatedTensor: "model-00001-of-00002.safetensors"}; !maps.Equal(got, want) {
			t.Errorf("no index %v: others %v, want %v", noIndex, got, want)
		}
		if !bytes.Contains(m.IndexMetadata, []byte(`"total_size"`)) {
			t.Errorf("no index %v: metadata %s has no total_size", noIndex, m.IndexMetadata)
		}
		if len(m.Files) < 2+len(SynthConfigFiles) {
			t.Errorf("no index %v: files %v", noIndex, m.Files)
		}
		if _, err := m.OpenFile(m.Files[0]); err != nil {
			t.Errorf("no index %v: %v", noIndex, err)
		}
	}
	// An index entry that leaves the directory is left out of the mount's
	// index (with a reason) when it is not a table's.
	dir := synthDir(t, smallSynth())
	wm := readWeightMap(t, dir)
	wm["lm_head.weight"] = "../elsewhere.safetensors"
	writeIndex(t, dir, wm)
	m, err := Load(dir, DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m.Others["lm_head.weight"]; ok || len(m.SkippedFiles) != 1 || !strings.Contains(m.SkippedFiles[0].Reason, "lm_head.weight") {
		t.Errorf("others %v, skipped %v: want lm_head.weight left out with a reason", m.Others, m.SkippedFiles)
	}
}

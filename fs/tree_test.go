package fs

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// The stats file is where stats.ReadFile (which cannot import fs) reads it.
func TestStatsFileIsWhereStatsReadsIt(t *testing.T) {
	if p := filepath.Join(ControlDir, StatsFile); p != stats.RelPath {
		t.Fatalf("the tree serves the stats at %s, stats.ReadFile reads %s", p, stats.RelPath)
	}
}

// Every name of the tree resolves, with the type, permission bits, size and
// owner a user sees in ls -l; the directories' children are exactly those.
func TestTreeLookups(t *testing.T) {
	tr := newTree(t, treeConfig{})
	type want struct {
		path string
		mode uint32
		size int64 // -1: not checked here (manifest and index: see their tests)
	}
	wants := []want{
		{"", syscall.S_IFDIR | 0o755, 0},
		{"manifest.json", syscall.S_IFREG | 0o444, -1},
		{backing.IndexFile, syscall.S_IFREG | 0o444, -1},
		{"layers", syscall.S_IFDIR | 0o555, 0},
		{".engramfs", syscall.S_IFDIR | 0o555, 0},
		{".engramfs/control", syscall.S_IFREG | 0o600, ControlSize},
		{".engramfs/stats", syscall.S_IFREG | 0o444, 0},
	}
	// The model directory's own files, at their paths (its index is the
	// mount's, above).
	for _, name := range backing.SynthConfigFiles {
		wants = append(wants, want{name, syscall.S_IFREG | 0o444, fileSize(t, filepath.Join(tr.dir, name))})
	}
	for _, sh := range []string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} {
		wants = append(wants, want{sh, syscall.S_IFREG | 0o444, fileSize(t, filepath.Join(tr.dir, sh))})
	}
	for _, l := range []int{0, 1} {
		wants = append(wants, want{fmt.Sprintf("layers/%d", l), syscall.S_IFDIR | 0o555, 0})
		for _, kind := range []string{"weight", "scale"} {
			tb := tableNamed(t, tr.model, fmt.Sprintf("layers.%d.engram.embed.%s", l, kind))
			wants = append(wants, want{fmt.Sprintf("layers/%d/%s.safetensors", l, kind), syscall.S_IFREG | 0o444, tb.FileSize})
		}
	}
	inos := map[uint64]string{}
	for _, w := range wants {
		node := tr.node(w.path)
		a, s := tr.getattr(node)
		if s != fuse.OK {
			t.Fatalf("getattr %q: %v", w.path, s)
		}
		if a.Mode != w.mode {
			t.Errorf("%q: mode %#o, want %#o", w.path, a.Mode, w.mode)
		}
		if w.size >= 0 && int64(a.Size) != w.size {
			t.Errorf("%q: size %d, want %d", w.path, a.Size, w.size)
		}
		if a.Uid != tr.caller.Uid || a.Gid != tr.caller.Gid {
			t.Errorf("%q: owner %d:%d, want the daemon's %d:%d", w.path, a.Uid, a.Gid, tr.caller.Uid, tr.caller.Gid)
		}
		if prev, dup := inos[a.Ino]; dup {
			t.Errorf("%q and %q share inode number %d", w.path, prev, a.Ino)
		}
		inos[a.Ino] = w.path
		if w.path == "" {
			continue
		}
		// The entry LOOKUP returns carries the same attributes, and a long
		// entry timeout: the tree never changes.
		parent, name := splitPath(w.path)
		e, s := tr.lookup(tr.node(parent), name)
		if s != fuse.OK || e.NodeId != node || e.Attr.Mode != w.mode || e.Attr.Size != a.Size {
			t.Errorf("lookup %q: %v node %d mode %#o size %d; getattr says node %d mode %#o size %d",
				w.path, s, e.NodeId, e.Attr.Mode, e.Attr.Size, node, a.Mode, a.Size)
		}
		if e.EntryValid < 3600 || e.AttrValid < 3600 {
			t.Errorf("lookup %q: entry valid %ds, attr valid %ds: the kernel would ask again and again", w.path, e.EntryValid, e.AttrValid)
		}
	}
	// Directories hold exactly these children.
	children := map[string][]string{}
	for _, w := range wants {
		if w.path != "" {
			parent, name := splitPath(w.path)
			children[parent] = append(children[parent], name)
		}
	}
	for dir, names := range children {
		got := tr.dirNames(tr.node(dir))
		slices.Sort(names)
		if !slices.Equal(got, names) {
			t.Errorf("directory %q lists %v, want %v", dir, got, names)
		}
	}
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

func splitPath(p string) (parent, name string) {
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' {
			return p[:i], p[i+1:]
		}
	}
	return "", p
}

// dirNames lists directory node (OPENDIR, READDIR until empty), without "."
// and "..", sorted.
func (tr *tree) dirNames(node uint64) []string {
	tr.t.Helper()
	var oo fuse.OpenOut
	if s := tr.raw.OpenDir(nil, &fuse.OpenIn{InHeader: tr.hdr(node)}, &oo); s != fuse.OK {
		tr.t.Fatalf("opendir %d: %v", node, s)
	}
	defer tr.raw.ReleaseDir(&fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: oo.Fh})
	var names []string
	var off uint64
	for {
		buf := make([]byte, 4096)
		l := fuse.NewDirEntryList(buf, off)
		if s := tr.raw.ReadDir(nil, &fuse.ReadIn{InHeader: tr.hdr(node), Fh: oo.Fh, Offset: off, Size: uint32(len(buf))}, l); s != fuse.OK {
			tr.t.Fatalf("readdir %d: %v", node, s)
		}
		b := l.Bytes()
		if len(b) == 0 {
			break
		}
		// struct fuse_dirent: ino u64, off u64, namelen u32, type u32,
		// name, padded to 8 bytes.
		for len(b) >= 24 {
			nextOff := binary.LittleEndian.Uint64(b[8:])
			n := int(binary.LittleEndian.Uint32(b[16:]))
			name := string(b[24 : 24+n])
			if name != "." && name != ".." {
				names = append(names, name)
			}
			off = nextOff
			b = b[(24+n+7)&^7:]
		}
	}
	slices.Sort(names)
	return names
}

func tableNamed(t *testing.T, m *backing.Model, name string) *backing.Table {
	t.Helper()
	for _, tb := range m.Tables {
		if tb.Name == name {
			return tb
		}
	}
	t.Fatalf("model has no table %s", name)
	return nil
}

// Names that are not in the tree are ENOENT: other layers and tables, the
// unrelated tensor, near misses, names below files.
func TestTreeUnknownNamesAreENOENT(t *testing.T) {
	tr := newTree(t, treeConfig{})
	for _, p := range []struct{ dir, name string }{
		{"", "nope"},
		{"", "Manifest.json"},
		{"", "model-00003-of-00002.safetensors"},
		{"", "config.json.bak"},
		{"", backing.UnrelatedTensor},
		{"", "control"},
		{"", "stats"},
		{"layers", "2"},
		{"layers", "00"},
		{"layers", "-1"},
		{"layers/0", "bias.safetensors"},
		{"layers/0", "weight"},
		{"layers/1", "weight.safetensors.tmp"},
		{".engramfs", "ctl"},
		{"layers/0/weight.safetensors", "x"},
		{"manifest.json", "x"},
	} {
		if e, s := tr.lookup(tr.node(p.dir), p.name); s != fuse.ENOENT {
			t.Errorf("lookup %q in %q: %v (node %d), want ENOENT", p.name, p.dir, s, e.NodeId)
		}
	}
}

// manifest.json describes every table: its file (which exists, with that
// size), name, dtype, shape, row bytes, and the data offset its own header
// gives.
func TestTreeManifest(t *testing.T) {
	tr := newTree(t, treeConfig{flash: true})
	node := tr.node("manifest.json")
	oo := tr.open(node, syscall.O_RDONLY)
	if oo.OpenFlags&fuse.FOPEN_DIRECT_IO != 0 {
		t.Errorf("manifest.json opens with DIRECT_IO (%#x)", oo.OpenFlags)
	}
	raw := tr.readAll(node, oo.Fh, 1000)
	if a, _ := tr.getattr(node); a.Size != uint64(len(raw)) {
		t.Fatalf("manifest.json: size %d, read %d bytes", a.Size, len(raw))
	}
	// Parsed with its own field names, not with Manifest: the JSON names are
	// the contract (docs/design.md, "The tree"), and a renamed tag must fail
	// here.
	var man struct {
		Version  int    `json:"version"`
		PageSize int    `json:"page_size"`
		Source   string `json:"source"`
		Layers   []struct {
			Layer  int    `json:"layer"`
			Rows   uint64 `json:"rows"`
			Tables []struct {
				Table      string  `json:"table"`
				Name       string  `json:"name"`
				Dtype      string  `json:"dtype"`
				Shape      []int64 `json:"shape"`
				RowBytes   int64   `json:"row_bytes"`
				DataOffset int64   `json:"data_offset"`
				Size       int64   `json:"size"`
				File       string  `json:"file"`
			} `json:"tables"`
		} `json:"layers"`
	}
	if err := json.Unmarshal(raw, &man); err != nil {
		t.Fatalf("manifest.json: %v\n%s", err, raw)
	}
	if man.Version != 1 || man.PageSize != page || man.Source != tr.model.Dir || len(man.Layers) != tr.spec.Layers {
		t.Fatalf("manifest: version %d page size %d source %q, %d layers; want 1, %d, %q, %d",
			man.Version, man.PageSize, man.Source, len(man.Layers), page, tr.model.Dir, tr.spec.Layers)
	}
	seen := map[string]bool{}
	for i, ml := range man.Layers {
		if ml.Layer != i || ml.Rows != tr.spec.Rows || len(ml.Tables) != 2 {
			t.Fatalf("manifest layer %d: %+v", i, ml)
		}
		for _, mt := range ml.Tables {
			_, ent := shardData(t, tr.model, mt.Name)
			rowBytes := map[string]int64{"weight": tr.spec.WeightRow, "scale": tr.spec.ScaleRow}[mt.Table]
			if mt.Name != fmt.Sprintf("layers.%d.engram.embed.%s", ml.Layer, mt.Table) || rowBytes == 0 ||
				mt.Dtype != ent.Dtype || !slices.Equal(mt.Shape, ent.Shape) || mt.RowBytes != rowBytes ||
				mt.File != fmt.Sprintf("layers/%d/%s.safetensors", ml.Layer, mt.Table) {
				t.Fatalf("manifest table %+v: shard says dtype %s shape %v, row bytes %d", mt, ent.Dtype, ent.Shape, rowBytes)
			}
			fnode := tr.node(mt.File)
			a, _ := tr.getattr(fnode)
			fh := tr.open(fnode, syscall.O_RDONLY).Fh
			prefix := tr.mustRead(fnode, fh, 0, 8)
			if off := int64(8 + binary.LittleEndian.Uint64(prefix)); mt.DataOffset != off || mt.DataOffset%page != 0 {
				t.Fatalf("manifest %s: data_offset %d, the file's header says %d", mt.File, mt.DataOffset, off)
			}
			if int64(a.Size) != mt.Size {
				t.Fatalf("manifest %s: size %d, file has %d", mt.File, mt.Size, a.Size)
			}
			seen[mt.Name] = true
		}
	}
	if len(seen) != len(tr.model.Tables) {
		t.Fatalf("manifest names %d tables, model has %d", len(seen), len(tr.model.Tables))
	}
}

// model.safetensors.index.json maps every table, and nothing else, to its
// table file, and totals their data.
func TestTreeIndex(t *testing.T) {
	tr := newTree(t, treeConfig{})
	node := tr.node(backing.IndexFile)
	oo := tr.open(node, syscall.O_RDONLY)
	raw := tr.readAll(node, oo.Fh, 333)
	if a, _ := tr.getattr(node); a.Size != uint64(len(raw)) {
		t.Fatalf("index: size %d, read %d bytes", a.Size, len(raw))
	}
	var idx struct {
		Metadata struct {
			TotalSize int64 `json:"total_size"`
		} `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(raw, &idx); err != nil {
		t.Fatalf("index: %v\n%s", err, raw)
	}
	// Every tensor: the tables at their table files, the unrelated
	// tensor at its shard; total_size is the model's (all of them).
	total := int64(64 * 13 * 4)
	want := map[string]string{backing.UnrelatedTensor: "model-00001-of-00002.safetensors"}
	for l := range tr.spec.Layers {
		for _, kind := range []string{"weight", "scale"} {
			name := fmt.Sprintf("layers.%d.engram.embed.%s", l, kind)
			want[name] = fmt.Sprintf("layers/%d/%s.safetensors", l, kind)
			data, _ := shardData(t, tr.model, name)
			total += int64(len(data))
		}
	}
	if len(idx.WeightMap) != len(want) {
		t.Fatalf("index maps %v, want %v", idx.WeightMap, want)
	}
	for name, file := range want {
		if idx.WeightMap[name] != file {
			t.Fatalf("index maps %s to %q, want %q", name, idx.WeightMap[name], file)
		}
		if name == backing.UnrelatedTensor {
			tr.node(file) // served at that path
			continue
		}
		// The file exists and is the tensor's own safetensors file.
		fnode := tr.node(file)
		fh := tr.open(fnode, syscall.O_RDONLY).Fh
		prefix := tr.mustRead(fnode, fh, 0, 8)
		var hdr map[string]json.RawMessage
		if err := json.Unmarshal(tr.mustRead(fnode, fh, 8, int(binary.LittleEndian.Uint64(prefix))), &hdr); err != nil || hdr[name] == nil {
			t.Fatalf("index: %s is in %s, whose header (%v) does not name it", name, file, err)
		}
	}
	if idx.Metadata.TotalSize != total {
		t.Fatalf("index total_size %d, want %d", idx.Metadata.TotalSize, total)
	}
}

package fs

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
)

// Names in the mount.
const (
	ManifestFile = "manifest.json"
	ControlDir   = ".engramfs"
	StatsFile    = "stats"
	ControlFile  = "control"
)

// Manifest is manifest.json: what the mount serves, for tools that do not
// want to parse safetensors headers.
type Manifest struct {
	Version  int             `json:"version"`
	PageSize int             `json:"page_size"`
	Source   string          `json:"source"`
	Layers   []ManifestLayer `json:"layers"`
}

// ManifestLayer is one engram layer.
type ManifestLayer struct {
	Layer  int             `json:"layer"`
	Rows   uint64          `json:"rows"`
	Tables []ManifestTable `json:"tables"`
}

// ManifestTable is one table file.
type ManifestTable struct {
	Table      string  `json:"table"`
	Name       string  `json:"name"`
	Dtype      string  `json:"dtype"`
	Shape      []int64 `json:"shape"`
	RowBytes   int64   `json:"row_bytes"`
	DataOffset int64   `json:"data_offset"`
	Size       int64   `json:"size"`
	File       string  `json:"file"`
}

// BuildManifest describes m.
func BuildManifest(m *backing.Model) Manifest {
	man := Manifest{Version: 1, PageSize: cache.PageSize, Source: m.Dir}
	for _, layer := range m.Layers {
		rows, _ := m.LayerRows(layer)
		ml := ManifestLayer{Layer: layer, Rows: rows}
		for _, t := range m.LayerTables(layer) {
			ml.Tables = append(ml.Tables, ManifestTable{
				Table: t.Kind, Name: t.Name, Dtype: t.Dtype,
				Shape:    []int64{int64(t.Rows), t.RowBytes / mustDtypeSize(t.Dtype)},
				RowBytes: t.RowBytes, DataOffset: int64(len(t.FileHeader)), Size: t.FileSize, File: t.Path(),
			})
		}
		man.Layers = append(man.Layers, ml)
	}
	return man
}

func mustDtypeSize(dtype string) int64 {
	n, _ := backing.DtypeSize(dtype) // tables only exist with known dtypes
	return n
}

// buildIndex is the mount's model.safetensors.index.json: every tensor of
// the model, each table mapped to its table file and every other tensor to
// its shard (served at its own path), so a loader pointed at the mount
// finds them all. The metadata is the model's own index's (its total_size
// counts the same tensors), or total_size alone without one.
func buildIndex(m *backing.Model) []byte {
	wm := make(map[string]string, len(m.Tables)+len(m.Others))
	for name, shard := range m.Others {
		wm[name] = shard
	}
	for _, t := range m.Tables {
		wm[t.Name] = t.Path()
	}
	metadata := m.IndexMetadata
	if len(metadata) == 0 || string(metadata) == "null" {
		var total int64
		for _, t := range m.Tables {
			total += t.DataLen
		}
		metadata, _ = json.Marshal(map[string]int64{"total_size": total})
	}
	b, _ := json.MarshalIndent(map[string]any{"metadata": metadata, "weight_map": wm}, "", "  ")
	return append(b, '\n')
}

// root is the mount's root directory; it builds the whole (fixed) tree in
// OnAdd, which go-fuse calls from NewNodeFS (New), before anything is
// mounted.
type root struct {
	roDir
	o      *Options
	tables []*tableFile // by table ID: the inodes prefetch stores into
	mtime  time.Time
	// servedByDaemon logs once that model files are not passed through.
	servedByDaemon sync.Once
}

var _ = (gofs.NodeOnAdder)((*root)(nil))

func (r *root) OnAdd(ctx context.Context) {
	var ino uint64 = 1
	next := func() uint64 { ino++; return ino }
	dirAttr := func() fuse.Attr { return r.attr(syscall.S_IFDIR|0o555, 0) }

	addFile := func(parent *gofs.Inode, name string, node gofs.InodeEmbedder) *gofs.Inode {
		ch := parent.NewPersistentInode(ctx, node, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: next()})
		parent.AddChild(name, ch, false)
		return ch
	}
	addDir := func(parent *gofs.Inode, name string) *gofs.Inode {
		ch := parent.NewPersistentInode(ctx, &roDir{attr: dirAttr()}, gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: next()})
		parent.AddChild(name, ch, false)
		return ch
	}

	m := r.o.Model
	manifest, _ := json.MarshalIndent(BuildManifest(m), "", "  ")
	manifest = append(manifest, '\n')
	index := buildIndex(m)
	addFile(&r.Inode, ManifestFile, &memFile{roFile: roFile{attr: r.attr(syscall.S_IFREG|0o444, len(manifest))}, data: manifest})
	addFile(&r.Inode, backing.IndexFile, &memFile{roFile: roFile{attr: r.attr(syscall.S_IFREG|0o444, len(index))}, data: index})

	layersDir := addDir(&r.Inode, "layers")
	r.tables = make([]*tableFile, len(m.Tables))
	for _, layer := range m.Layers {
		ld := addDir(layersDir, strconv.Itoa(layer))
		for _, t := range m.LayerTables(layer) {
			tf := &tableFile{
				roFile: roFile{attr: r.attr(syscall.S_IFREG|0o444, int(t.FileSize))},
				t:      t, loader: r.o.Loader, into: r.o.ReadInto, st: r.o.Stats, faults: r.o.faults, seen: r.o.Seen, log: r.o.hotLog,
			}
			addFile(ld, t.Kind+".safetensors", timeTable(tf, r.o.Stats.Timings))
			r.tables[t.ID] = tf
		}
	}

	ctl := addDir(&r.Inode, ControlDir)
	addFile(ctl, StatsFile, &statsFile{roFile: roFile{attr: r.attr(syscall.S_IFREG|0o444, 0)}, st: r.o.Stats})
	ctlAttr := r.attr(syscall.S_IFREG|0o600, ControlSize)
	ctlAttr.Blocks = 0 // ControlSize is for the kernel's lock, not bytes: du counts none
	addFile(ctl, ControlFile, &controlFile{roFile: roFile{attr: ctlAttr}, r: r,
		wait: timeBarrier(waitBarrier, r.o.Stats.Timings)})

	// Last: the mount's own entries win every name (modelfiles.go).
	r.addModelFiles(addFile, addDir)
}

// attr returns the fixed attributes of a node: owned by the daemon's user,
// one constant mtime (the tree never changes while mounted).
func (r *root) attr(mode uint32, size int) fuse.Attr {
	a := fuse.Attr{Mode: mode, Size: uint64(size), Nlink: 1, Owner: fuse.Owner{Uid: r.o.uid, Gid: r.o.gid}}
	if mode&syscall.S_IFDIR != 0 {
		a.Nlink = 2
	}
	a.Blocks = (a.Size + 511) / 512
	a.Blksize = cache.PageSize
	a.SetTimes(&r.mtime, &r.mtime, &r.mtime)
	return a
}

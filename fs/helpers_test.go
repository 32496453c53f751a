package fs

// Helpers of the fs unit tests. They drive go-fuse's RawFileSystem (the
// bridge that turns FUSE requests into node calls) directly, with hand-built
// requests: no /dev/fuse, no mount, no root. What they cannot see is the
// kernel's side (page cache, mmap, the open(2) flag translation): the tests
// under tests/ cover that against real mounts.

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/stats"
)

// newRawFS builds the node tree Serve would mount for o, connected to
// hints and faults, and returns go-fuse's request bridge over it, without
// mounting anything. It is the ONLY place the tests depend on how fs
// assembles a server: when that changes, change this function alone. New
// builds the tree before any mount, so this is the server's own root and
// gofs.Options (the timeouts matter: with NegativeTimeout set, a lookup of a
// missing name answers OK with node ID 0, a negative entry).
func newRawFS(t testing.TB, o Options, hints HintSink, faults FaultSink) (fuse.RawFileSystem, *root) {
	t.Helper()
	srv, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	srv.Connect(hints, faults)
	return srv.rawFS, srv.root
}

// tree is a synthetic model served through the raw bridge.
type tree struct {
	t      *testing.T
	dir    string // the model directory
	spec   backing.SynthSpec
	model  *backing.Model
	st     *stats.Counters
	loader *cache.Loader
	raw    fuse.RawFileSystem
	root   *root
	caller fuse.Caller // the daemon's own user
}

// treeConfig adjusts a tree before it is built.
type treeConfig struct {
	flash  bool                  // small rows: many rows per page
	rows   uint64                // rows per table (default 1001: every table ends on a short page)
	reader func() backing.Reader // nil: the real store over the shards
	hints  HintSink
	faults FaultSink
	// prepare changes the model directory before the model is loaded.
	prepare func(dir string)
	// noPassthrough: Options.NoPassthrough.
	noPassthrough bool
	log           *zap.Logger // nil: none
}

// newTree synthesizes a two-layer model in a temporary directory and serves
// it through the real store and loader (pread engine: works unprivileged).
func newTree(t *testing.T, c treeConfig) *tree {
	t.Helper()
	spec := backing.DefaultSynth()
	spec.Rows = 1001
	if c.rows != 0 {
		spec.Rows = c.rows
	}
	if c.flash {
		spec.FlashGeometry()
	}
	dir := t.TempDir()
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	if c.prepare != nil {
		c.prepare(dir)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	var rd backing.Reader
	if c.reader != nil {
		rd = c.reader()
	} else {
		eng, _, err := ioengine.New("pread", 4)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { eng.Close() })
		store, err := backing.Open(m, backing.NewLocalSource(dir, backing.IOBuffered, eng, st), st)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
		rd = store
	}
	loader := cache.NewLoader(rd, m.Tables, st)
	raw, r := newRawFS(t, Options{Model: m, Loader: loader, Stats: st, NoPassthrough: c.noPassthrough, Log: c.log}, c.hints, c.faults)
	return &tree{t: t, dir: dir, spec: spec, model: m, st: st, loader: loader, raw: raw, root: r,
		caller: fuse.Caller{Owner: fuse.Owner{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid())}, Pid: uint32(os.Getpid())}}
}

// hdr is a request header from the daemon's own user about node.
func (tr *tree) hdr(node uint64) fuse.InHeader {
	return fuse.InHeader{NodeId: node, Caller: tr.caller}
}

// lookup looks name up in directory parent. A negative entry (OK with node
// ID 0, which the kernel caches and reports as ENOENT) comes back as ENOENT.
func (tr *tree) lookup(parent uint64, name string) (fuse.EntryOut, fuse.Status) {
	var out fuse.EntryOut
	h := tr.hdr(parent)
	s := tr.raw.Lookup(nil, &h, name, &out)
	if s == fuse.OK && out.NodeId == 0 {
		return out, fuse.ENOENT
	}
	return out, s
}

// node resolves a slash-separated path from the root, failing the test when
// a component is missing.
func (tr *tree) node(path string) uint64 {
	tr.t.Helper()
	id := uint64(fuse.FUSE_ROOT_ID)
	if path == "" {
		return id
	}
	for _, name := range strings.Split(path, "/") {
		out, s := tr.lookup(id, name)
		if s != fuse.OK {
			tr.t.Fatalf("lookup %s (component %q): %v", path, name, s)
		}
		id = out.NodeId
	}
	return id
}

func (tr *tree) getattr(node uint64) (fuse.AttrOut, fuse.Status) {
	var out fuse.AttrOut
	in := fuse.GetAttrIn{InHeader: tr.hdr(node)}
	s := tr.raw.GetAttr(nil, &in, &out)
	return out, s
}

// openAs opens node with open(2) flags as caller.
func (tr *tree) openAs(c fuse.Caller, node uint64, flags uint32) (fuse.OpenOut, fuse.Status) {
	var out fuse.OpenOut
	in := fuse.OpenIn{InHeader: fuse.InHeader{NodeId: node, Caller: c}, Flags: flags}
	s := tr.raw.Open(nil, &in, &out)
	return out, s
}

// open opens node as the daemon's user and fails the test on an error; the
// handle is released with the test.
func (tr *tree) open(node uint64, flags uint32) fuse.OpenOut {
	tr.t.Helper()
	out, s := tr.openAs(tr.caller, node, flags)
	if s != fuse.OK {
		tr.t.Fatalf("open node %d flags %#x: %v", node, flags, s)
	}
	tr.t.Cleanup(func() {
		in := fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: out.Fh}
		tr.raw.Release(nil, &in)
	})
	return out
}

// read is a READ of size bytes at off; it returns a copy of the reply.
func (tr *tree) read(node, fh uint64, off int64, size int) ([]byte, fuse.Status) {
	in := fuse.ReadIn{InHeader: tr.hdr(node), Fh: fh, Offset: uint64(off), Size: uint32(size)}
	buf := make([]byte, size)
	res, s := tr.raw.Read(nil, &in, buf)
	if s != fuse.OK {
		return nil, s
	}
	b, s := res.Bytes(buf)
	if len(b) > size {
		tr.t.Fatalf("READ of %d bytes at %d answered %d bytes", size, off, len(b))
	}
	return append([]byte(nil), b...), s
}

// mustRead is read that fails the test on an error.
func (tr *tree) mustRead(node, fh uint64, off int64, size int) []byte {
	tr.t.Helper()
	b, s := tr.read(node, fh, off, size)
	if s != fuse.OK {
		tr.t.Fatalf("read node %d at %d size %d: %v", node, off, size, s)
	}
	return b
}

func (tr *tree) write(node, fh uint64, off int64, data []byte) (uint32, fuse.Status) {
	in := fuse.WriteIn{InHeader: tr.hdr(node), Fh: fh, Offset: uint64(off), Size: uint32(len(data))}
	return tr.raw.Write(nil, &in, data)
}

// readAll reads node through handle fh in chunks of chunk bytes until a
// short or empty reply.
func (tr *tree) readAll(node, fh uint64, chunk int) []byte {
	tr.t.Helper()
	var out []byte
	for {
		b := tr.mustRead(node, fh, int64(len(out)), chunk)
		out = append(out, b...)
		if len(b) < chunk {
			return out
		}
	}
}

// tablePath is the path of t's file in the mount, as the tests spell it.
func tablePath(t *backing.Table) string { return filepath.ToSlash(t.Path()) }

// recorder keeps what fakes are told, for the test to take.
type recorder[T any] struct {
	mu    sync.Mutex
	items []T // GUARDED_BY(mu)
}

func (r *recorder[T]) add(items ...T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.items = append(r.items, items...)
}

// take returns what was recorded since the previous take.
func (r *recorder[T]) take() []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	items := r.items
	r.items = nil
	return items
}

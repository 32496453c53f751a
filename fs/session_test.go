package fs

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// numberingFS numbers handles as go-fuse does (from 1, a freed number
// first) and panics on a number it did not give, as go-fuse does; a read
// answers which node and handle it reached.
type numberingFS struct {
	fuse.RawFileSystem
	mu    sync.Mutex
	next  uint64
	free  []uint64
	nodes map[uint64]uint64 // handle -> node
}

func newNumberingFS() *numberingFS {
	return &numberingFS{RawFileSystem: fuse.NewDefaultRawFileSystem(), next: 1, nodes: map[uint64]uint64{}}
}

func (f *numberingFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n := len(f.free); n > 0 {
		out.Fh, f.free = f.free[n-1], f.free[:n-1]
	} else {
		out.Fh, f.next = f.next, f.next+1
	}
	f.nodes[out.Fh] = in.NodeId
	return fuse.OK
}

func (f *numberingFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	node, ok := f.nodes[in.Fh]
	if !ok {
		panic(fmt.Sprintf("unknown file handle %d", in.Fh))
	}
	return fuse.ReadResultData([]byte(fmt.Sprintf("node %d handle %d", node, in.Fh))), fuse.OK
}

func (f *numberingFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.nodes[in.Fh]; !ok {
		panic(fmt.Sprintf("release of unknown file handle %d", in.Fh))
	}
	delete(f.nodes, in.Fh)
	f.free = append(f.free, in.Fh)
}

func (f *numberingFS) open(t *testing.T) int { t.Helper(); return f.count() }

func (f *numberingFS) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.nodes)
}

const testControlNode = 99

func testSession() (*sessionFS, *numberingFS) {
	inner := newNumberingFS()
	s := newSessionFS(inner)
	s.reopen = func(node uint64, orphan bool) (fuse.Caller, uint32, bool) {
		return fuse.Caller{}, 0, node != testControlNode || !orphan
	}
	return s, inner
}

func kernelOpen(t *testing.T, s *sessionFS, node uint64) uint64 {
	t.Helper()
	var out fuse.OpenOut
	if st := s.Open(nil, &fuse.OpenIn{InHeader: fuse.InHeader{NodeId: node}}, &out); !st.Ok() {
		t.Fatalf("open node %d: %v", node, st)
	}
	return out.Fh
}

// kernelRead is what a READ of fh on node reaches: "node N handle M", or
// the status.
func kernelRead(s *sessionFS, node, fh uint64) string {
	res, st := s.Read(nil, &fuse.ReadIn{InHeader: fuse.InHeader{NodeId: node}, Fh: fh}, nil)
	if !st.Ok() {
		return st.String()
	}
	b, _ := res.Bytes(nil)
	return string(b)
}

// After a crash the successor's go-fuse numbers from 1 again, as the dead
// daemon's did: the kernel's numbers still differ (generations), an orphan
// is reopened on its own node at first use and released with it, and a
// new open's release never touches it.
func TestOrphanHandlesNeverCollide(t *testing.T) {
	dead, _ := testSession()
	orphanA := kernelOpen(t, dead, 5)
	orphanB := kernelOpen(t, dead, 6)
	orphanCtl := kernelOpen(t, dead, testControlNode)

	succ, inner := testSession()
	fresh := kernelOpen(t, succ, 7) // go-fuse's 1, as orphanA was
	if fresh == orphanA || fresh == orphanB || fresh == orphanCtl {
		t.Fatalf("a new open got an orphan's number %#x", fresh)
	}
	if got := kernelRead(succ, 7, fresh); got != "node 7 handle 1" {
		t.Fatalf("read on the new handle reached %q", got)
	}
	if got := kernelRead(succ, 5, orphanA); got != "node 5 handle 2" {
		t.Fatalf("read on an orphan reached %q, want node 5 through a handle of its own", got)
	}
	if got := kernelRead(succ, 5, orphanA); got != "node 5 handle 2" {
		t.Fatalf("second read on an orphan reached %q, want the same adopted handle", got)
	}
	// Bound to its node: never another file's.
	if got := kernelRead(succ, 6, orphanA); got != fuse.EBADF.String() {
		t.Fatalf("orphan of node 5 read as node 6: %q, want EBADF", got)
	}
	if got := kernelRead(succ, 5, fresh); got != fuse.EBADF.String() {
		t.Fatalf("handle of node 7 read as node 5: %q, want EBADF", got)
	}
	// A number of the successor's own generation it never gave.
	if got := kernelRead(succ, 7, fresh+1); got != fuse.EBADF.String() {
		t.Fatalf("unknown handle of this generation: %q, want EBADF", got)
	}
	if got := kernelRead(succ, testControlNode, orphanCtl); got != fuse.EBADF.String() {
		t.Fatalf("orphan control handle: %q, want EBADF", got)
	}
	// Releases: the orphan's adopted handle goes, the new one stays; an
	// orphan never used releases nothing.
	succ.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 5}, Fh: orphanA})
	succ.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 6}, Fh: orphanB})
	succ.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: testControlNode}, Fh: orphanCtl})
	if got := kernelRead(succ, 7, fresh); got != "node 7 handle 1" {
		t.Fatalf("after the orphans' release the new handle reads %q", got)
	}
	if n := inner.open(t); n != 1 {
		t.Fatalf("%d handles open in go-fuse after the orphans' release, want 1", n)
	}
	// go-fuse reuses the freed number; the kernel's is new.
	again := kernelOpen(t, succ, 5)
	if again == orphanA || again == fresh {
		t.Fatalf("a reopen got number %#x, taken before", again)
	}
}

// A handover carries the kernel's numbers: the successor answers them on
// their nodes, and its own new numbers are of another generation.
func TestReplayKeepsKernelNumbers(t *testing.T) {
	pred, _ := testSession()
	var fhs []uint64
	for node := uint64(3); node < 8; node++ {
		fhs = append(fhs, kernelOpen(t, pred, node))
	}
	pred.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 4}, Fh: fhs[1]})
	ctl := kernelOpen(t, pred, testControlNode)

	succ, _ := testSession()
	succ.gen = pred.gen // the unlikely draw: replay must move off it
	if err := succ.replay(pred.snapshot()); err != nil {
		t.Fatal(err)
	}
	if succ.gen == pred.gen {
		t.Fatal("the successor kept its predecessor's generation")
	}
	for i, fh := range fhs {
		node := uint64(3 + i)
		if i == 1 {
			continue // released: the kernel never sends it again
		}
		got := kernelRead(succ, node, fh)
		if !strings.HasPrefix(got, fmt.Sprintf("node %d ", node)) {
			t.Fatalf("handed-over handle %#x on node %d reached %q", fh, node, got)
		}
	}
	if got := kernelRead(succ, testControlNode, ctl); !strings.HasPrefix(got, "node 99 ") {
		t.Fatalf("handed-over control handle reached %q", got)
	}
	if fresh := kernelOpen(t, succ, 3); fresh>>32 == pred.gen || fresh == fhs[0] {
		t.Fatalf("a new open after the handover got %#x, of the predecessor's generation", fresh)
	}
}

// Every method of go-fuse's RawFileSystem whose request or reply holds a
// handle number is sessionFS's own: go-fuse must never see the kernel's
// number (it indexes a slice with it). Checked against the interface, so a
// go-fuse upgrade that adds one fails here.
func TestSessionFSWrapsEveryHandleMethod(t *testing.T) {
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "session.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	own := map[string]bool{}
	for _, d := range file.Decls {
		fd, ok := d.(*ast.FuncDecl)
		if !ok || fd.Recv == nil || len(fd.Recv.List) != 1 {
			continue
		}
		if star, ok := fd.Recv.List[0].Type.(*ast.StarExpr); ok {
			if id, ok := star.X.(*ast.Ident); ok && id.Name == "sessionFS" {
				own[fd.Name.Name] = true
			}
		}
	}
	var holdsFh func(reflect.Type, int) bool
	holdsFh = func(ty reflect.Type, depth int) bool {
		for ty.Kind() == reflect.Pointer {
			ty = ty.Elem()
		}
		if ty.Kind() != reflect.Struct || depth > 4 {
			return false
		}
		for i := range ty.NumField() {
			fl := ty.Field(i)
			if strings.HasPrefix(fl.Name, "Fh") || holdsFh(fl.Type, depth+1) {
				return true
			}
		}
		return false
	}
	iface := reflect.TypeFor[fuse.RawFileSystem]()
	n := 0
	for i := range iface.NumMethod() {
		m := iface.Method(i)
		for j := range m.Type.NumIn() {
			if holdsFh(m.Type.In(j), 0) {
				n++
				if !own[m.Name] {
					t.Errorf("%s carries a handle number but reaches go-fuse unwrapped", m.Name)
				}
				break
			}
		}
	}
	if n < 20 {
		t.Fatalf("only %d methods carry a handle number: the check finds too few", n)
	}
}

package fs

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

const controlPath = ".engramfs/control"

// hintLog is a HintSink that keeps every part it is given.
type hintLog struct {
	recorder[hintPart]
	cfgMu sync.Mutex
	cfg   prefetch.Config // GUARDED_BY(cfgMu)
	// released are the barriers of the handles released. GUARDED_BY(cfgMu)
	released []*prefetch.Barrier
}

type hintPart struct {
	b     *prefetch.Barrier
	class hints.Class
	layer int
	rows  []uint64
	end   bool
}

func newHintLog() *hintLog { return &hintLog{cfg: prefetch.DefaultConfig(4)} }

func (h *hintLog) SubmitPart(b *prefetch.Barrier, class hints.Class, layer int, rows []uint64, frameEnd bool) {
	h.add(hintPart{b: b, class: class, layer: layer, rows: slices.Clone(rows), end: frameEnd})
}

func (h *hintLog) Release(b *prefetch.Barrier) {
	h.cfgMu.Lock()
	defer h.cfgMu.Unlock()
	h.released = append(h.released, b)
}

func (h *hintLog) Config() prefetch.Config {
	h.cfgMu.Lock()
	defer h.cfgMu.Unlock()
	return h.cfg
}

func (h *hintLog) setDecodeQueuePages(n int) {
	h.cfgMu.Lock()
	defer h.cfgMu.Unlock()
	h.cfg.DecodeQueuePages = n
}

// The control file admits the daemon's own user only, whatever the open
// flags, and opens as a direct-io stream with parallel writes.
func TestControlOpen(t *testing.T) {
	tr := newTree(t, treeConfig{hints: newHintLog()})
	node := tr.node(controlPath)
	other := tr.caller
	other.Uid++
	root := tr.caller
	root.Uid, root.Gid = 0, 0
	otherGroup := tr.caller
	otherGroup.Gid++
	const want = fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES | fuse.FOPEN_STREAM
	for _, flags := range []uint32{syscall.O_WRONLY, syscall.O_RDWR, syscall.O_RDONLY, syscall.O_WRONLY | syscall.O_TRUNC, syscall.O_WRONLY | syscall.O_APPEND} {
		oo := tr.open(node, flags)
		if oo.OpenFlags&want != want || oo.OpenFlags&fuse.FOPEN_KEEP_CACHE != 0 {
			t.Errorf("open %#o: flags %#x, want %#x and no KEEP_CACHE", flags, oo.OpenFlags, want)
		}
		if oo.Fh == 0 {
			t.Errorf("open %#o: no file handle: the handle's stream and barrier need one", flags)
		}
		// The owner is the uid: another group of the same user may open.
		if oo, s := tr.openAs(otherGroup, node, flags); s != fuse.OK {
			t.Errorf("open %#o by the daemon's uid in another group: %v, want OK", flags, s)
		} else {
			tr.raw.Release(nil, &fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: oo.Fh})
		}
		if _, s := tr.openAs(other, node, flags); s != fuse.EACCES {
			t.Errorf("open %#o by uid %d: %v, want EACCES", flags, other.Uid, s)
		}
		if tr.caller.Uid != 0 {
			if _, s := tr.openAs(root, node, flags); s != fuse.EACCES {
				t.Errorf("open %#o by root of a daemon run as uid %d: %v, want EACCES", flags, tr.caller.Uid, s)
			}
		}
	}
}

// `echo ... > control` truncates first: a truncate to 0 succeeds and
// changes nothing; every other change fails with EROFS.
func TestControlSetattr(t *testing.T) {
	tr := newTree(t, treeConfig{})
	node := tr.node(controlPath)
	h := tr.hdr(node)
	before, _ := tr.getattr(node)
	for _, c := range []struct {
		name  string
		valid uint32
		mode  uint32
		size  uint64
		want  fuse.Status
	}{
		{"truncate to 0", fuse.FATTR_SIZE, 0, 0, fuse.OK},
		{"O_TRUNC open's truncate", fuse.FATTR_SIZE | fuse.FATTR_FH | fuse.FATTR_LOCKOWNER | fuse.FATTR_MTIME | fuse.FATTR_CTIME, 0, 0, fuse.OK},
		{"truncate to 0, mtime now", fuse.FATTR_SIZE | fuse.FATTR_MTIME_NOW, 0, 0, fuse.OK},
		{"truncate to 1", fuse.FATTR_SIZE, 0, 1, fuse.EROFS},
		{"truncate to 0 and chmod", fuse.FATTR_SIZE | fuse.FATTR_MODE, 0o666, 0, fuse.EROFS},
		{"truncate to 0 and chown", fuse.FATTR_SIZE | fuse.FATTR_UID, 0, 0, fuse.EROFS},
		{"chmod", fuse.FATTR_MODE, 0o666, 0, fuse.EROFS},
		{"utimes", fuse.FATTR_MTIME | fuse.FATTR_ATIME, 0, 0, fuse.EROFS},
		{"chown", fuse.FATTR_UID | fuse.FATTR_GID, 0, 0, fuse.EROFS},
	} {
		var ao fuse.AttrOut
		s := tr.raw.SetAttr(nil, setattrIn(h, c.valid, c.mode, c.size), &ao)
		if s != c.want {
			t.Errorf("%s: %v, want %v", c.name, s, c.want)
		}
		if s == fuse.OK && ao.Attr.Size != ControlSize {
			t.Errorf("%s: reply says size %d, want %d", c.name, ao.Size, ControlSize)
		}
	}
	if s := tr.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: h, Size: 1}, "user.x", []byte("1")); s != fuse.EROFS {
		t.Errorf("setxattr: %v, want EROFS", s)
	}
	if s := tr.raw.RemoveXAttr(nil, &h, "user.x"); s != fuse.EROFS {
		t.Errorf("removexattr: %v, want EROFS", s)
	}
	if after, _ := tr.getattr(node); after.Attr != before.Attr {
		t.Errorf("attributes changed from %+v to %+v", before.Attr, after.Attr)
	}
}

// Frames written to a handle reach the Hinter with that handle's barrier,
// text and binary, whole or split across writes; they are counted.
func TestControlWritesReachHinter(t *testing.T) {
	hl := newHintLog()
	tr := newTree(t, treeConfig{hints: hl})
	node := tr.node(controlPath)
	fhA := tr.open(node, syscall.O_WRONLY).Fh
	fhB := tr.open(node, syscall.O_WRONLY).Fh
	mustWrite := func(fh uint64, data []byte) {
		t.Helper()
		if n, s := tr.write(node, fh, 0, data); s != fuse.OK || int(n) != len(data) {
			t.Fatalf("write %q: %d bytes, %v; want %d, OK", data, n, s, len(data))
		}
	}

	mustWrite(fhA, []byte("decode 0 1 2 3\n# a comment\nprefill 1 1000\n"))
	bin := hints.AppendBinary(nil, hints.Prefill, 1, []uint64{5, 6, 7, 999})
	mustWrite(fhB, bin[:5])   // part of the header
	mustWrite(fhB, bin[5:20]) // the rest of it and one row
	mustWrite(fhB, bin[20:])  // the other rows
	mustWrite(fhA, []byte("# only a comment\n"))

	parts := hl.take()
	if len(parts) < 3 {
		t.Fatalf("hinter got %d parts: %+v", len(parts), parts)
	}
	bA := parts[0].b
	if bA == nil || parts[1].b != bA {
		t.Fatalf("frames of one handle came with barriers %p and %p", parts[0].b, parts[1].b)
	}
	if p := parts[0]; p.class != hints.Decode || p.layer != 0 || !slices.Equal(p.rows, []uint64{1, 2, 3}) || !p.end {
		t.Fatalf("first part %+v, want decode layer 0 rows [1 2 3], frame end", p)
	}
	if p := parts[1]; p.class != hints.Prefill || p.layer != 1 || !slices.Equal(p.rows, []uint64{1000}) || !p.end {
		t.Fatalf("second part %+v, want prefill layer 1 row 1000, frame end", p)
	}
	var rows []uint64
	for i, p := range parts[2:] {
		if p.b == bA || p.b == nil {
			t.Fatalf("a frame of handle B came with handle A's barrier (or none)")
		}
		if p.b != parts[2].b || p.class != hints.Prefill || p.layer != 1 || p.end != (i == len(parts)-3) {
			t.Fatalf("part %d of the split binary frame: %+v", i, p)
		}
		rows = append(rows, p.rows...)
	}
	if !slices.Equal(rows, []uint64{5, 6, 7, 999}) {
		t.Fatalf("split binary frame delivered rows %v", rows)
	}
	if f, r := tr.st.HintFrames.Load(), tr.st.HintRows.Load(); f != 3 || r != 8 {
		t.Fatalf("counted %d frames of %d rows, want 3 of 8", f, r)
	}
}

// A bad frame fails the write that delivers its first bad field with
// EINVAL, after the good frames before it were taken; it is counted, and the
// handle's stream starts afresh with the next write.
func TestControlBadFrames(t *testing.T) {
	hl := newHintLog()
	tr := newTree(t, treeConfig{hints: hl})
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_WRONLY).Fh
	rows := tr.spec.Rows
	badBinary := hints.AppendBinary(nil, hints.Decode, 0, []uint64{1})
	badBinary[4] = 7 // class
	for i, bad := range [][]byte{
		[]byte("decode 2 1\n"),                  // no such layer
		fmt.Appendf(nil, "decode 0 %d\n", rows), // past the last row
		[]byte("fetch 0 1\n"),
		[]byte("decode 0 x\n"),
		[]byte("EGH2\x01\x00\x00\x00\x01\x00\x00\x00"),
		badBinary,
		hints.AppendBinary(nil, hints.Prefill, 0, []uint64{rows}),
	} {
		if n, s := tr.write(node, fh, 0, bad); s != fuse.EINVAL {
			t.Errorf("write %q: %d, %v; want EINVAL", bad, n, s)
		}
		if got := tr.st.HintRejected.Load(); got != uint64(i+1) {
			t.Errorf("after %d bad frames, %d counted", i+1, got)
		}
		// The stream was reset: a good frame is taken whole.
		good := hints.AppendText(nil, hints.Decode, 1, []uint64{uint64(i)})
		if n, s := tr.write(node, fh, 0, good); s != fuse.OK || int(n) != len(good) {
			t.Fatalf("good frame after bad %q: %d, %v", bad, n, s)
		}
	}
	hl.take()
	// Frames before the bad field are taken.
	if _, s := tr.write(node, fh, 0, []byte("decode 0 10\ndecode 1 20 99999999\ndecode 0 30\n")); s != fuse.EINVAL {
		t.Fatalf("write with a bad second frame: %v, want EINVAL", s)
	}
	var got [][]uint64
	for _, p := range hl.take() {
		got = append(got, p.rows)
	}
	if len(got) == 0 || !slices.Equal(got[0], []uint64{10}) || slices.ContainsFunc(got, func(r []uint64) bool { return slices.Contains(r, 30) }) {
		t.Fatalf("hinter got %v: want the frame before the bad one, nothing after it", got)
	}
}

// While a handle's decode backlog is full, a write that starts a frame is
// refused with EAGAIN before anything of it is taken; a frame already begun
// is finished. Without a Hinter nothing is refused.
func TestControlBackpressure(t *testing.T) {
	hl := newHintLog()
	tr := newTree(t, treeConfig{hints: hl})
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_WRONLY).Fh
	frame := hints.AppendBinary(nil, hints.Decode, 0, []uint64{1, 2})
	if _, s := tr.write(node, fh, 0, frame[:14]); s != fuse.OK {
		t.Fatalf("first half of a frame: %v", s)
	}
	hl.setDecodeQueuePages(0) // every backlog is full now
	if n, s := tr.write(node, fh, 0, frame[14:]); s != fuse.OK || int(n) != len(frame)-14 {
		t.Fatalf("second half of a begun frame: %d, %v; want it taken", n, s)
	}
	hl.take()
	if n, s := tr.write(node, fh, 0, frame); s != fuse.EAGAIN {
		t.Fatalf("new frame with a full backlog: %d, %v; want EAGAIN", n, s)
	}
	if p := hl.take(); len(p) != 0 {
		t.Fatalf("a refused write reached the hinter: %+v", p)
	}
	if r, f := tr.st.HintRefused.Load(), tr.st.HintFrames.Load(); r != 1 || f != 1 {
		t.Fatalf("refused %d, frames %d; want 1 and 1", r, f)
	}
	hl.setDecodeQueuePages(1 << 16)
	if _, s := tr.write(node, fh, 0, frame); s != fuse.OK {
		t.Fatalf("the same frame once there is room: %v", s)
	}

	bare := newTree(t, treeConfig{})
	n2 := bare.node(controlPath)
	fh2 := bare.open(n2, syscall.O_RDWR).Fh
	if _, s := bare.write(n2, fh2, 0, frame); s != fuse.OK {
		t.Fatalf("write without a hinter: %v", s)
	}
	if bare.st.HintFrames.Load() != 1 {
		t.Fatal("a frame written without a hinter is not counted")
	}
	if b, s := bare.read(n2, fh2, 0, 4096); s != fuse.OK || len(b) != 0 {
		t.Fatalf("barrier without a hinter: %q, %v; want 0 bytes at once", b, s)
	}
}

// pushLog is a prefetch.Pusher that keeps what it stores, fails when told,
// and can hold every store until released.
type pushLog struct {
	mu     sync.Mutex
	stores []pushed
	fail   error
	hold   chan struct{} // nil: do not wait
}

type pushed struct {
	table uint32
	off   int64
	data  []byte
}

func (p *pushLog) Store(table uint32, off int64, data []byte) error {
	p.mu.Lock()
	hold, fail := p.hold, p.fail
	p.mu.Unlock()
	if hold != nil {
		<-hold
	}
	if fail != nil {
		return fail
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stores = append(p.stores, pushed{table, off, slices.Clone(data)})
	return nil
}

// prefetchTree serves a tree whose control file feeds a real prefetcher
// that pushes into pl instead of the page cache.
func prefetchTree(t *testing.T, pl *pushLog) *tree {
	t.Helper()
	h := &lateHinter{}
	tr := newTree(t, treeConfig{hints: h})
	p := prefetch.New(prefetch.Config{InflightPages: 16, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: 1 << 16},
		tr.model, tr.loader, pl, nil, tr.st, nil)
	h.HintSink = p
	t.Cleanup(p.Close)
	return tr
}

// lateHinter lets the prefetcher be built after the tree (it needs the
// tree's model and loader).
type lateHinter struct{ HintSink }

// rowPages are the file pages that rows of layer span, in every table of
// that layer, computed from the table files' own headers.
func rowPages(t *testing.T, tr *tree, layer int, rows []uint64) map[[2]uint64]bool {
	t.Helper()
	out := map[[2]uint64]bool{}
	for _, tb := range tr.model.LayerTables(layer) {
		_, _, want := tableOracle(t, tr, tb)
		hdrLen := uint64(int64(len(want)) - tb.DataLen)
		rowBytes := uint64(tb.DataLen) / tr.spec.Rows
		for _, r := range rows {
			for p := (hdrLen + r*rowBytes) / page; p <= (hdrLen+(r+1)*rowBytes-1)/page; p++ {
				out[[2]uint64{uint64(tb.ID), p}] = true
			}
		}
	}
	return out
}

// readBarrier reads the barrier of handle fh and parses its line, which
// must hold the counts alone.
func readBarrier(t *testing.T, tr *tree, node, fh uint64) map[string]uint64 {
	t.Helper()
	var st map[string]uint64
	readBarrierInto(t, tr, node, fh, &st)
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range st {
			if !yield(k) {
				return
			}
		}
	})
	if !slices.Equal(keys, []string{"cached", "dropped", "failed", "frames", "pages", "pinned", "resident"}) {
		t.Fatalf("barrier fields %v, want cached dropped failed frames pages pinned resident", keys)
	}
	return st
}

// read(2) on a control handle is its barrier: it returns once the hinted
// pages are stored, with one JSON line of counts, and nothing on the next
// read; the pages stored are the table files' own bytes. A buffer too small
// for the line is EINVAL.
func TestControlReadBarrier(t *testing.T) {
	pl := &pushLog{}
	tr := prefetchTree(t, pl)
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_RDWR).Fh
	if b, s := tr.read(node, fh, 0, 4096); s != fuse.OK || len(b) != 0 {
		t.Fatalf("barrier with nothing written: %q, %v; want 0 bytes", b, s)
	}
	rows := []uint64{3, 500, 501, tr.spec.Rows - 1}
	want := rowPages(t, tr, 0, rows)
	if _, s := tr.write(node, fh, 0, hints.AppendText(nil, hints.Decode, 0, rows)); s != fuse.OK {
		t.Fatal(s)
	}
	if _, s := tr.read(node, fh, 0, statusLineMax-1); s != fuse.EINVAL {
		t.Fatalf("barrier into %d bytes: %v, want EINVAL", statusLineMax-1, s)
	}
	st := readBarrier(t, tr, node, fh)
	n := uint64(len(want))
	if st["frames"] != 1 || st["pages"] != n || st["resident"] != n || st["failed"] != 0 || st["dropped"] != 0 || st["pinned"] != 0 {
		t.Fatalf("barrier %v, want 1 frame, %d pages all resident", st, n)
	}
	if b, s := tr.read(node, fh, 0, 4096); s != fuse.OK || len(b) != 0 {
		t.Fatalf("second barrier: %q, %v; want 0 bytes", b, s)
	}
	// What was pushed is what a READ of the table file returns.
	pl.mu.Lock()
	stores := slices.Clone(pl.stores)
	pl.mu.Unlock()
	got := map[[2]uint64]bool{}
	for _, s := range stores {
		if s.off%page != 0 {
			t.Fatalf("store at unaligned offset %d", s.off)
		}
		tb := tr.model.Tables[s.table]
		fnode := tr.node(tablePath(tb))
		fileBytes := tr.mustRead(fnode, tr.open(fnode, syscall.O_RDONLY).Fh, s.off, len(s.data))
		if !bytes.Equal(fileBytes, s.data) {
			t.Fatalf("table %s: pushed %d bytes at %d that differ from the file's", tb.Name, len(s.data), s.off)
		}
		for p := s.off / page; p < (s.off+int64(len(s.data))+page-1)/page; p++ {
			got[[2]uint64{uint64(s.table), uint64(p)}] = true
		}
	}
	if len(got) != len(want) {
		t.Fatalf("pushed pages %v, want %v", got, want)
	}
	for k := range want {
		if !got[k] {
			t.Fatalf("page %v was not pushed (pushed %v)", k, got)
		}
	}
}

// A barrier waits for its own handle only, and a signal (the request's
// cancel) ends the wait with EINTR, keeping the counts for the next one.
func TestControlBarrierPerHandleAndInterrupt(t *testing.T) {
	pl := &pushLog{hold: make(chan struct{})}
	tr := prefetchTree(t, pl)
	released := false
	release := func() {
		if !released {
			released = true
			close(pl.hold)
		}
	}
	t.Cleanup(release)
	node := tr.node(controlPath)
	fhA := tr.open(node, syscall.O_RDWR).Fh
	fhB := tr.open(node, syscall.O_RDWR).Fh
	if _, s := tr.write(node, fhA, 0, []byte("decode 1 7\n")); s != fuse.OK {
		t.Fatal(s)
	}
	// B has nothing pending: its barrier answers while A's pages are held.
	done := make(chan []byte, 1)
	go func() {
		b, _ := tr.read(node, fhB, 0, 4096)
		done <- b
	}()
	select {
	case b := <-done:
		if len(b) != 0 {
			t.Fatalf("barrier of an idle handle: %q, want 0 bytes", b)
		}
	case <-time.After(time.Minute):
		t.Fatal("the barrier of an idle handle waited for another handle's pages")
	}
	// A's barrier, interrupted.
	cancel := make(chan struct{})
	close(cancel)
	in := fuse.ReadIn{InHeader: tr.hdr(node), Fh: fhA, Size: 4096}
	if _, s := tr.raw.Read(cancel, &in, make([]byte, 4096)); s != fuse.Status(syscall.EINTR) {
		t.Fatalf("interrupted barrier: %v, want EINTR", s)
	}
	release()
	st := readBarrier(t, tr, node, fhA)
	if st["frames"] != 1 || st["pages"] == 0 || st["resident"] != st["pages"] {
		t.Fatalf("barrier after the interrupted one: %v, want the frame's counts", st)
	}
}

// fsync waits as the barrier does and fails with EIO when pages failed since
// the previous barrier.
func TestControlFsync(t *testing.T) {
	pl := &pushLog{fail: errors.New("injected store failure")}
	tr := prefetchTree(t, pl)
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_RDWR).Fh
	fsync := func() fuse.Status {
		return tr.raw.Fsync(nil, &fuse.FsyncIn{InHeader: tr.hdr(node), Fh: fh})
	}
	if s := fsync(); s != fuse.OK {
		t.Fatalf("fsync with nothing written: %v", s)
	}
	if _, s := tr.write(node, fh, 0, []byte("decode 0 1 2\n")); s != fuse.OK {
		t.Fatal(s)
	}
	if s := fsync(); s != fuse.EIO {
		t.Fatalf("fsync after failed stores: %v, want EIO", s)
	}
	if s := fsync(); s != fuse.OK {
		t.Fatalf("fsync with nothing new: %v, want OK", s)
	}
	pl.mu.Lock()
	pl.fail = nil
	pl.mu.Unlock()
	if _, s := tr.write(node, fh, 0, []byte("decode 0 1 2\n")); s != fuse.OK {
		t.Fatal(s)
	}
	if s := fsync(); s != fuse.OK {
		t.Fatalf("fsync after good stores: %v, want OK", s)
	}
}

// The stats file is one JSON document of the counters, taken at open: a
// handle reads one consistent snapshot in any chunks; a new open sees new
// values.
func TestStatsFile(t *testing.T) {
	tr := newTree(t, treeConfig{})
	node := tr.node(".engramfs/stats")
	tr.st.HintFrames.Store(41)
	fh := tr.open(node, syscall.O_RDONLY).Fh
	tr.st.HintFrames.Store(42)
	whole := tr.readAll(node, fh, 1<<16)
	var snap stats.Snapshot
	if err := json.Unmarshal(whole, &snap); err != nil {
		t.Fatalf("stats: %v\n%s", err, whole)
	}
	if snap.HintFrames != 41 {
		t.Fatalf("stats read through a handle opened at 41 frames says %d", snap.HintFrames)
	}
	if chunks := tr.readAll(node, fh, 7); !bytes.Equal(chunks, whole) {
		t.Fatalf("stats read in 7-byte chunks differs from one read")
	}
	if b := tr.mustRead(node, fh, int64(len(whole)), 100); len(b) != 0 {
		t.Fatalf("read at the end of the stats: %q", b)
	}
	fh2 := tr.open(node, syscall.O_RDONLY).Fh
	if err := json.Unmarshal(tr.readAll(node, fh2, 1<<16), &snap); err != nil || snap.HintFrames != 42 {
		t.Fatalf("a new open says %d frames (%v), want 42", snap.HintFrames, err)
	}
	var generic map[string]any
	if err := json.Unmarshal(whole, &generic); err != nil || generic["fuse_reads"] == nil || generic["hint_frames"] == nil {
		t.Fatalf("stats lacks fuse_reads or hint_frames: %s", whole)
	}
}

// gatedTree serves a flash tree of rows rows whose backing reads wait for
// gate to close, with a real prefetcher (cfg) behind its control file that
// pushes into a pushLog; reads counts the backing reads' pages.
func gatedTree(t *testing.T, rows uint64, cfg prefetch.Config) (tr *tree, gate chan struct{}, p *prefetch.Prefetcher, reads *atomic.Int64) {
	t.Helper()
	gate = make(chan struct{})
	reads = &atomic.Int64{}
	h := &lateHinter{}
	tr = newTree(t, treeConfig{flash: true, rows: rows, hints: h, reader: func() backing.Reader {
		return backing.ReaderFunc(func(_ *backing.Table, _ int64, n int) ([]byte, error) {
			<-gate
			reads.Add(int64(n+cache.PageSize-1) / cache.PageSize)
			return make([]byte, n), nil
		})
	}})
	p = prefetch.New(cfg, tr.model, tr.loader, &pushLog{}, nil, tr.st, nil)
	h.HintSink = p
	t.Cleanup(p.Close)
	t.Cleanup(func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	})
	return tr, gate, p, reads
}

// A decode frame larger than --decode-queue is taken a write at a time as
// the backlog has room: a write that continues it while the backlog is
// full waits (a signal ends the wait with EINTR, nothing of the write
// taken), so the handle never holds more than the bound and one write's
// pages. Prefill frames are never refused on a full decode backlog.
func TestControlDecodeFrameWaitsForRoom(t *testing.T) {
	const bound = 256
	tr, gate, _, _ := gatedTree(t, 100_000, prefetch.Config{InflightPages: 16, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: bound})
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_RDWR).Fh
	rows := make([]uint64, 60_000)
	for i := range rows {
		rows[i] = uint64(i)
	}
	frame := hints.AppendBinary(nil, hints.Decode, 0, rows)
	first := 12 + 8*10_000 // the header and 10,000 rows: 625 weight pages and 20 scale pages
	if _, s := tr.write(node, fh, 0, frame[:first]); s != fuse.OK {
		t.Fatalf("first write of the frame: %v", s)
	}
	queued := tr.st.PrefetchPagesQueued.Load()
	if queued < bound {
		t.Fatalf("%d pages queued by the first write; the test needs more than %d", queued, bound)
	}

	// The backing reads wait, so the backlog cannot drain: the next
	// write of the frame waits; interrupted, it fails with EINTR and
	// takes nothing.
	interrupted := make(chan struct{})
	close(interrupted)
	in := fuse.WriteIn{InHeader: tr.hdr(node), Fh: fh, Size: uint32(len(frame) - first)}
	if n, s := tr.raw.Write(interrupted, &in, frame[first:]); s != fuse.Status(syscall.EINTR) {
		t.Fatalf("continuing a decode frame over a full backlog: %d, %v; want EINTR (%d pages queued now, bound %d)",
			n, s, tr.st.PrefetchPagesQueued.Load(), bound)
	}
	if q := tr.st.PrefetchPagesQueued.Load(); q != queued {
		t.Fatalf("%d pages queued after the interrupted write, want %d: it took rows", q, queued)
	}
	// The interrupted frame is over (the kernel reported a short write):
	// the next write starts a new frame.
	frames := tr.st.HintFrames.Load()
	if _, s := tr.write(node, fh, 0, hints.AppendBinary(nil, hints.Prefill, 0, rows[:3])); s != fuse.OK || tr.st.HintFrames.Load() != frames+1 {
		t.Fatalf("a frame after the interrupted one: %v, %d frames (was %d); want it taken whole", s, tr.st.HintFrames.Load(), frames)
	}

	// A handle whose decode backlog is full between frames: its next
	// decode frame is refused with EAGAIN, its prefill frames never are.
	fh2 := tr.open(node, syscall.O_RDWR).Fh
	if _, s := tr.write(node, fh2, 0, hints.AppendBinary(nil, hints.Decode, 0, rows[20_000:30_000])); s != fuse.OK {
		t.Fatalf("a whole decode frame on a second handle: %v", s)
	}
	if n, s := tr.write(node, fh2, 0, hints.AppendBinary(nil, hints.Decode, 0, rows[40_000:40_001])); s != fuse.EAGAIN {
		t.Fatalf("a decode frame on a full backlog: %d, %v; want EAGAIN", n, s)
	}
	for _, f := range [][]byte{hints.AppendBinary(nil, hints.Prefill, 0, rows[50_000:50_010]), []byte("prefill 0 51000 51001\n")} {
		if n, s := tr.write(node, fh2, 0, f); s != fuse.OK || int(n) != len(f) {
			t.Fatalf("a prefill frame on a full decode backlog: %d, %v; want it taken (prefill is never refused)", n, s)
		}
	}

	// Once the reads go on, a frame's later write waits for room and is
	// taken.
	fh3 := tr.open(node, syscall.O_RDWR).Fh
	if _, s := tr.write(node, fh3, 0, frame[:first]); s != fuse.OK {
		t.Fatalf("first write of a frame on a third handle: %v", s)
	}
	close(gate)
	done := make(chan fuse.Status, 1)
	go func() {
		in := fuse.WriteIn{InHeader: tr.hdr(node), Fh: fh3, Size: uint32(len(frame) - first)}
		_, s := tr.raw.Write(nil, &in, frame[first:])
		done <- s
	}()
	select {
	case s := <-done:
		if s != fuse.OK {
			t.Fatalf("the rest of the frame once the backlog drains: %v", s)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the rest of the frame was not taken within 30 s of the backlog draining")
	}
}

// Control handles are bounded (ENFILE past --control-handles, counted), and
// a released handle frees its slot and tells the hinter.
func TestControlHandlesAreBounded(t *testing.T) {
	hl := newHintLog()
	tr := newTree(t, treeConfig{hints: hl})
	tr.root.o.ControlHandles = 3
	node := tr.node(controlPath)
	first, _ := tr.openAs(tr.caller, node, syscall.O_RDWR) // released below
	tr.open(node, syscall.O_RDWR)
	tr.open(node, syscall.O_RDWR)
	if _, s := tr.openAs(tr.caller, node, syscall.O_RDWR); s != fuse.Status(syscall.ENFILE) {
		t.Fatalf("open past --control-handles: %v, want ENFILE", s)
	}
	if n, r := tr.st.ControlHandles.Load(), tr.st.ControlHandlesRefused.Load(); n != 3 || r != 1 {
		t.Fatalf("control_handles %d, control_handles_refused %d; want 3 and 1", n, r)
	}
	tr.raw.Release(nil, &fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: first.Fh})
	if n := tr.st.ControlHandles.Load(); n != 2 {
		t.Fatalf("control_handles %d after a release, want 2", n)
	}
	hl.cfgMu.Lock()
	released := len(hl.released)
	hl.cfgMu.Unlock()
	if released != 1 {
		t.Fatalf("%d releases reached the hinter, want 1", released)
	}
	tr.open(node, syscall.O_RDWR)
}

// Closing a handle drops the work it queued that nobody else waits for
// (a killed process's prefill is not fetched for nobody), counted in
// prefetch_pages_released; pages another handle waits for too are still
// fetched for it.
func TestControlReleaseDropsQueuedWork(t *testing.T) {
	tr, gate, _, reads := gatedTree(t, 100_000, prefetch.Config{InflightPages: 16, Pushers: 1, PrefillQueuePages: 1 << 16, DecodeQueuePages: 1 << 16})
	node := tr.node(controlPath)
	a, _ := tr.openAs(tr.caller, node, syscall.O_RDWR)
	b := tr.open(node, syscall.O_RDWR).Fh
	rows := make([]uint64, 10_000)
	for i := range rows {
		rows[i] = uint64(i)
	}
	if _, s := tr.write(node, a.Fh, 0, hints.AppendBinary(nil, hints.Prefill, 0, rows)); s != fuse.OK {
		t.Fatal(s)
	}
	shared := rows[4992:5008] // one weight page and one scale page of a's
	if _, s := tr.write(node, b, 0, hints.AppendBinary(nil, hints.Prefill, 0, shared)); s != fuse.OK {
		t.Fatal(s)
	}
	queued := tr.st.PrefetchPagesQueued.Load() // a's pages; b's were queued already
	tr.raw.Release(nil, &fuse.ReleaseIn{InHeader: tr.hdr(node), Fh: a.Fh})
	released := tr.st.PrefetchPagesReleased.Load()
	// At most the in-flight budget was claimed (reads wait at the gate),
	// and b's two pages stay queued for b.
	if least := queued - 16 - 2; released < least || released > queued-2 {
		t.Fatalf("%d pages released of %d queued; want %d to %d", released, queued, least, queued-2)
	}
	close(gate)
	done := make(chan map[string]uint64, 1)
	go func() { done <- readBarrier(t, tr, node, b) }()
	select {
	case st := <-done:
		if st["pages"] != 2 || st["resident"] != 2 {
			t.Fatalf("b's barrier: %v; want its 2 pages resident", st)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("b's barrier did not return within 30 s: its shared pages were dropped with a's")
	}
	if r := uint64(reads.Load()); r+released > queued {
		t.Fatalf("%d pages read and %d released of %d queued: released pages were fetched", r, released, queued)
	}
}

// readStatus reads one barrier's line into a hints.Status.
func readStatus(t *testing.T, tr *tree, node, fh uint64) hints.Status {
	t.Helper()
	var st hints.Status
	readBarrierInto(t, tr, node, fh, &st)
	return st
}

// readBarrierInto reads the barrier of handle fh: one line of JSON, decoded
// into v.
func readBarrierInto(t *testing.T, tr *tree, node, fh uint64, v any) {
	t.Helper()
	b := tr.mustRead(node, fh, 0, 4096)
	if len(b) == 0 || b[len(b)-1] != '\n' || bytes.Count(b, []byte("\n")) != 1 {
		t.Fatalf("barrier: %q, want one line of JSON", b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("barrier line %q: %v", b, err)
	}
}

// A write's EINVAL carries no text: the next barrier's status line says why
// the frame was rejected, and why pages failed; both when both happened.
func TestControlBarrierSaysWhy(t *testing.T) {
	pl := &pushLog{}
	tr := prefetchTree(t, pl)
	node := tr.node(controlPath)
	fh := tr.open(node, syscall.O_RDWR).Fh
	rows := tr.spec.Rows
	rejected := fmt.Sprintf("row %d out of range (layer 0 has %d rows)", rows+7, rows)

	if _, s := tr.write(node, fh, 0, hints.AppendBinary(nil, hints.Decode, 0, []uint64{rows + 7})); s != fuse.EINVAL {
		t.Fatalf("write of a row out of range: %v, want EINVAL", s)
	}
	st := readStatus(t, tr, node, fh)
	if !strings.HasSuffix(st.Error, rejected) || st.Frames != 0 || st.Failed != 0 {
		t.Fatalf("barrier after a rejected frame: %+v; want its reason %q", st, rejected)
	}
	if b, s := tr.read(node, fh, 0, 4096); s != fuse.OK || len(b) != 0 {
		t.Fatalf("the barrier after: %q, %v; want 0 bytes (the reason is said once)", b, s)
	}

	// A good frame, then a bad one: the counts and the reason.
	if _, s := tr.write(node, fh, 0, []byte("decode 0 1\ndecode 9 1\n")); s != fuse.EINVAL {
		t.Fatalf("write with a bad second frame: %v, want EINVAL", s)
	}
	st = readStatus(t, tr, node, fh)
	if st.Frames != 1 || st.Resident == 0 || !strings.Contains(st.Error, "layer 9: unknown layer") {
		t.Fatalf("barrier: %+v; want one frame resident and the unknown layer", st)
	}

	// Failed stores say why, after the reason of the rejected frame.
	pl.mu.Lock()
	pl.fail = errors.New("injected store failure")
	pl.mu.Unlock()
	if _, s := tr.write(node, fh, 0, hints.AppendBinary(nil, hints.Decode, 1, []uint64{2, 3})); s != fuse.OK {
		t.Fatal(s)
	}
	if _, s := tr.write(node, fh, 0, []byte("decode 1 x\n")); s != fuse.EINVAL {
		t.Fatalf("write of a bad row: %v, want EINVAL", s)
	}
	st = readStatus(t, tr, node, fh)
	first, pages, ok := strings.Cut(st.Error, "; ")
	if st.Failed == 0 || !ok || !strings.Contains(first, `text: bad row "x"`) ||
		!strings.HasPrefix(pages, "pages failed: table ") || !strings.HasSuffix(pages, "injected store failure") {
		t.Fatalf("barrier: %+v; want the rejected frame's reason, then the failed pages'", st)
	}
}

// A reason too long for the reader's buffer is cut short; the counts and
// the JSON stay whole.
func TestStatusLineFitsTheRead(t *testing.T) {
	st := prefetch.Status{Frames: math.MaxUint64, Pages: math.MaxUint64, Resident: 1, Failed: math.MaxUint64}
	for _, reason := range []string{strings.Repeat("é", 300), strings.Repeat(`"\`, 300), strings.Repeat("\x01", 300), "short"} {
		st.Error = reason
		for _, max := range []int{statusLineMax, 300, 4096} {
			line, err := statusLine(st, max)
			if err != nil {
				t.Fatal(err)
			}
			var back prefetch.Status
			if err := json.Unmarshal(line, &back); err != nil || len(line) > max || line[len(line)-1] != '\n' {
				t.Fatalf("line %q (%d bytes) for a read of %d: %v", line, len(line), max, err)
			}
			if back.Frames != st.Frames || back.Failed != st.Failed || back.Resident != 1 ||
				!utf8.ValidString(back.Error) || back.Error == "" {
				t.Fatalf("line %q: counts or reason lost", line)
			}
			if len(reason) < 10 && back.Error != reason || len(reason) > 10 && max < 1000 && !strings.HasSuffix(back.Error, "...") {
				t.Fatalf("reason %q became %q in a read of %d", reason[:10], back.Error, max)
			}
		}
	}
}

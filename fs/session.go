package fs

// The kernel's file handle numbers, across daemons.
//
// The kernel names an open file by the number the daemon gave it at OPEN,
// for as long as the file stays open, whichever daemon serves by then.
// go-fuse hands out small numbers from 1, reuses a freed one first (LIFO),
// and indexes a slice with the number a request carries (an unknown one
// panics). A daemon that took a mount over after a crash knows none of the
// numbers the kernel still holds (orphans), and go-fuse's numbering would
// give its first opens the orphans' numbers: a read on an orphan of a shard
// would read another file through the new handle's backing file, and the
// orphan's release would release the new handle.
//
// So the kernel never sees go-fuse's numbers: sessionFS gives it
// generation<<32 | go-fuse's number, the generation the daemon's own
// (random, never 0, never one a predecessor handed over), and maps every
// number a request carries back. A number of its own generation it does not
// know answers EBADF. A number of another generation is a predecessor's:
// handed over, it was reopened under that number before the first request
// (replay); an orphan is reopened on first use (adopt) on the node the
// request names, as a reader's open, and released with it. An orphan of
// the control file answers EBADF instead: its hint stream died with the
// daemon, and the clients reopen on EBADF. A handle is bound to its node: a
// request naming another node with it answers EBADF, so handles are never
// confused across files.

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// reopenFunc says how the daemon opens, for the kernel's holder, a handle
// it did not open itself: the caller and open flags to use, or false when
// the node's handles must not be reopened. orphan: a crash left the
// handle, nobody handed it over.
type reopenFunc func(node uint64, orphan bool) (caller fuse.Caller, flags uint32, ok bool)

// sessionFS is the tree's raw file system as go-fuse serves it, with what
// a handover needs on top: the kernel's handle numbers (above) with the
// node each was opened on, and every node's lookup count as far as this
// daemon gave them, so a FORGET of a count given to a predecessor never
// underflows go-fuse's (a panic there). Every method of
// fuse.RawFileSystem that carries or returns a handle number is wrapped
// here: none reaches go-fuse with the kernel's number.
type sessionFS struct {
	fuse.RawFileSystem
	reopen reopenFunc // nil: nothing is reopened; set before serving

	adoptMu sync.Mutex // one adoption at a time: two faults on one orphan open it once

	mu      sync.Mutex
	gen     uint64            // GUARDED_BY(mu): the high half of every number this daemon gives
	handles map[uint64]handle // GUARDED_BY(mu): by the kernel's number
	lookups map[uint64]uint64 // GUARDED_BY(mu): by node ID
}

// handle is one number the kernel holds, as this daemon serves it.
type handle struct {
	inner uint64 // go-fuse's number
	node  uint64
	dir   bool
}

func newSessionFS(inner fuse.RawFileSystem) *sessionFS {
	return &sessionFS{RawFileSystem: inner, gen: newGeneration(nil),
		handles: map[uint64]handle{}, lookups: map[uint64]uint64{}}
}

// newGeneration is a random generation, neither 0 nor one of taken.
func newGeneration(taken map[uint64]bool) uint64 {
	for {
		var b [4]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24)
		if g := uint64(binary.LittleEndian.Uint32(b[:])); g != 0 && !taken[g] {
			return g
		}
	}
}

// snapshot lists the handles the kernel holds, by the kernel's numbers.
func (f *sessionFS) snapshot() Session {
	f.mu.Lock()
	defer f.mu.Unlock()
	sess := Session{Handles: make([]Handle, 0, len(f.handles))}
	for fh, h := range f.handles {
		sess.Handles = append(sess.Handles, Handle{Fh: fh, Node: h.node, Dir: h.dir})
	}
	slices.SortFunc(sess.Handles, func(a, b Handle) int {
		if a.Fh < b.Fh {
			return -1
		}
		if a.Fh > b.Fh {
			return 1
		}
		return 0
	})
	return sess
}

// replay opens sess's handles again, each under the kernel's number for it
// (a handover), after moving this daemon's generation off every one sess
// uses. Before any request is read. A handle it could not reopen is left
// for adoption on first use; the error names the first.
func (f *sessionFS) replay(sess Session) error {
	taken := map[uint64]bool{}
	for _, h := range sess.Handles {
		taken[h.Fh>>32] = true
	}
	f.mu.Lock()
	if taken[f.gen] {
		f.gen = newGeneration(taken)
	}
	f.mu.Unlock()
	var first error
	for _, h := range sess.Handles {
		if h.Fh == 0 {
			continue
		}
		if err := f.reopenAs(h.Fh, h.Node, h.Dir, false); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// give records a handle go-fuse opened on node and returns the kernel's
// number for it (0, no handle, stays 0).
func (f *sessionFS) give(node, inner uint64, dir bool) uint64 {
	if inner == 0 {
		return 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fh := f.gen<<32 | inner
	f.handles[fh] = handle{inner: inner, node: node, dir: dir}
	return fh
}

// find is go-fuse's number for the kernel's fh on node, adopting an orphan;
// false: EBADF.
func (f *sessionFS) find(node, fh uint64, dir bool) (uint64, bool) {
	if fh == 0 {
		return 0, true
	}
	f.mu.Lock()
	h, ok := f.handles[fh]
	mine := fh>>32 == f.gen
	f.mu.Unlock()
	if ok {
		return h.inner, h.node == node
	}
	if mine {
		return 0, false
	}
	f.adoptMu.Lock()
	defer f.adoptMu.Unlock()
	f.mu.Lock()
	h, ok = f.handles[fh]
	f.mu.Unlock()
	if ok {
		return h.inner, h.node == node
	}
	if f.reopenAs(fh, node, dir, true) != nil {
		return 0, false
	}
	f.mu.Lock()
	h = f.handles[fh]
	f.mu.Unlock()
	return h.inner, true
}

// translate replaces the kernel's *fh on node by go-fuse's number; false:
// EBADF.
func (f *sessionFS) translate(node uint64, fh *uint64, dir bool) bool {
	inner, ok := f.find(node, *fh, dir)
	*fh = inner
	return ok
}

// reopenAs opens a handle on node and records it under the kernel's fh.
func (f *sessionFS) reopenAs(fh, node uint64, dir, orphan bool) error {
	if f.reopen == nil {
		return fmt.Errorf("handle %d (node %d): not reopened", fh, node)
	}
	caller, flags, ok := f.reopen(node, orphan)
	if !ok {
		return fmt.Errorf("handle %d (node %d): not reopened here", fh, node)
	}
	in := &fuse.OpenIn{InHeader: fuse.InHeader{NodeId: node, Caller: caller}, Flags: flags}
	var out fuse.OpenOut
	var st fuse.Status
	if dir {
		st = f.RawFileSystem.OpenDir(nil, in, &out)
	} else {
		st = f.RawFileSystem.Open(nil, in, &out)
	}
	if !st.Ok() {
		return fmt.Errorf("handle %d (node %d): reopening: %v", fh, node, st)
	}
	f.mu.Lock()
	f.handles[fh] = handle{inner: out.Fh, node: node, dir: dir}
	f.mu.Unlock()
	return nil
}

// drop forgets the kernel's fh on node and returns go-fuse's number to
// release; false: nothing of this daemon's to release (an orphan never
// used, or a number it does not know).
func (f *sessionFS) drop(node, fh uint64) (uint64, bool) {
	if fh == 0 {
		return 0, true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	h, ok := f.handles[fh]
	if !ok || h.node != node {
		return 0, false
	}
	delete(f.handles, fh)
	return h.inner, true
}

func (f *sessionFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	st := f.RawFileSystem.Lookup(cancel, h, name, out)
	if st.Ok() && out.NodeId != 0 {
		f.mu.Lock()
		f.lookups[out.NodeId]++
		f.mu.Unlock()
	}
	return st
}

func (f *sessionFS) Forget(node, nlookup uint64) {
	f.mu.Lock()
	n := min(nlookup, f.lookups[node])
	if f.lookups[node] -= n; f.lookups[node] == 0 {
		delete(f.lookups, node)
	}
	f.mu.Unlock()
	if n > 0 {
		f.RawFileSystem.Forget(node, n)
	}
}

// Opening: the kernel gets this daemon's numbers.

func (f *sessionFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.Open(cancel, in, out)
	if st.Ok() {
		out.Fh = f.give(in.NodeId, out.Fh, false)
	}
	return st
}

func (f *sessionFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := f.RawFileSystem.OpenDir(cancel, in, out)
	if st.Ok() {
		out.Fh = f.give(in.NodeId, out.Fh, true)
	}
	return st
}

func (f *sessionFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Create(cancel, in, name, out)
	if st.Ok() {
		out.Fh = f.give(out.NodeId, out.Fh, false)
	}
	return st
}

func (f *sessionFS) Tmpfile(cancel <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	st := f.RawFileSystem.Tmpfile(cancel, in, out)
	if st.Ok() {
		out.Fh = f.give(out.NodeId, out.Fh, false)
	}
	return st
}

// Releasing: go-fuse releases only what it opened.

func (f *sessionFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	if inner, ok := f.drop(in.NodeId, in.Fh); ok {
		in.Fh = inner
		f.RawFileSystem.Release(cancel, in)
	}
}

func (f *sessionFS) ReleaseDir(in *fuse.ReleaseIn) {
	if inner, ok := f.drop(in.NodeId, in.Fh); ok {
		in.Fh = inner
		f.RawFileSystem.ReleaseDir(in)
	}
}

// Everything else that carries a number: go-fuse's, or EBADF.

func (f *sessionFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return nil, fuse.EBADF
	}
	return f.RawFileSystem.Read(cancel, in, buf)
}

func (f *sessionFS) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return 0, fuse.EBADF
	}
	return f.RawFileSystem.Write(cancel, in, data)
}

func (f *sessionFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return 0, fuse.EBADF
	}
	return f.RawFileSystem.Writev(cancel, in, data)
}

func (f *sessionFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Flush(cancel, in)
}

func (f *sessionFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Fsync(cancel, in)
}

func (f *sessionFS) FsyncDir(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, true) {
		return fuse.EBADF
	}
	return f.RawFileSystem.FsyncDir(cancel, in)
}

func (f *sessionFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Lseek(cancel, in, out)
}

func (f *sessionFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh_, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.GetAttr(cancel, in, out)
}

func (f *sessionFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	// The number means something only with FATTR_FH (go-fuse's GetFh).
	if _, with := in.GetFh(); with {
		if !f.translate(in.NodeId, &in.Fh, false) {
			return fuse.EBADF
		}
	}
	return f.RawFileSystem.SetAttr(cancel, in, out)
}

func (f *sessionFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, true) {
		return fuse.EBADF
	}
	return f.RawFileSystem.ReadDir(cancel, in, out)
}

func (f *sessionFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, true) {
		return fuse.EBADF
	}
	return f.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (f *sessionFS) GetLk(cancel <-chan struct{}, in *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.GetLk(cancel, in, out)
}

func (f *sessionFS) SetLk(cancel <-chan struct{}, in *fuse.LkIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.SetLk(cancel, in)
}

func (f *sessionFS) SetLkw(cancel <-chan struct{}, in *fuse.LkIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.SetLkw(cancel, in)
}

func (f *sessionFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Fallocate(cancel, in)
}

func (f *sessionFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	if !f.translate(in.NodeId, &in.FhIn, false) || !f.translate(in.NodeIdOut, &in.FhOut, false) {
		return 0, fuse.EBADF
	}
	return f.RawFileSystem.CopyFileRange(cancel, in)
}

func (f *sessionFS) Ioctl(cancel <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Ioctl(cancel, in, inbuf, out, outbuf)
}

func (f *sessionFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if !f.translate(in.NodeId, &in.Fh, false) {
		return fuse.EBADF
	}
	return f.RawFileSystem.Statx(cancel, in, out)
}

package fs

import (
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
)

// The directories of the tree, each with a child that exists.
var treeDirs = []struct{ dir, child string }{
	{"", "manifest.json"},
	{"layers", "0"},
	{"layers/0", "weight.safetensors"},
	{".engramfs", "control"},
}

// Every change to a directory fails with EROFS (not ENOTSUP, which tools
// report as a bug), and the tree is unchanged afterwards: go-fuse would
// drop or move the child if the node said yes.
func TestReadOnlyDirectories(t *testing.T) {
	tr := newTree(t, treeConfig{})
	target := tr.node("layers/1/scale.safetensors")
	for _, d := range treeDirs {
		dir := tr.node(d.dir)
		h := tr.hdr(dir)
		var eo fuse.EntryOut
		var co fuse.CreateOut
		var ao fuse.AttrOut
		ops := []struct {
			name string
			do   func() fuse.Status
		}{
			{"mkdir", func() fuse.Status { return tr.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: h, Mode: 0o755}, "new", &eo) }},
			{"mkdir existing", func() fuse.Status { return tr.raw.Mkdir(nil, &fuse.MkdirIn{InHeader: h, Mode: 0o755}, d.child, &eo) }},
			{"create", func() fuse.Status {
				return tr.raw.Create(nil, &fuse.CreateIn{InHeader: h, Flags: syscall.O_CREAT | syscall.O_WRONLY, Mode: 0o644}, "new", &co)
			}},
			{"create existing", func() fuse.Status {
				return tr.raw.Create(nil, &fuse.CreateIn{InHeader: h, Flags: syscall.O_CREAT | syscall.O_RDWR, Mode: 0o644}, d.child, &co)
			}},
			{"mknod", func() fuse.Status {
				return tr.raw.Mknod(nil, &fuse.MknodIn{InHeader: h, Mode: syscall.S_IFIFO | 0o644}, "fifo", &eo)
			}},
			{"unlink", func() fuse.Status { return tr.raw.Unlink(nil, &h, d.child) }},
			{"rmdir", func() fuse.Status { return tr.raw.Rmdir(nil, &h, d.child) }},
			{"rename", func() fuse.Status {
				return tr.raw.Rename(nil, &fuse.RenameIn{InHeader: h, Newdir: dir}, d.child, "renamed")
			}},
			{"rename to root", func() fuse.Status {
				return tr.raw.Rename(nil, &fuse.RenameIn{InHeader: h, Newdir: fuse.FUSE_ROOT_ID}, d.child, "moved")
			}},
			{"symlink", func() fuse.Status { return tr.raw.Symlink(nil, &h, "manifest.json", "link", &eo) }},
			{"link", func() fuse.Status {
				return tr.raw.Link(nil, &fuse.LinkIn{InHeader: h, Oldnodeid: target}, "hardlink", &eo)
			}},
			{"chmod", func() fuse.Status { return tr.raw.SetAttr(nil, setattrIn(h, fuse.FATTR_MODE, 0o777, 0), &ao) }},
			{"chown", func() fuse.Status { return tr.raw.SetAttr(nil, setattrIn(h, fuse.FATTR_UID|fuse.FATTR_GID, 0, 0), &ao) }},
			{"utimes", func() fuse.Status {
				return tr.raw.SetAttr(nil, setattrIn(h, fuse.FATTR_MTIME|fuse.FATTR_ATIME, 0, 0), &ao)
			}},
			{"setxattr", func() fuse.Status {
				return tr.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: h, Size: 1}, "user.x", []byte("1"))
			}},
			{"removexattr", func() fuse.Status { return tr.raw.RemoveXAttr(nil, &h, "user.x") }},
		}
		before, _ := tr.getattr(dir)
		for _, op := range ops {
			if s := op.do(); s != fuse.EROFS {
				t.Errorf("%s in %q: %v, want EROFS", op.name, d.dir, s)
			}
		}
		after, _ := tr.getattr(dir)
		if after.Attr != before.Attr {
			t.Errorf("%q: attributes changed from %+v to %+v", d.dir, before.Attr, after.Attr)
		}
		for _, gone := range []string{"new", "fifo", "link", "hardlink", "renamed"} {
			if _, s := tr.lookup(dir, gone); s != fuse.ENOENT {
				t.Errorf("%q: %q exists after a refused change (%v)", d.dir, gone, s)
			}
		}
		if _, s := tr.lookup(dir, d.child); s != fuse.OK {
			t.Errorf("%q: %q is gone after a refused unlink, rmdir or rename (%v)", d.dir, d.child, s)
		}
	}
	if _, s := tr.lookup(fuse.FUSE_ROOT_ID, "moved"); s != fuse.ENOENT {
		t.Errorf("a refused rename into the root left %q there (%v)", "moved", s)
	}
}

func setattrIn(h fuse.InHeader, valid uint32, mode uint32, size uint64) *fuse.SetAttrIn {
	in := &fuse.SetAttrIn{}
	in.InHeader = h
	in.Valid = valid
	in.Mode = mode
	in.Size = size
	return in
}

// The read-only files: opening one to change it, or changing its
// attributes or extended attributes, fails with EROFS and changes nothing.
func TestReadOnlyFiles(t *testing.T) {
	tr := newTree(t, treeConfig{})
	files := []string{"manifest.json", backing.IndexFile, "layers/0/weight.safetensors", "layers/1/scale.safetensors", ".engramfs/stats"}
	for _, f := range files {
		node := tr.node(f)
		h := tr.hdr(node)
		before, _ := tr.getattr(node)
		for _, flags := range []uint32{
			syscall.O_WRONLY, syscall.O_RDWR, syscall.O_RDONLY | syscall.O_TRUNC, syscall.O_WRONLY | syscall.O_APPEND,
			syscall.O_RDONLY | syscall.O_APPEND, syscall.O_RDONLY | syscall.O_CREAT, syscall.O_RDWR | syscall.O_CREAT | syscall.O_TRUNC,
		} {
			if oo, s := tr.openAs(tr.caller, node, flags); s != fuse.EROFS {
				t.Errorf("%s: open flags %#o: %v (fh %d), want EROFS", f, flags, s, oo.Fh)
			}
		}
		var ao fuse.AttrOut
		for _, c := range []struct {
			name  string
			valid uint32
			mode  uint32
			size  uint64
		}{
			{"truncate to 0", fuse.FATTR_SIZE, 0, 0},
			{"truncate to 1", fuse.FATTR_SIZE, 0, 1},
			{"extend", fuse.FATTR_SIZE, 0, before.Size + 4096},
			{"chmod", fuse.FATTR_MODE, 0o666, 0},
			{"chown", fuse.FATTR_UID | fuse.FATTR_GID, 0, 0},
			{"utimes", fuse.FATTR_ATIME | fuse.FATTR_MTIME, 0, 0},
			{"touch", fuse.FATTR_ATIME_NOW | fuse.FATTR_MTIME_NOW, 0, 0},
		} {
			if s := tr.raw.SetAttr(nil, setattrIn(h, c.valid, c.mode, c.size), &ao); s != fuse.EROFS {
				t.Errorf("%s: %s: %v, want EROFS", f, c.name, s)
			}
		}
		if s := tr.raw.SetXAttr(nil, &fuse.SetXAttrIn{InHeader: h, Size: 1}, "user.x", []byte("1")); s != fuse.EROFS {
			t.Errorf("%s: setxattr: %v, want EROFS", f, s)
		}
		if s := tr.raw.RemoveXAttr(nil, &h, "user.x"); s != fuse.EROFS {
			t.Errorf("%s: removexattr: %v, want EROFS", f, s)
		}
		// A handle opened to read has no write path (the kernel would not
		// send a WRITE on it; if one came, nothing may be written).
		oo := tr.open(node, syscall.O_RDONLY)
		if n, s := tr.write(node, oo.Fh, 0, []byte("x")); s == fuse.OK {
			t.Errorf("%s: WRITE on a read-only handle wrote %d bytes", f, n)
		}
		if after, _ := tr.getattr(node); after.Attr != before.Attr {
			t.Errorf("%s: attributes changed from %+v to %+v", f, before.Attr, after.Attr)
		}
	}
}

// Opening a read-only file to read works, with the flags the kernel needs:
// table files keep their page cache across opens and never use direct I/O
// (a shared mmap of a direct-io file fails); the stats file is direct I/O
// (its size is 0 and its content changes).
func TestReadOnlyFilesOpenFlags(t *testing.T) {
	tr := newTree(t, treeConfig{})
	for _, c := range []struct {
		path       string
		want, deny uint32
	}{
		{"layers/0/weight.safetensors", fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, fuse.FOPEN_DIRECT_IO},
		{"layers/1/scale.safetensors", fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, fuse.FOPEN_DIRECT_IO},
		{"manifest.json", fuse.FOPEN_KEEP_CACHE, fuse.FOPEN_DIRECT_IO},
		{backing.IndexFile, fuse.FOPEN_KEEP_CACHE, fuse.FOPEN_DIRECT_IO},
		{".engramfs/stats", fuse.FOPEN_DIRECT_IO, fuse.FOPEN_KEEP_CACHE},
	} {
		for _, flags := range []uint32{syscall.O_RDONLY, syscall.O_RDONLY | syscall.O_NOATIME, syscall.O_RDONLY | syscall.O_NONBLOCK} {
			oo := tr.open(tr.node(c.path), flags)
			if oo.OpenFlags&c.want != c.want || oo.OpenFlags&c.deny != 0 {
				t.Errorf("%s: open %#o returned flags %#x, want %#x set and %#x clear", c.path, flags, oo.OpenFlags, c.want, c.deny)
			}
		}
	}
}

package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// roDir is a directory of the read-only tree: every mutation fails with
// EROFS (go-fuse would answer ENOTSUP for an unimplemented one, which tools
// report as a bug rather than as a read-only filesystem).
type roDir struct {
	gofs.Inode
	attr fuse.Attr
}

var (
	_ = (gofs.NodeGetattrer)((*roDir)(nil))
	_ = (gofs.NodeSetattrer)((*roDir)(nil))
	_ = (gofs.NodeMkdirer)((*roDir)(nil))
	_ = (gofs.NodeCreater)((*roDir)(nil))
	_ = (gofs.NodeUnlinker)((*roDir)(nil))
	_ = (gofs.NodeRmdirer)((*roDir)(nil))
	_ = (gofs.NodeRenamer)((*roDir)(nil))
	_ = (gofs.NodeSymlinker)((*roDir)(nil))
	_ = (gofs.NodeLinker)((*roDir)(nil))
	_ = (gofs.NodeMknoder)((*roDir)(nil))
	_ = (gofs.NodeSetxattrer)((*roDir)(nil))
	_ = (gofs.NodeRemovexattrer)((*roDir)(nil))
)

func (d *roDir) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Attr = d.attr
	return 0
}

func (d *roDir) Setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return syscall.EROFS
}

func (d *roDir) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EROFS
}

func (d *roDir) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	return nil, nil, 0, syscall.EROFS
}

func (d *roDir) Unlink(ctx context.Context, name string) syscall.Errno { return syscall.EROFS }

func (d *roDir) Rmdir(ctx context.Context, name string) syscall.Errno { return syscall.EROFS }

func (d *roDir) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	return syscall.EROFS
}

func (d *roDir) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EROFS
}

func (d *roDir) Link(ctx context.Context, target gofs.InodeEmbedder, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EROFS
}

func (d *roDir) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EROFS
}

func (d *roDir) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return syscall.EROFS
}

func (d *roDir) Removexattr(ctx context.Context, attr string) syscall.Errno { return syscall.EROFS }

// roFile holds what every file of the tree shares: fixed attributes, and
// EROFS for every change to them.
type roFile struct {
	gofs.Inode
	attr fuse.Attr
}

var (
	_ = (gofs.NodeGetattrer)((*roFile)(nil))
	_ = (gofs.NodeSetattrer)((*roFile)(nil))
	_ = (gofs.NodeSetxattrer)((*roFile)(nil))
	_ = (gofs.NodeRemovexattrer)((*roFile)(nil))
)

func (f *roFile) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Attr = f.attr
	return 0
}

// Setattr refuses chmod, chown, utimes and truncate alike.
func (f *roFile) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return syscall.EROFS
}

func (f *roFile) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return syscall.EROFS
}

func (f *roFile) Removexattr(ctx context.Context, attr string) syscall.Errno { return syscall.EROFS }

// writeFlags are the open flags that ask to change a file.
const writeFlags = syscall.O_WRONLY | syscall.O_RDWR | syscall.O_TRUNC | syscall.O_APPEND | syscall.O_CREAT

// memFile is a small file whose bytes are fixed at mount (manifest, index).
type memFile struct {
	roFile
	data []byte
}

var (
	_ = (gofs.NodeOpener)((*memFile)(nil))
	_ = (gofs.NodeReader)((*memFile)(nil))
)

func (f *memFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&writeFlags != 0 {
		return nil, 0, syscall.EROFS
	}
	return nil, fuse.FOPEN_KEEP_CACHE | noFlush, 0
}

func (f *memFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultData(window(f.data, off, len(dest))), 0
}

// window returns b[off:off+n], clipped to b.
func window(b []byte, off int64, n int) []byte {
	if off >= int64(len(b)) || off < 0 {
		return nil
	}
	return b[off:min(off+int64(n), int64(len(b)))]
}

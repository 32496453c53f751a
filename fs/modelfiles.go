package fs

import (
	"context"
	"errors"
	"io"
	"strings"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
)

// The mount is the model directory: every file of MODEL_DIR (config,
// tokenizer, generation config, the shards themselves, subdirectories) is
// served at its own path with the same bytes, beside the tree engramfs
// makes (manifest.json, the index, layers/, .engramfs/). Where a name is
// taken twice, the mount's own entry wins:
//
//   - model.safetensors.index.json is the mount's: it lists every tensor,
//     the tables at their table files and every other tensor at its shard.
//   - manifest.json, a layers/<L>/<table>.safetensors, or a file where the
//     mount has a directory (a file named `layers`), and anything under
//     .engramfs/: not served, one warning each at mount.
//   - A directory of MODEL_DIR that the mount also has (layers/, layers/0/)
//     is merged: its other files are served.

// maxSkipLogs bounds the warnings about entries not served, at mount.
const maxSkipLogs = 20

// addModelFiles adds m's files to the tree under root, and logs what it
// leaves out.
func (r *root) addModelFiles(addFile func(*gofs.Inode, string, gofs.InodeEmbedder) *gofs.Inode,
	addDir func(*gofs.Inode, string) *gofs.Inode) {
	m, log := r.o.Model, r.o.Log
	logged := 0
	skip := func(name, reason string) {
		if logged++; logged <= maxSkipLogs {
			log.Warn("model directory entry not served", zap.String("path", name), zap.String("reason", reason))
		}
	}
	for _, s := range m.SkippedFiles {
		skip(s.Name, s.Reason)
	}
	for _, f := range m.Files {
		if f.Name == backing.IndexFile {
			log.Info("serving the mount's own index in place of the model directory's",
				zap.String("path", f.Name), zap.String("why", "it lists every tensor: tables at their table files, the rest at their shards"))
			continue
		}
		parts := strings.Split(f.Name, "/")
		if parts[0] == ControlDir {
			skip(f.Name, "the mount's control directory has this name")
			continue
		}
		dir, ok := &r.Inode, true
		for _, p := range parts[:len(parts)-1] {
			ch := dir.GetChild(p)
			if ch == nil {
				ch = addDir(dir, p)
			} else if !ch.IsDir() {
				ok = false
				break
			}
			dir = ch
		}
		base := parts[len(parts)-1]
		if !ok || dir.GetChild(base) != nil {
			skip(f.Name, "the mount has its own entry at this path")
			continue
		}
		attr := r.attr(syscall.S_IFREG|(0o444&f.Mode), int(f.Identity.Size))
		if mtime := f.Identity.MTime; !mtime.IsZero() { // objects have none: the mount's
			attr.SetTimes(&mtime, &mtime, &mtime)
		}
		addFile(dir, base, &modelFile{roFile: roFile{attr: attr}, f: f, r: r})
	}
	if logged > maxSkipLogs {
		log.Warn("more model directory entries not served", zap.Int("not_logged", logged-maxSkipLogs))
	}
}

// modelFile is a file of the model directory. With FUSE passthrough (kernel
// 6.9 or later, a daemon with CAP_SYS_ADMIN) the kernel reads the backing
// file itself: reads, mmap and readahead at the backing's speed, no
// request reaches the daemon. Without it, the daemon reads the file and
// reads ahead of a sequential handle (seqRun), since the connection's
// one-page readahead is the table files' and applies to every file.
type modelFile struct {
	roFile
	f backing.ModelFile
	r *root
}

var _ = (gofs.NodeOpener)((*modelFile)(nil))

// Open opens the backing file, refusing one that changed since the mount
// (its size was announced). KEEP_CACHE: the bytes are fixed while mounted
// (go-fuse clears it for a passthrough open, where the page cache is the
// backing file's). A file that is not readable by everyone in MODEL_DIR is
// the daemon's user's alone (the kernel checks no mode bits without
// default_permissions, and with --allow-other every user reaches Open).
func (f *modelFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&writeFlags != 0 {
		return nil, 0, syscall.EROFS
	}
	if caller, ok := fuse.FromContext(ctx); ok && f.f.Mode&0o004 == 0 && caller.Uid != f.r.o.uid {
		return nil, 0, syscall.EACCES
	}
	of, err := f.r.o.Model.OpenFile(f.f)
	if err != nil {
		f.r.o.hotLog.Error("open failed", zap.String("path", f.f.Name), zap.Error(err))
		if errors.Is(err, backing.ErrShardChanged) {
			return nil, 0, syscall.ESTALE
		}
		return nil, 0, syscall.EIO
	}
	h := &modelHandle{node: f, file: of}
	if !ownOpen(ctx) {
		h.ra = &readAhead{size: f.f.Identity.Size, fill: h.fill, store: f.EmbeddedInode().WriteCache}
	}
	return h, fuse.FOPEN_KEEP_CACHE | noFlush, 0
}

// modelHandle is one open of a model file.
type modelHandle struct {
	node *modelFile
	file backing.OpenModelFile
	ra   *readAhead // nil for the daemon's own opens
}

var (
	_ = (gofs.FilePassthroughFder)((*modelHandle)(nil))
	_ = (gofs.FileReader)((*modelHandle)(nil))
	_ = (gofs.FileReleaser)((*modelHandle)(nil))
)

// PassthroughFd offers the backing file to the kernel. go-fuse registers
// it (FUSE_DEV_IOC_BACKING_OPEN); when the kernel refuses (no CAP_SYS_ADMIN,
// a kernel before 6.9, a backing file stacked too deep) go-fuse turns
// passthrough off for the mount and every read comes to Read.
func (h *modelHandle) PassthroughFd() (int, bool) {
	fd := h.file.Fd()
	return fd, fd >= 0 && !h.node.r.o.NoPassthrough
}

// Read serves a read when passthrough is off.
func (h *modelHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	h.node.r.servedByDaemon.Do(func() {
		h.node.r.o.Log.Info("model files are read by the daemon (no FUSE passthrough): sequential readers get daemon-side readahead")
	})
	size := h.node.f.Identity.Size
	if off < 0 || off >= size || len(dest) == 0 {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), size)
	n, err := h.fill(dest[:end-off], off)
	if err != nil {
		h.node.r.o.hotLog.Error("read failed", zap.String("path", h.node.f.Name), zap.Int64("offset", off), zap.Error(err))
		return nil, syscall.EIO
	}
	if h.ra != nil {
		h.ra.observe(off, end)
	}
	return fuse.ReadResultData(dest[:n]), 0
}

// fill reads b at off: all of it, or up to the end of the file.
func (h *modelHandle) fill(b []byte, off int64) (int, error) {
	n, err := h.file.ReadAt(b, off)
	if errors.Is(err, io.EOF) && off+int64(n) == h.node.f.Identity.Size {
		err = nil
	}
	return n, err
}

// Release waits for the handle's readahead, then closes the backing file.
func (h *modelHandle) Release(ctx context.Context) syscall.Errno {
	if h.ra != nil {
		h.ra.close()
	}
	if err := h.file.Close(); err != nil {
		return syscall.EIO
	}
	return 0
}

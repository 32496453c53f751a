// Package fs is the go-fuse side of engramfs: the nodes of the read-only
// tree (table files, manifest, index, .engramfs/) and the mount itself.
// Everything else (shard reads, caching, hints) lives in packages that know
// nothing of FUSE.
package fs

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/stats"
)

// Options configure a mount.
type Options struct {
	Model  *backing.Model
	Loader *cache.Loader
	Stats  *stats.Counters
	Log    *zap.Logger
	Faults FaultObserver // optional: told of demand-faulted pages
	Hints  Hinter        // optional: where control-file frames go

	// AllowOther lets users other than the daemon's read the mount. Off by
	// default: the hint control file is owner-only either way.
	AllowOther bool
	// Debug logs every FUSE request (very verbose).
	Debug bool

	uid, gid uint32
	hotLog   *zap.Logger
}

// Request sizing: see Mount.
const (
	maxWrite            = 256 << 10
	maxInflightRequests = 256
)

// Timeouts for the kernel's entry and attribute caches. The tree never
// changes while mounted, so the kernel may keep both as long as it likes.
const cacheTimeout = 24 * time.Hour

// Server is a live mount.
type Server struct {
	srv        *fuse.Server
	root       *root
	mountpoint string
	log        *zap.Logger
}

// Mount mounts the tree of o.Model on mountpoint and serves it until
// Unmount. A mountpoint left dead by a killed daemon (ENOTCONN) is detached
// first.
func Mount(mountpoint string, o Options) (*Server, error) {
	if o.Model == nil || o.Loader == nil || o.Stats == nil {
		return nil, errors.New("fs: Model, Loader and Stats are required")
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if err := checkMountpoint(mountpoint, o.Log); err != nil {
		return nil, err
	}
	o.uid, o.gid = uint32(os.Getuid()), uint32(os.Getgid())
	// A failing shard can fail thousands of faults a second; log a few.
	o.hotLog = o.Log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 5, 0)
	}))

	r := &root{o: &o, mtime: time.Now()}
	r.roDir.attr = r.attr(syscall.S_IFDIR|0o755, 0)
	timeout := cacheTimeout
	opts := &gofs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NegativeTimeout: &timeout,
		UID:             o.uid,
		GID:             o.gid,
		MountOptions: fuse.MountOptions{
			FsName: o.Model.Dir,
			Name:   "engramfs",
			// 0 would mean the kernel default: every fault a 128 KiB READ.
			// 1 gives one synchronous 4 KiB READ per fault, and concurrent
			// faults all in flight (measured, design.md).
			MaxReadAhead: 1,
			// No fusermount on these nodes.
			DirectMountStrict: true,
			// Otherwise a size seen in GETATTR may drop the whole page cache
			// of a file, pinned and pushed pages included.
			ExplicitDataCacheControl: true,
			MaxBackground:            128,
			// Every request in flight holds a read buffer of MaxWrite: at
			// 1 MiB, 100 concurrent faults cost 100 MiB. Random 4 KiB faults
			// and hint frames (which may span writes) need nothing larger.
			MaxWrite: maxWrite,
			// go-fuse starts a reader goroutine per request while none is
			// idle; on two busy cores those goroutines queued faster than
			// they ran (seen: 57,480 runnable goroutines, a ~1 GB daemon,
			// faults stalled). A request budget bounds them: past it, the
			// kernel holds requests until one completes.
			MaxInflightRequestBytes: maxInflightRequests * (maxWrite + 2*cache.PageSize),
			// Our replies are bytes in memory, never a file descriptor, so
			// go-fuse's splice path only adds a pipe write and a drain
			// (three system calls) before falling back to writev: seen in
			// perf on every fault.
			DisableSplice: true,
			AllowOther:    o.AllowOther,
			Debug:         o.Debug,
			DisableXAttrs: true,
		},
	}
	srv, err := gofs.Mount(mountpoint, r, opts)
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	return &Server{srv: srv, root: r, mountpoint: mountpoint, log: o.Log}, nil
}

// checkMountpoint refuses what cannot be mounted on, with a message that
// names the problem, and detaches a dead engramfs mount left by a killed
// daemon (stat fails with ENOTCONN there).
func checkMountpoint(mp string, log *zap.Logger) error {
	// statfs always reaches the filesystem; stat may be answered from
	// attributes the kernel cached before the daemon died.
	var sfs unix.Statfs_t
	err := unix.Statfs(mp, &sfs)
	if errors.Is(err, syscall.ENOTCONN) {
		if uerr := unix.Unmount(mp, unix.MNT_DETACH); uerr != nil {
			return fmt.Errorf("mountpoint %s: dead mount (transport endpoint not connected) and lazy unmount failed: %w", mp, uerr)
		}
		log.Warn("detached a dead mount left by a previous daemon", zap.String("mountpoint", mp))
	}
	fi, err := os.Stat(mp)
	if err != nil {
		return fmt.Errorf("mountpoint: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("mountpoint %s: not a directory", mp)
	}
	return nil
}

// Mountpoint is where the tree is mounted.
func (s *Server) Mountpoint() string { return s.mountpoint }

// Wait blocks until the mount is gone.
func (s *Server) Wait() { s.srv.Wait() }

// Unmount unmounts; when a reader still has a file open or mapped (EBUSY),
// it detaches the mount lazily instead, so the daemon never leaves a mount
// behind. Readers of a detached mount get errors once the daemon exits.
func (s *Server) Unmount() error {
	err := s.srv.Unmount()
	if err == nil {
		return nil
	}
	if !errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("unmount %s: %w", s.mountpoint, err)
	}
	if derr := unix.Unmount(s.mountpoint, unix.MNT_DETACH); derr != nil {
		return fmt.Errorf("unmount %s: busy, and lazy unmount failed: %w", s.mountpoint, derr)
	}
	s.log.Warn("mount busy (a reader still maps a file): detached it lazily", zap.String("mountpoint", s.mountpoint))
	return nil
}

// TablePath is where table id lives in the mount.
func (s *Server) TablePath(id uint32) string {
	return s.mountpoint + "/" + s.root.o.Model.Tables[id].Path()
}

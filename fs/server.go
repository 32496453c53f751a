// Package fs is the go-fuse side of engramfs: the nodes of the read-only
// tree (table files, manifest, index, .engramfs/) and the mount itself.
// Everything else (shard reads, caching, hints) lives in packages that know
// nothing of FUSE.
//
// A Server lives in two phases. New builds the whole tree (go-fuse builds
// nodes before anything is mounted), so the prefetcher can be given the
// Server to push into before the mount exists; Connect then wires the
// receivers of hints and faults, and Serve mounts. Nothing is pushed before
// Serve: Store and Confirm answer ErrNotServing until the mount is up, and
// again once it is closed.
package fs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// ErrNotServing is what Store and Confirm return before Serve has the mount
// up (and after Close): there is no page cache to push into yet.
var ErrNotServing = errors.New("fs: not serving: the mount is not up")

// Options configure a Server.
type Options struct {
	Model  *backing.Model
	Loader *cache.Loader
	// ReadInto, if set, reads the table data a sequential reader's
	// readahead pushes (seqread.go) straight into the buffer it stores;
	// nil: through Loader. The daemon sets its Store, unless faults are
	// injected (they are the Loader's source's).
	ReadInto backing.IntoReader
	// Stats are the counters; with Stats.Timings set, the nodes that time
	// their work are built in their timed variants (timing.go).
	Stats *stats.Counters
	Log   *zap.Logger

	// AllowOther lets users other than the daemon's read the mount. Off by
	// default: the hint control file is owner-only either way.
	AllowOther bool
	// Debug logs every FUSE request (very verbose).
	Debug bool
	// ControlHandles bounds the open handles of the control file (ENFILE
	// past it); 0 is DefaultControlHandles.
	ControlHandles int
	// NoPassthrough serves the model directory's other files through the
	// daemon even where FUSE passthrough works (modelfiles.go).
	NoPassthrough bool
	// Seen, if set, records the table pages the daemon puts in the page
	// cache (served or stored), so residency lookups can skip the others
	// (cache.Seen).
	Seen *cache.Seen
	// Transport, if set, serves requests beside go-fuse's /dev/fuse server
	// (fs/uring); nil serves everything from /dev/fuse.
	Transport Transport

	uid, gid uint32
	hotLog   *zap.Logger
	hints    HintSink  // set by Connect; nil: frames are decoded and dropped
	faults   FaultSink // set by Connect; nil: nobody hears of faults
}

// A Transport serves some of the kernel's requests beside go-fuse's
// /dev/fuse server, which keeps the mount, INIT and the notifications
// (fs/uring: the per-CPU io_uring queues). Serve calls Prepare before
// mounting, Start once INIT is answered and before the mount is used, and
// Stop after unmounting. An error from either fails the mount.
type Transport interface {
	Prepare(opts *fuse.MountOptions) error
	Start(srv *fuse.Server) error
	Stop()
}

// Request sizing: see New.
const (
	maxWrite            = 256 << 10
	maxInflightRequests = 256
)

// Timeouts for the kernel's entry and attribute caches. The tree never
// changes while mounted, so the kernel may keep both as long as it likes.
const cacheTimeout = 24 * time.Hour

// Server is the tree of one model, and its mount once Serve has it up.
type Server struct {
	root  *root
	rawFS *sessionFS // the tree's raw file system, with what a handover needs (handover.go)
	opts  *gofs.Options
	log   *zap.Logger

	mu         sync.Mutex
	srv        *fuse.Server // GUARDED_BY(mu); nil before Serve
	mountpoint string       // GUARDED_BY(mu)
	own        ownMount     // GUARDED_BY(mu): the mount Serve made (mounted.go)
	dev        *os.File     // GUARDED_BY(mu): the connection's /dev/fuse, kept for a handover

	handingOver atomic.Bool // set once Handover starts

	// live is non-nil while the mount is up and the daemon holds its table
	// files open: what Store and Confirm need.
	live atomic.Pointer[liveMount]
}

// liveMount is what a served mount holds: every table file of the mount,
// opened by the daemon itself through the mount. Two reasons:
//
//   - NOTIFY_STORE answers ENOENT for an inode the kernel has not looked up
//     (measured on a fresh mount: `engramfs hint MNT --decode 14 1 2 3 4 5`
//     read 6 pages from disk and stored none). An open file keeps its
//     dentry, and so the inode, known to the kernel for the mount's life:
//     every push lands, whether or not a reader has opened the file yet.
//   - A page whose prefetch a fault cancelled is confirmed resident by
//     reading one byte of it through the page cache (Confirm).
//
// They are closed before unmounting: an open file keeps the mount busy.
type liveMount struct {
	files []*os.File // by table ID
	// ready is closed once go-fuse can write to the kernel for the tree
	// (its server is built): at once for Serve; a takeover publishes the
	// mount a moment before, so that no push in between fails (handover.go).
	ready chan struct{}
}

// closedReady is the ready of a liveMount published once serving.
var closedReady = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// New builds the tree of o.Model. Nothing is mounted yet: Connect the
// receivers of hints and faults, then Serve.
func New(o Options) (*Server, error) {
	if o.Model == nil || o.Loader == nil || o.Stats == nil {
		return nil, errors.New("fs: Model, Loader and Stats are required")
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
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
		// Node IDs are the tree's inode numbers, which root.OnAdd gives
		// in a fixed order: a successor daemon answers for the node IDs
		// the kernel already holds (handover.go).
		ExternalNodeID:  true,
		RootStableAttr:  &gofs.StableAttr{Ino: fuse.FUSE_ROOT_ID},
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
			// faults all in flight (measured: docs/design.md, "Kernel
			// facts and what the code does about them").
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
	// NewNodeFS builds the whole tree now (root.OnAdd).
	s := &Server{root: r, rawFS: newSessionFS(gofs.NewNodeFS(r, opts)), opts: opts, log: o.Log}
	s.rawFS.reopen = s.reopen
	opts.MountOptions.Logger = newGoFuseLogger(s)
	return s, nil
}

// Connect wires the receivers: control-file frames go to hints, and every
// table file tells faults of the pages FUSE reads brought in. Either may be
// nil. Call it before Serve: the nodes read them without a lock once the
// kernel can reach them, so a later call panics.
func (s *Server) Connect(hints HintSink, faults FaultSink) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		panic("fs: Connect after Serve")
	}
	s.root.o.hints = hints
	s.root.o.faults = faults
	for _, tf := range s.root.tables {
		tf.faults = faults
	}
}

// Serve mounts the tree on mountpoint and returns once the mount answers
// and the daemon holds every table file open (see liveMount); the kernel
// is served in the background until Unmount. A mountpoint left dead by a
// killed daemon (ENOTCONN) is detached first. On error nothing is left
// mounted.
func (s *Server) Serve(mountpoint string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		return fmt.Errorf("mount %s: already serving %s", mountpoint, s.mountpoint)
	}
	if err := checkMountpoint(mountpoint, s.log); err != nil {
		return err
	}
	mopts, tr := s.opts.MountOptions, s.root.o.Transport
	if tr != nil {
		if err := tr.Prepare(&mopts); err != nil {
			return fmt.Errorf("mount %s: %w", mountpoint, err)
		}
	}
	srv, err := s.mountDev(mountpoint, &mopts)
	if err != nil {
		if tr != nil {
			tr.Stop()
		}
		return fmt.Errorf("mount %s: %w", mountpoint, explainMountError(err))
	}
	go srv.Serve()
	var own ownMount // unknown until the mount answers
	fail := func(err error) error {
		defer s.closeDevLocked()
		if uerr := unmount(srv, mountpoint, own, s.log); uerr != nil {
			s.log.Error("unmounting a mount that failed to start", zap.String("mountpoint", mountpoint), zap.Error(uerr))
		}
		if tr != nil {
			tr.Stop()
		}
		return fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	if tr != nil {
		if err := tr.Start(srv); err != nil {
			return fail(err)
		}
	}
	if err := srv.WaitMount(); err != nil {
		return fail(err)
	}
	live, err := s.goLive(mountpoint)
	if err != nil {
		return fail(err)
	}
	if own, err = findOwnMount(mountpoint); err != nil {
		live.close()
		return fail(err)
	}
	s.srv, s.mountpoint, s.own = srv, mountpoint, own
	s.live.Store(live)
	return nil
}

// goLive checks that the mount answers, through the kernel, and opens the
// daemon's own view of every table file (liveMount).
func (s *Server) goLive(mountpoint string) (*liveMount, error) {
	pollHack(mountpoint)
	// Serving means a reader can use the tree: check it answers, through
	// the kernel, before saying so.
	if _, err := os.ReadFile(filepath.Join(mountpoint, ManifestFile)); err != nil {
		return nil, fmt.Errorf("the new mount does not answer: %w", err)
	}
	return s.openLive(mountpoint, closedReady)
}

// openLive opens the daemon's own view of every table file.
func (s *Server) openLive(mountpoint string, ready chan struct{}) (*liveMount, error) {
	live := &liveMount{ready: ready}
	for id := range s.root.tables {
		f, err := os.Open(mountedPath(mountpoint, s.root.o.Model.Tables[id]))
		if err != nil {
			live.close()
			return nil, fmt.Errorf("looking up the table files: %w", err)
		}
		live.files = append(live.files, f)
	}
	return live, nil
}

// close closes the daemon's own opens of the table files.
func (l *liveMount) close() {
	for _, f := range l.files {
		_ = f.Close()
	}
}

// checkMountpoint refuses what cannot be mounted on, with a message that
// names the problem: a live engramfs mount, with its daemon's pid (stacked
// on it, the new mount hid it, and its daemon took the new device for a
// detach and exited, leaving a dead mount underneath). It detaches a dead
// engramfs mount left by a killed daemon (statfs fails with ENOTCONN
// there), and refuses to touch a dead mount of another filesystem.
func checkMountpoint(mp string, log *zap.Logger) error {
	path, err := MountPath(mp)
	if err != nil {
		return fmt.Errorf("mountpoint: %w", err)
	}
	// statfs always reaches the filesystem; stat may be answered from
	// attributes the kernel cached before the daemon died.
	var sfs unix.Statfs_t
	serr := unix.Statfs(mp, &sfs)
	var top procfs.Mount
	mounted := false
	if ms, err := procfs.Mounts(); err == nil {
		top, mounted = procfs.Top(ms, path)
	}
	switch {
	case errors.Is(serr, syscall.ENOTCONN) && mounted && top.FSType != FSType:
		return fmt.Errorf("mountpoint %s: a dead %s mount of %s (transport endpoint not connected), not engramfs's: unmount it first", mp, top.FSType, top.Source)
	case errors.Is(serr, syscall.ENOTCONN):
		// The top mount, which is the dead one (statfs reached it).
		if uerr := unix.Unmount(mp, unix.MNT_DETACH); uerr != nil {
			return fmt.Errorf("mountpoint %s: dead mount (transport endpoint not connected) and lazy unmount failed: %w", mp, uerr)
		}
		log.Warn("detached a dead mount left by a previous daemon", zap.String("mountpoint", mp))
	case serr == nil && mounted && top.FSType == FSType:
		pid, err := DaemonPid(mp)
		if err != nil {
			return fmt.Errorf("mountpoint %s: engramfs is already mounted there (serving %s; %v): stop it first (engramfs unmount %s)", mp, top.Source, err, mp)
		}
		return fmt.Errorf("mountpoint %s: engramfs is already mounted there (daemon pid %d, serving %s): stop it first (engramfs unmount %s)", mp, pid, top.Source, mp)
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

// Mountpoint is where Serve mounted the tree ("" before Serve).
func (s *Server) Mountpoint() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mountpoint
}

// Wait blocks until the mount is gone; it returns at once before Serve.
func (s *Server) Wait() {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	if srv != nil {
		srv.Wait()
	}
}

// Close stops pushing and closes the daemon's own opens of the table files,
// which keep the mount busy; the mount itself stays (Unmount). Store and
// Confirm answer ErrNotServing from now on. Use it alone when the mount is
// already gone or detached from outside.
func (s *Server) Close() {
	if live := s.live.Swap(nil); live != nil {
		live.close()
	}
}

// Unmount closes the daemon's own opens (Close), then unmounts its own
// mount; when a reader still has a file open or mapped (EBUSY), it detaches
// the mount lazily instead, so the daemon never leaves a mount behind.
// Readers of a detached mount get errors once the daemon exits. A mount
// already detached from outside is left alone, and so is one covered by
// another mount at its path (see ownMount.onTop). Before Serve it does
// nothing.
func (s *Server) Unmount() error {
	s.Close()
	s.mu.Lock()
	srv, mp, own := s.srv, s.mountpoint, s.own
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	defer s.closeDev()
	// Name what may hold it: only control handles being open was logged
	// as "a reader still maps a file".
	err := unmount(srv, mp, own, s.log.With(zap.Int64("control_handles_open", s.root.o.Stats.ControlHandles.Load())))
	if tr := s.root.o.Transport; tr != nil {
		tr.Stop()
	}
	return err
}

// unmount unmounts own, srv's mount on mountpoint, lazily when it is busy,
// and only while the path reaches it (checked before every attempt).
// go-fuse's own Unmount retries by path for ~300 ms without such a check.
func unmount(srv *fuse.Server, mountpoint string, own ownMount, log *zap.Logger) error {
	delay := time.Duration(0)
	for try := 0; ; try++ {
		if ok, err := own.onTop(log); !ok {
			return err
		}
		err := unix.Unmount(mountpoint, 0)
		if err == nil {
			waitSessionEnd(srv, mountpoint, log)
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) {
			return fmt.Errorf("unmount %s: %w", mountpoint, err)
		}
		if try == 4 {
			break
		}
		// A file the daemon just closed may still count for a moment
		// (go-fuse waits the same way: 5, 15, 35, 75 ms).
		delay = 2*delay + 5*time.Millisecond
		time.Sleep(delay)
	}
	if ok, err := own.onTop(log); !ok {
		return err
	}
	if derr := unix.Unmount(mountpoint, unix.MNT_DETACH); derr != nil {
		return fmt.Errorf("unmount %s: busy, and lazy unmount failed: %w", mountpoint, derr)
	}
	log.Warn("mount busy (a file of it is open or mapped, or a control handle): detached it lazily", zap.String("mountpoint", mountpoint))
	return nil
}

// sessionEndTimeout bounds the wait for the serve loops after an unmount.
const sessionEndTimeout = 10 * time.Second

// waitSessionEnd waits for the serve loops to return once the kernel has
// ended the session (as go-fuse's own Unmount does), but not forever: if the
// unmount reached another mount (stacked in the microseconds after the
// check), the session goes on and the daemon must still stop.
func waitSessionEnd(srv *fuse.Server, mountpoint string, log *zap.Logger) {
	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(sessionEndTimeout):
		log.Error("the FUSE session did not end after the unmount; stopping anyway", zap.String("mountpoint", mountpoint))
	}
}

// TablePath is where table id lives in the mount ("" before Serve).
func (s *Server) TablePath(id uint32) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil {
		return ""
	}
	return mountedPath(s.mountpoint, s.root.o.Model.Tables[id])
}

// mountedPath is where t's file is under mountpoint.
func mountedPath(mountpoint string, t *backing.Table) string {
	return filepath.Join(mountpoint, t.Path())
}

// Store pushes data into the page cache of table id at off (NOTIFY_STORE).
// It implements prefetch.Pusher; never call it from a Read handler (the
// folio being read is locked: the store would wait forever). Before Serve,
// and after Close, it returns ErrNotServing.
func (s *Server) Store(id uint32, off int64, data []byte) error {
	live := s.live.Load()
	if live == nil {
		return ErrNotServing
	}
	<-live.ready
	if int(id) >= len(s.root.tables) {
		return fmt.Errorf("table %d: no such table", id)
	}
	if errno := s.root.tables[id].writeCache(off, data); errno != 0 {
		// ENOENT would mean the kernel forgot the inode, which the open
		// table files prevent.
		return fmt.Errorf("table %d: page cache store at %d: %w", id, off, errno)
	}
	return nil
}

// Invalidate drops n bytes of table id from off from the page cache and
// from every process's mapping of them (NOTIFY_INVAL_INODE): the next
// access finds what a Store put there, or reads the pages again. With Store
// it implements cache.Recharger; like Store, never call it from a Read
// handler (it waits for the folio lock of a page being read). Before Serve,
// and after Close, it returns ErrNotServing.
func (s *Server) Invalidate(id uint32, off, n int64) error {
	if s.live.Load() == nil {
		return ErrNotServing
	}
	if int(id) >= len(s.root.tables) {
		return fmt.Errorf("table %d: no such table", id)
	}
	if errno := s.root.tables[id].EmbeddedInode().NotifyContent(off, n); errno != 0 {
		return fmt.Errorf("table %d: page cache invalidation at %d (+%d): %w", id, off, n, errno)
	}
	return nil
}

var _ cache.Recharger = (*Server)(nil)

// Confirm reads one byte at off of table id through the page cache: when
// it returns, the page is resident (a read the kernel still has in flight
// for it is waited for, an evicted page is faulted in again). It implements
// prefetch.Confirmer; only from the prefetcher's pushers, never from a FUSE
// Read handler. Before Serve, and after Close, it returns ErrNotServing.
func (s *Server) Confirm(id uint32, off int64) error {
	live := s.live.Load()
	if live == nil {
		return ErrNotServing
	}
	<-live.ready
	if int(id) >= len(live.files) {
		return fmt.Errorf("table %d: no such table", id)
	}
	var b [1]byte
	if _, err := live.files[id].ReadAt(b[:], off); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("table %d: confirming the page at %d: %w", id, off, err)
	}
	return nil
}

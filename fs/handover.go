package fs

// Handing a live FUSE session to a successor daemon (engramfs restart).
//
// The kernel's side of a mount is its connection: the inodes it looked up
// (by node ID, cached for 24 h), the file handles readers hold (by Fh),
// the requests queued for a daemon. It lives as long as one /dev/fuse
// descriptor of it is open, whoever holds it. So a successor can serve the
// same mount without the kernel noticing, if it is handed a descriptor and
// answers for the same node IDs and handles:
//
//   - Node IDs are the tree's inode numbers (gofs.Options.ExternalNodeID):
//     root.OnAdd numbers the fixed tree the same way in every daemon of the
//     same model, so the successor's node 7 is the predecessor's node 7.
//     A successor registers every node before it reads a request
//     (registerTree): the kernel never looks up a node it already knows.
//   - File handles: the kernel holds this daemon's numbers, never
//     go-fuse's (sessionFS, session.go: a generation per daemon in the
//     high half). The handles open are listed, handed over, and opened
//     again in the successor under the kernel's numbers (replay). A crash
//     leaves no list: a handle the successor does not know is reopened on
//     first use (an orphan), or answers EBADF on the control file, never a
//     panic; the clients reopen on it. A new open never gets an orphan's
//     number (another generation).
//   - No request is lost: the predecessor stops reading (its descriptor
//     turns non-blocking, so its readers leave at the next empty queue),
//     answers what it read, and only then hands over. What it did not read
//     stays queued in the kernel for the successor. The successor reads
//     through its own clone of the connection (FUSE_DEV_IOC_CLONE), whose
//     blocking mode is its own.
//
// go-fuse (v2.12.1) has no API for any of this, but its documented
// "/dev/fd/N" mountpoint serves a descriptor it did not mount. Its INIT
// handshake reads and answers the first request inside NewServer, before
// the server exists: on a live connection that would be a reader's, and a
// hint write or barrier waiting on pushes would never be answered (the
// stall found on 2026-12-03). So it is fed a STATFS of our own through a
// socket whose descriptor number the connection then takes (serveDev);
// the negotiated settings it misses only size RENAME and SETXATTR, which
// a read-only tree refuses anyway. Every daemon mounts itself (mountDev) so it holds the
// descriptor it may have to hand over.

import (
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Session is what a successor needs besides the descriptor: the file
// handles open on the mount, by number.
type Session struct {
	Handles []Handle `json:"handles"`
}

// Handle is one open file handle the kernel holds: its number and node.
type Handle struct {
	Fh   uint64 `json:"fh"`
	Node uint64 `json:"node"`
	Dir  bool   `json:"dir,omitempty"`
}

// Kernel constants missing from x/sys and go-fuse.
const (
	// FUSE_DEV_IOC_CLONE: _IOR(229, 0, uint32_t) (include/uapi/linux/fuse.h).
	fuseDevIocClone = 0x8004e500
	// FUSE_NOTIFY_RESEND (Linux 6.9): the kernel queues again every request
	// a daemon read and never answered.
	fuseNotifyResend = 7
	// go-fuse answers a POLL on this name with ENOSYS, so the kernel stops
	// sending POLL (fuse/poll.go); a mount it did not make must ask itself.
	pollHackName = ".go-fuse-epoll-hack"
)

// mountDev mounts the tree on mountpoint through a /dev/fuse descriptor of
// our own (the options go-fuse's direct mount passes), and serves it with
// go-fuse's "/dev/fd/N" mountpoint: go-fuse owns one descriptor, s.dev is
// a duplicate (the same open file) kept for a handover. o are the mount's
// options (a transport may have added capabilities). Holding s.mu.
func (s *Server) mountDev(mountpoint string, o *fuse.MountOptions) (*fuse.Server, error) {
	var st unix.Stat_t
	if err := unix.Stat(mountpoint, &st); err != nil {
		return nil, err
	}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if o.DirectMountFlags != 0 {
		flags = o.DirectMountFlags
	}
	data := []string{
		"fd=" + strconv.Itoa(fd),
		fmt.Sprintf("rootmode=%o", st.Mode&unix.S_IFMT),
		"user_id=" + strconv.Itoa(os.Geteuid()),
		"group_id=" + strconv.Itoa(os.Getegid()),
		"max_read=" + strconv.Itoa(o.MaxWrite),
	}
	for _, opt := range o.Options {
		switch opt {
		case "nodev":
			flags |= unix.MS_NODEV
		case "dev":
			flags &^= unix.MS_NODEV
		case "nosuid":
			flags |= unix.MS_NOSUID
		case "suid":
			flags &^= unix.MS_NOSUID
		case "ro":
			flags |= unix.MS_RDONLY
		default:
			data = append(data, opt)
		}
	}
	if o.AllowOther {
		data = append(data, "allow_other")
	}
	source := o.FsName
	if source == "" {
		source = o.Name
	}
	if err := unix.Mount(source, mountpoint, "fuse."+o.Name, flags, strings.Join(data, ",")); err != nil {
		unix.Close(fd)
		return nil, err
	}
	srv, err := s.serveDev(fd, false)
	if err != nil {
		if uerr := unix.Unmount(mountpoint, unix.MNT_DETACH); uerr != nil {
			s.log.Error("unmounting a mount that failed to start", zap.String("mountpoint", mountpoint), zap.Error(uerr))
		}
		return nil, err
	}
	return srv, nil
}

// serveDev builds a go-fuse server on fd (it takes fd over) and keeps a
// duplicate in s.dev. go-fuse reads its first request in NewServer and
// answers it before the server exists (and before the tree can write
// anything to the kernel): a new mount's INIT. On a live connection
// (live: a takeover or a resume) that request would be any reader's, and
// one that waits on the daemon (a hint write waiting for room, a barrier
// waiting for pushes) would wait forever, NewServer never returning: so
// go-fuse is handed a socket holding a STATFS of our own first, and the
// connection takes the socket's descriptor number once NewServer has
// returned, before Serve reads again. Holding s.mu.
func (s *Server) serveDev(fd int, live bool) (*fuse.Server, error) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	goFuseFd, feed := fd, -1
	if live {
		if goFuseFd, feed, err = firstRequestSocket(); err != nil {
			unix.Close(fd)
			unix.Close(dup)
			return nil, err
		}
		defer unix.Close(feed)
	}
	o := s.opts.MountOptions
	o.DirectMount, o.DirectMountStrict = false, false
	srv, err := fuse.NewServer(s.rawFS, "/dev/fd/"+strconv.Itoa(goFuseFd), &o)
	if err == nil && live {
		// go-fuse reads through the descriptor number it was given:
		// make it the connection's (it reads nothing until Serve).
		err = unix.Dup3(fd, goFuseFd, unix.O_CLOEXEC)
	}
	if live {
		unix.Close(fd)
	}
	if err != nil {
		if live && srv == nil {
			unix.Close(goFuseFd)
		}
		unix.Close(dup)
		return nil, err
	}
	s.dev = os.NewFile(uintptr(dup), "/dev/fuse")
	return srv, nil
}

// firstRequestSocket is a connected pair of packet sockets, the first
// (go-fuse's until the swap) with a FUSE STATFS of the root waiting on it.
func firstRequestSocket() (goFuse, feed int, err error) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("first request socket: %w", err)
	}
	const opStatfs = 17 // FUSE_STATFS
	var hdr fuse.InHeader
	hdr.Length = uint32(unsafe.Sizeof(hdr))
	hdr.Opcode = opStatfs
	hdr.Unique = 1
	hdr.NodeId = fuse.FUSE_ROOT_ID
	hdr.Pid = uint32(os.Getpid())
	b := unsafe.Slice((*byte)(unsafe.Pointer(&hdr)), unsafe.Sizeof(hdr))
	if _, err := unix.Write(sp[1], b); err != nil {
		unix.Close(sp[0])
		unix.Close(sp[1])
		return -1, -1, fmt.Errorf("first request socket: %w", err)
	}
	return sp[0], sp[1], nil
}

// pollHack has the kernel learn that the mount answers no POLL: go-fuse's
// WaitMount does it after mounting itself, not for a "/dev/fd/N" mount, and
// a daemon that opens its own files (liveMount) must not wait on a POLL.
// Once the mount is served (goLive).
func pollHack(mountpoint string) {
	fd, err := unix.Open(filepath.Join(mountpoint, pollHackName), unix.O_RDONLY, 0)
	if err != nil {
		return
	}
	_, _ = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLPRI | unix.POLLOUT}}, 0)
	unix.Close(fd)
}

// Handover stops serving the mount at a request boundary, for a successor:
// the descriptor turns non-blocking, so go-fuse's readers leave at the next
// empty queue (idle ones are woken with STATFS requests of our own); a
// request a reader took is answered first. It returns the descriptor to
// pass (the caller sends it, then calls Finish) and the open handles. A
// request still in flight after drain (a barrier waiting on a slow fetch)
// is answered after the handover, by this daemon, through its own
// descriptor; the successor reads through a clone of its own.
func (s *Server) Handover(drain time.Duration) (*os.File, Session, error) {
	s.mu.Lock()
	srv, dev, mp := s.srv, s.dev, s.mountpoint
	s.mu.Unlock()
	if srv == nil || dev == nil {
		return nil, Session{}, errors.New("handover: not serving")
	}
	s.handingOver.Store(true)
	if err := setNonblock(dev); err != nil {
		return nil, Session{}, fmt.Errorf("handover: %w", err)
	}
	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	// Readers blocked in read(2) leave only once a request wakes them.
	go func() {
		for i := 0; i < 64; i++ {
			select {
			case <-done:
				return
			case <-time.After(2 * time.Millisecond):
			}
			go func() { var st unix.Statfs_t; _ = unix.Statfs(mp, &st) }()
		}
	}()
	start := time.Now()
	select {
	case <-done:
		s.log.Info("handover: every request read is answered", zap.Duration("took", time.Since(start)))
	case <-time.After(drain):
		s.log.Warn("handover: requests still in flight; they are answered after the handover", zap.Duration("waited", drain))
	}
	return dev, s.rawFS.snapshot(), nil
}

// Resume serves the mount again after a Handover whose successor never
// took it (it died, or refused): through a clone of the connection, with
// the same tree, registrations and handles, so the kernel notices nothing
// but the wait. The descriptor's non-blocking mode stays the old
// descriptor's; requests still in flight are answered as they finish.
func (s *Server) Resume() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dev == nil || s.mountpoint == "" {
		return errors.New("resume: not serving")
	}
	old, mp := s.dev, s.mountpoint
	fd, err := cloneDev(old)
	if err != nil {
		return fmt.Errorf("resume %s: %w", mp, err)
	}
	srv, err := s.serveDev(fd, true)
	if err != nil {
		return fmt.Errorf("resume %s: %w", mp, err)
	}
	_ = old.Close()
	go srv.Serve()
	s.srv = srv
	s.handingOver.Store(false)
	s.log.Warn("handover: serving the mount again", zap.String("mountpoint", mp))
	return nil
}

// Finish waits (at most wait) for the requests this daemon read to be
// answered, after a Handover; the caller then releases everything but the
// mount, which the successor serves. It returns false on timeout.
func (s *Server) Finish(wait time.Duration) bool {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	if srv == nil {
		return true
	}
	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(wait):
		return false
	}
}

// Release lets go of the mount after a handover: stop pushing, close the
// daemon's own opens and its descriptor, never unmount.
func (s *Server) Release() {
	s.Close()
	s.closeDev()
	s.mu.Lock()
	s.srv = nil
	s.mu.Unlock()
}

// closeDev closes the daemon's duplicate of the connection's descriptor.
func (s *Server) closeDev() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeDevLocked()
}

func (s *Server) closeDevLocked() {
	if s.dev != nil {
		_ = s.dev.Close()
		s.dev = nil
	}
}

func setNonblock(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetNonblock(int(fd), true) }); err != nil {
		return err
	}
	return serr
}

// TakeOver serves the live mount at mountpoint, which another daemon
// serves until handover returns: a descriptor of the connection, from that
// daemon (it stops reading first) or from the service manager, and the
// open handles. It reads through a clone of the connection, so the
// descriptor's blocking mode (its predecessor's) is not its business; dev
// is not kept. With resend, the kernel is asked to queue again the requests
// a predecessor read and never answered (one that died). The daemon's own
// view of the table files is opened first, through the predecessor, so
// pushes work from the first request on. On return the mount is served as
// after Serve.
func (s *Server) TakeOver(mountpoint string, handover func() (*os.File, Session, error), resend bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		return fmt.Errorf("take over %s: already serving %s", mountpoint, s.mountpoint)
	}
	ready := make(chan struct{})
	// A dead predecessor serves nothing: its successor opens its files once
	// it serves (until then a Confirm fails; pushes work).
	live := &liveMount{ready: ready}
	if !resend {
		var err error
		if live, err = s.openLive(mountpoint, ready); err != nil {
			return fmt.Errorf("take over %s: %w", mountpoint, err)
		}
	}
	dev, sess, err := handover()
	if err != nil {
		live.close()
		return fmt.Errorf("take over %s: %w", mountpoint, err)
	}
	defer dev.Close()
	fd, err := cloneDev(dev)
	if err != nil {
		live.close()
		return fmt.Errorf("take over %s: %w", mountpoint, err)
	}
	s.registerTree()
	if err := s.rawFS.replay(sess); err != nil {
		// Reopened on first use instead (an orphan), or EBADF.
		s.log.Warn("take over: open handles not carried over", zap.Error(err))
	}
	// Pushes wait for ready: go-fuse can write nothing else to the
	// kernel before NewServer returns.
	s.live.Store(live)
	srv, err := s.serveDev(fd, true)
	if err != nil {
		s.live.Store(nil)
		live.close()
		return fmt.Errorf("take over %s: %w", mountpoint, err)
	}
	close(ready)
	go srv.Serve()
	s.srv, s.mountpoint = srv, mountpoint
	if resend {
		if err := notifyResend(s.dev); err != nil {
			s.log.Warn("take over: asking the kernel to resend unanswered requests failed", zap.Error(err))
		}
		full, err := s.openLive(mountpoint, closedReady)
		if err != nil {
			return fmt.Errorf("take over %s: %w", mountpoint, err)
		}
		s.live.Store(full)
	}
	if _, err := os.ReadFile(filepath.Join(mountpoint, ManifestFile)); err != nil {
		// The mount is the readers': never unmount it here.
		return fmt.Errorf("take over %s: the mount does not answer: %w", mountpoint, err)
	}
	return nil
}

// Dev is the descriptor of the served connection (for the service
// manager's file descriptor store); nil before Serve.
func (s *Server) Dev() *os.File {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dev
}

// cloneDev opens a new /dev/fuse attached to dev's connection.
func cloneDev(dev *os.File) (int, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	rc, err := dev.SyscallConn()
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	var ierr error
	if err := rc.Control(func(old uintptr) { ierr = unix.IoctlSetPointerInt(fd, fuseDevIocClone, int(old)) }); err != nil {
		ierr = err
	}
	if ierr != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("cloning the FUSE connection: %w", ierr)
	}
	return fd, nil
}

// notifyResend writes FUSE_NOTIFY_RESEND: an out header alone.
func notifyResend(dev *os.File) error {
	var b [16]byte
	b[0] = 16
	neg := int32(fuseNotifyResend)
	b[4], b[5], b[6], b[7] = byte(neg), byte(neg>>8), byte(neg>>16), byte(neg>>24)
	_, err := dev.Write(b[:])
	return err
}

// caller is who the daemon's own in-process requests come from.
func (s *Server) caller() fuse.Caller {
	return fuse.Caller{Owner: fuse.Owner{Uid: s.root.o.uid, Gid: s.root.o.gid}, Pid: uint32(os.Getpid())}
}

// registerTree looks up every node of the tree once, as the kernel did
// for its predecessor, so a request for any node the kernel knows finds
// it. Holding s.mu, before any request is read.
func (s *Server) registerTree() {
	var walk func(parent *gofs.Inode)
	walk = func(parent *gofs.Inode) {
		for name, ch := range parent.Children() {
			var out fuse.EntryOut
			h := &fuse.InHeader{NodeId: nodeID(parent), Caller: s.caller()}
			if st := s.rawFS.Lookup(nil, h, name, &out); !st.Ok() {
				s.log.Warn("take over: lookup of a node failed", zap.String("name", name), zap.Stringer("status", st))
				continue
			}
			walk(ch)
		}
	}
	walk(&s.root.Inode)
}

// nodeID is n's FUSE node ID: its inode number (ExternalNodeID), the
// root's 1.
func nodeID(n *gofs.Inode) uint64 {
	if n.IsRoot() {
		return fuse.FUSE_ROOT_ID
	}
	return n.StableAttr().Ino
}

// reopen is how a successor opens a handle the kernel holds from a
// predecessor (sessionFS.reopenAs): as the kernel's reader's open, not one
// of the daemon's own (ownOpen: Pid 0 is no thread of ours), so a table or
// model file handle gets its readahead as the reader's had; with the
// daemon's owner, since the kernel let the holder open it. A control
// handle is reopened when handed over; a crash's orphan of one is not (its
// hint stream is gone; the clients reopen on EBADF).
func (s *Server) reopen(node uint64, orphan bool) (fuse.Caller, uint32, bool) {
	caller := s.caller()
	caller.Pid = 0
	if node == s.controlNode() {
		return caller, uint32(os.O_RDWR), !orphan
	}
	return caller, uint32(os.O_RDONLY), true
}

func (s *Server) controlNode() uint64 { return s.controlDirChild(ControlFile) }

func (s *Server) controlDirChild(name string) uint64 {
	d := s.root.GetChild(ControlDir)
	if d == nil {
		return 0
	}
	if c := d.GetChild(name); c != nil {
		return nodeID(c)
	}
	return 0
}

// goFuseLog routes go-fuse's own log lines to zap. During a handover every
// reader leaving logs "Failed to read from fuse conn: resource temporarily
// unavailable": expected there, so at debug.
type goFuseLog struct {
	s *Server
}

func (w goFuseLog) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if w.s.handingOver.Load() && strings.Contains(msg, syscall.EAGAIN.Error()) {
		w.s.log.Debug("go-fuse: "+msg, zap.String("during", "handover"))
	} else {
		w.s.log.Warn("go-fuse: " + msg)
	}
	return len(p), nil
}

func newGoFuseLogger(s *Server) *log.Logger { return log.New(goFuseLog{s}, "", 0) }

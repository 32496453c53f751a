package main

// engramfs restart: a new daemon takes the live mount over from the running
// one (fs/handover.go), so no reader sees an error. The daemons meet on a
// unix socket named after the mountpoint; the running one passes its
// /dev/fuse descriptor (SCM_RIGHTS), the open handles, the hot set and the
// pages served (cache.Seen), and exits without unmounting once its
// successor serves.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/sdnotify"
	"github.com/engramfs/engramfs/warm"
)

func init() {
	register("restart", "hand a live mount to a new daemon (upgrade, restart) without readers noticing", runRestart)
}

// runDirEnv overrides defaultRunDir, where daemons listen for a successor.
const (
	runDirEnv     = "ENGRAMFS_RUN_DIR"
	defaultRunDir = "/run/engramfs"
)

// Bounds of a handover. drain: how long the old daemon waits for the
// requests it read to be answered before it passes the descriptor anyway
// (a barrier on a slow fetch; it answers them afterwards). The rest bound
// waits that only a broken peer would exhaust.
const (
	handoverDrain   = 2 * time.Second
	handoverFinish  = 30 * time.Second
	handoverServing = 60 * time.Second
	maxStateBytes   = 64 << 20 // a 16 GiB tier's hot set is 16 MiB of keys
)

// handoverSocket is where the daemon serving mountpoint listens.
func handoverSocket(mountpoint string) (string, error) {
	abs, err := filepath.Abs(mountpoint)
	if err != nil {
		return "", err
	}
	dir := os.Getenv(runDirEnv)
	if dir == "" {
		dir = defaultRunDir
	}
	sum := sha256.Sum256([]byte(filepath.Clean(abs)))
	return filepath.Join(dir, "handover-"+hex.EncodeToString(sum[:8])+".sock"), nil
}

// handoverMsg is one line of the handover protocol, either way.
type handoverMsg struct {
	Op string `json:"op"` // "status", "handover", "serving"; replies: "status", "state", "error"

	// status
	Pid        int      `json:"pid,omitempty"`
	Args       []string `json:"args,omitempty"`
	Mountpoint string   `json:"mountpoint,omitempty"`
	// TakeoverMS is how long this daemon's takeover took: from asking its
	// predecessor to serving (what a reader waited at most).
	TakeoverMS float64 `json:"takeover_ms,omitempty"`

	// state (the descriptors travel with its first byte)
	Session fs.Session `json:"session"`
	Hot     []byte     `json:"hot,omitempty"` // warm.Encode of the hot set
	// Seen is cache.Seen.Encode of the pages the predecessor put in the
	// page cache: the successor's residency lookups skip the others, and
	// it counts their second reads (backing_pages_again).
	Seen []byte `json:"seen,omitempty"`

	Error string `json:"error,omitempty"`
}

// handoverListener is a daemon's socket: it answers status itself and
// hands a successor's request to the main loop.
type handoverListener struct {
	ln   *net.UnixListener
	path string
	reqs chan *net.UnixConn
}

// listenHandover listens for a successor of the daemon serving mountpoint.
func (d *daemon) listenHandover(mountpoint string) (*handoverListener, error) {
	path, err := handoverSocket(mountpoint)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("handover socket: %w", err)
	}
	_ = os.Remove(path) // a crashed daemon's
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("handover socket: %w", err)
	}
	_ = os.Chmod(path, 0o600)
	l := &handoverListener{ln: ln, path: path, reqs: make(chan *net.UnixConn)}
	go l.accept(d)
	return l, nil
}

func (l *handoverListener) accept(d *daemon) {
	for {
		conn, err := l.ln.AcceptUnix()
		if err != nil {
			return
		}
		go l.serve(d, conn)
	}
}

func (l *handoverListener) serve(d *daemon, conn *net.UnixConn) {
	if err := samePeer(conn); err != nil {
		d.log.Warn("handover socket: refused a connection", zap.Error(err))
		conn.Close()
		return
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	var m handoverMsg
	if err := json.NewDecoder(conn).Decode(&m); err != nil {
		conn.Close()
		return
	}
	_ = conn.SetReadDeadline(time.Time{})
	switch m.Op {
	case "status":
		_ = json.NewEncoder(conn).Encode(handoverMsg{Op: "status", Pid: os.Getpid(), Args: os.Args[1:],
			Mountpoint: d.srv.Mountpoint(), TakeoverMS: d.takeoverMS})
		conn.Close()
	case "handover":
		select {
		case l.reqs <- conn: // the main loop owns it now
		case <-time.After(10 * time.Second):
			_ = json.NewEncoder(conn).Encode(handoverMsg{Op: "error", Error: "the daemon is stopping"})
			conn.Close()
		}
	default:
		_ = json.NewEncoder(conn).Encode(handoverMsg{Op: "error", Error: "unknown op " + strconv.Quote(m.Op)})
		conn.Close()
	}
}

// close stops listening and removes the socket.
func (l *handoverListener) close() {
	if l == nil {
		return
	}
	_ = l.ln.Close() // removes the path (net unlinks on close)
}

// samePeer admits the daemon's own user (and root) only: the descriptor
// serves whatever its holder answers to every reader of the mount.
func samePeer(conn *net.UnixConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer pid %d uid %d is neither root nor the daemon's user", cred.Pid, cred.Uid)
	}
	return nil
}

// handOver passes the mount to the successor on conn: stop reading at a
// request boundary, send the descriptor (with this daemon's stdout and
// stderr, so the logs go on where they went), the open handles and the hot
// set; wait for the successor to serve; answer what is still in flight.
// Then d.handedOver is set and the caller releases everything but the
// mount (stop). A successor that dies or refuses before it serves leaves
// the mount with this daemon, which serves it again (Server.Resume).
func (d *daemon) handOver(conn *net.UnixConn) error {
	defer conn.Close()
	start := time.Now()
	// The successor binds the socket once it serves (the caller listens
	// again if it does not).
	d.handover.close()
	dev, sess, err := d.srv.Handover(handoverDrain)
	if err != nil {
		_ = json.NewEncoder(conn).Encode(handoverMsg{Op: "error", Error: err.Error()})
		return err
	}
	resume := func(why error) error {
		if rerr := d.srv.Resume(); rerr != nil {
			// Nothing left to serve with: the kernel keeps the requests
			// queued for a `mount --takeover` (or the fd store's restart).
			d.log.Error("handover failed and serving again failed: the mount waits for a daemon",
				zap.NamedError("handover", why), zap.Error(rerr))
			d.handedOver = true // never unmount it under its readers
			return why
		}
		return why
	}
	keys := d.hotSet()
	hot, err := warm.Encode(d.model, keys)
	if err != nil {
		d.log.Warn("handover: the hot set is not carried over", zap.Error(err))
	}
	// Taken once requests stopped coming in; a store still in flight may
	// land after it, and the successor then only asks mincore of fewer
	// pages than it could (and reads such a page again if a hint asks).
	seen := d.seen.Encode()
	if len(seen) > maxStateBytes/2 {
		d.log.Warn("handover: the pages served are not carried over (too many tables)", zap.Int("bytes", len(seen)))
		seen = nil
	}
	rights := unix.UnixRights(int(dev.Fd()), 1, 2)
	if _, _, err := conn.WriteMsgUnix([]byte{'F'}, rights, nil); err != nil {
		return resume(fmt.Errorf("handover: passing the descriptor: %w", err))
	}
	if err := json.NewEncoder(conn).Encode(handoverMsg{Op: "state", Session: sess, Hot: hot, Seen: seen, Pid: os.Getpid()}); err != nil {
		return resume(fmt.Errorf("handover: sending the state: %w", err))
	}
	d.log.Info("handover: descriptor, handles, hot set and pages served passed", zap.Int("handles", len(sess.Handles)),
		zap.Int("hot_pages", len(keys)), zap.Duration("took", time.Since(start)))
	_ = conn.SetReadDeadline(time.Now().Add(handoverServing))
	var m handoverMsg
	if err := json.NewDecoder(conn).Decode(&m); err != nil || m.Op != "serving" {
		return resume(fmt.Errorf("handover: the successor never said it serves (%v)", err))
	}
	d.log.Info("handover: the successor serves", zap.Int("successor_pid", m.Pid))
	d.handedOver = true
	// The successor binds the metrics address now.
	if d.metrics != nil {
		_ = d.metrics.Close()
		d.metrics = nil
	}
	if !d.srv.Finish(handoverFinish) {
		d.log.Warn("handover: requests still unanswered; exiting anyway", zap.Duration("waited", handoverFinish))
	}
	return nil
}

// hotSet is the tier's pages, then those a warm-up in progress had not
// settled (they were hot before this run too).
func (d *daemon) hotSet() []cache.PageKey {
	keys := d.hot.Keys()
	if d.warm == nil {
		return keys
	}
	seen := make(map[cache.PageKey]struct{}, len(keys))
	for _, k := range keys {
		seen[k] = struct{}{}
	}
	for _, k := range d.warm.Pending() {
		if _, ok := seen[k]; !ok && len(keys) < tierPages(d.st) {
			keys = append(keys, k)
		}
	}
	return keys
}

// predecessor is the connection to the daemon a takeover came from, until
// this one serves.
type predecessor struct {
	conn *net.UnixConn
	pid  int
}

// takeOver asks the daemon serving mountpoint for the mount and serves it
// (mount --takeover). The predecessor waits for tellServing.
func (d *daemon) takeOver(mountpoint string) error {
	start := time.Now()
	path, err := handoverSocket(mountpoint)
	if err != nil {
		return err
	}
	conn, err := dialHandover(path)
	if err != nil {
		return fmt.Errorf("--takeover %s: no daemon to take over from: %w", mountpoint, err)
	}
	fail := func(err error) error { conn.Close(); return fmt.Errorf("--takeover %s: %w", mountpoint, err) }
	var m handoverMsg
	handover := func() (*os.File, fs.Session, error) {
		if err := json.NewEncoder(conn).Encode(handoverMsg{Op: "handover", Pid: os.Getpid()}); err != nil {
			return nil, fs.Session{}, err
		}
		_ = conn.SetReadDeadline(time.Now().Add(handoverServing))
		b := make([]byte, 1)
		oob := make([]byte, unix.CmsgSpace(3*4))
		n, oobn, _, _, err := conn.ReadMsgUnix(b, oob)
		if err != nil {
			return nil, fs.Session{}, err
		}
		fds, err := parseRights(oob[:oobn])
		if err != nil || n != 1 || b[0] != 'F' || len(fds) != 3 {
			for _, fd := range fds {
				unix.Close(fd)
			}
			// The predecessor explains itself in a JSON line instead.
			var m handoverMsg
			if derr := json.NewDecoder(io.MultiReader(bytes.NewReader(b[:n]), conn)).Decode(&m); derr == nil && m.Error != "" {
				return nil, fs.Session{}, errors.New(m.Error)
			}
			return nil, fs.Session{}, fmt.Errorf("no descriptor passed (%v)", err)
		}
		// The logs go on where the predecessor's went.
		_ = unix.Dup3(fds[1], 1, 0)
		_ = unix.Dup3(fds[2], 2, 0)
		unix.Close(fds[1])
		unix.Close(fds[2])
		dev := os.NewFile(uintptr(fds[0]), "/dev/fuse")
		if err := json.NewDecoder(io.LimitReader(conn, maxStateBytes)).Decode(&m); err != nil || m.Op != "state" {
			dev.Close()
			return nil, fs.Session{}, fmt.Errorf("reading the state: %v", err)
		}
		_ = conn.SetReadDeadline(time.Time{})
		return dev, m.Session, nil
	}
	if err := d.srv.TakeOver(mountpoint, handover, false); err != nil {
		return fail(err)
	}
	d.takeoverMS = float64(time.Since(start).Microseconds()) / 1000
	if len(m.Hot) > 0 {
		keys, _, err := warm.Decode(m.Hot, d.model, tierPages(d.st))
		if err != nil {
			d.log.Warn("takeover: the predecessor's hot set is not usable", zap.Error(err))
		}
		d.warmKeys = keys
	}
	if len(m.Seen) > 0 {
		if err := d.seen.Restore(m.Seen); err != nil {
			d.log.Warn("takeover: the predecessor's served pages are not usable; every residency lookup asks the kernel", zap.Error(err))
		}
	}
	d.pred = &predecessor{conn: conn, pid: m.Pid}
	d.inherited = true
	d.log.Info("took the mount over", zap.String("mountpoint", mountpoint), zap.Int("predecessor_pid", m.Pid),
		zap.Int("handles", len(m.Session.Handles)), zap.Int("hot_pages", len(d.warmKeys)),
		zap.Float64("took_ms", d.takeoverMS))
	return nil
}

// tellServing lets the predecessor go (after the service manager knows
// this daemon as the main one).
func (d *daemon) tellServing() {
	d.inherited = false
	if d.pred == nil {
		return
	}
	_ = json.NewEncoder(d.pred.conn).Encode(handoverMsg{Op: "serving", Pid: os.Getpid()})
	d.pred.conn.Close()
	d.pred = nil
}

func dialHandover(path string) (*net.UnixConn, error) {
	return net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		r, err := unix.ParseUnixRights(&m)
		if err != nil {
			return fds, err
		}
		fds = append(fds, r...)
	}
	return fds, nil
}

// daemonStatus asks the daemon serving mountpoint who it is.
func daemonStatus(mountpoint string) (handoverMsg, error) {
	path, err := handoverSocket(mountpoint)
	if err != nil {
		return handoverMsg{}, err
	}
	conn, err := dialHandover(path)
	if err != nil {
		return handoverMsg{}, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if err := json.NewEncoder(conn).Encode(handoverMsg{Op: "status"}); err != nil {
		return handoverMsg{}, err
	}
	var m handoverMsg
	if err := json.NewDecoder(bufio.NewReader(conn)).Decode(&m); err != nil {
		return handoverMsg{}, err
	}
	return m, nil
}

func runRestart(args []string) error {
	fl := newFlagSet("restart", "[flags] MOUNTPOINT", `
Hands the live mount at MOUNTPOINT to a new daemon, started from this
engramfs binary with the running daemon's own command line plus --takeover
(an upgrade: install the new binary, then restart). The running daemon stops
reading requests at a request boundary, answers those it read, and passes
the FUSE connection (its /dev/fuse descriptor, over a unix socket in
$ENGRAMFS_RUN_DIR, default /run/engramfs), the open handles and the hot set
to the new one, which pins the hot set again; then it exits without
unmounting. Readers, mapped tables included, only wait: no SIGBUS, EIO or
ENOTCONN. The new daemon logs where the old one did. Returns once the new
daemon serves; prints both pids and how long readers waited at most.`)
	timeout := fl.Duration("timeout", 2*time.Minute, "give up when the new daemon does not serve within this long (it loads the model first)")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 1 {
		return usagef("want MOUNTPOINT, got %d arguments", fl.NArg())
	}
	mp := fl.Arg(0)
	old, err := daemonStatus(mp)
	if err != nil {
		return fmt.Errorf("%s: no engramfs daemon answers for it (%v); is it mounted by engramfs 'mount'?", mp, err)
	}
	argv := takeoverArgs(old.Args)
	if argv == nil {
		return fmt.Errorf("%s: the daemon (pid %d) was started as %q, not by 'engramfs mount'", mp, old.Pid, old.Args)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, argv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// stdin, stdout and stderr stay /dev/null: the new daemon takes the old
	// one's stdout and stderr over.
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.After(*timeout)
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("%s: the new daemon (pid %d) exited before serving: %v; the old one (pid %d) still serves (see its log)", mp, cmd.Process.Pid, err, old.Pid)
		case <-deadline:
			_ = cmd.Process.Kill()
			return fmt.Errorf("%s: the new daemon (pid %d) did not serve within %v; killed it", mp, cmd.Process.Pid, *timeout)
		case <-time.After(20 * time.Millisecond):
		}
		st, err := daemonStatus(mp)
		if err != nil || st.Pid != cmd.Process.Pid {
			continue
		}
		fmt.Printf("%s: pid %d handed the mount to pid %d; readers waited at most %.1f ms\n", mp, old.Pid, st.Pid, st.TakeoverMS)
		return nil
	}
}

// takeoverArgs is a daemon's command line (os.Args[1:]) with --takeover,
// or nil when it is not a mount.
func takeoverArgs(args []string) []string {
	if len(args) == 0 || args[0] != "mount" {
		return nil
	}
	if slices.Contains(args, "--takeover") || slices.Contains(args, "-takeover") {
		return slices.Clone(args)
	}
	return append([]string{"mount", "--takeover"}, args[1:]...)
}

// fdStoreName names the FUSE connection in systemd's file descriptor store.
const fdStoreName = "engramfs-fuse"

// storeConnection keeps the mount's FUSE connection in the service
// manager's file descriptor store (FileDescriptorStoreMax= in the unit):
// when the daemon dies, the mount stays alive (readers wait instead of
// getting ENOTCONN or SIGBUS) and the next start takes it over. Without a
// service manager it does nothing; one that keeps no descriptors ignores
// it.
func (d *daemon) storeConnection() {
	dev := d.srv.Dev()
	if dev == nil || os.Getenv(sdnotify.SocketEnv) == "" {
		return
	}
	rc, err := dev.SyscallConn()
	if err != nil {
		return
	}
	_ = sdnotify.Notify("FDSTOREREMOVE=1\nFDNAME=" + fdStoreName)
	if cerr := rc.Control(func(fd uintptr) {
		err = sdnotify.NotifyFds("FDSTORE=1\nFDNAME="+fdStoreName, int(fd))
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		d.log.Warn("keeping the FUSE connection in the service manager's file descriptor store failed", zap.Error(err))
	}
}

// storedConnection is the FUSE connection of the live engramfs mount at
// mountpoint that the service manager kept for this start (a predecessor
// died), or nil.
func storedConnection(mountpoint string, log *zap.Logger) *os.File {
	fds := sdnotify.ListenFds(fdStoreName)
	if len(fds) == 0 {
		return nil
	}
	for _, f := range fds[1:] {
		f.Close()
	}
	abs, _ := filepath.Abs(mountpoint)
	ms, _ := procfs.Mounts()
	for _, m := range ms {
		if m.Point == abs && m.FSType == "fuse.engramfs" {
			return fds[0]
		}
	}
	log.Info("the service manager kept a FUSE connection, but no engramfs mount is at the mountpoint any more: mounting afresh",
		zap.String("mountpoint", mountpoint))
	fds[0].Close()
	return nil
}

// notifyMainPID is what a daemon that took over tells the service manager
// first: it is the service's main process now (NotifyAccess=all).
func notifyMainPID() string { return "MAINPID=" + strconv.Itoa(os.Getpid()) + "\n" }

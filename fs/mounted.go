package fs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// FSType is an engramfs mount's type in /proc/self/mountinfo: go-fuse
// mounts "fuse." + MountOptions.Name, and its source is the model directory
// (MountOptions.FsName).
const FSType = "fuse.engramfs"

// Which mount at a path is ours. Linux unmounts by path, and a path reaches
// only the last mount stacked on it: an unmount or a lazy detach by path
// takes whatever is on top. A daemon's stop that raced a second mount on
// its path (~150 ms between SIGTERM and its unmount) detached the second
// one, and both exited 0. So the server remembers its mount's ID and device
// (mountinfo's, from statx at mount), and before each unmount checks that
// the path's top mount is its own: covered, it leaves its mount where it is
// (no call reaches it without reaching the one on top). What is left is a
// window of microseconds between the check and umount2(2), not the stop's
// hundreds of milliseconds. Opening the mount's root at mount and
// unmounting through /proc/self/fd/N does not close it (measured, two
// stacked tmpfs, 6.18): uncovered, the open itself keeps the mount busy
// (EBUSY); covered, the call unmounts the mount on top, as the path does.

// ownMount identifies the mount Serve made.
type ownMount struct {
	id   int    // mountinfo's mount ID (0: unknown)
	dev  string // its device, "MAJ:MIN"
	path string // its mountpoint, as mountinfo writes it
}

// mountState is where the server's own mount is in the mount table.
type mountState int

const (
	mountTop     mountState = iota // the path reaches it
	mountCovered                   // another mount is stacked on it at its path
	mountGone                      // unmounted, or detached lazily
)

// MountPath is p as mountinfo writes mountpoints: absolute, clean, the
// symlinks of its directories resolved. p itself is not looked up unless
// it is a symlink: a dead mount answers ENOTCONN to a lookup of its root.
func MountPath(p string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	if fi, err := os.Lstat(abs); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		return filepath.EvalSymlinks(abs)
	}
	if abs == "/" {
		return abs, nil
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(abs))
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, filepath.Base(abs)), nil
}

// findOwnMount identifies the mount just made on mountpoint: the mount ID
// and device a lookup of mountpoint reaches (statx), which must be an
// engramfs mount in the mount table.
func findOwnMount(mountpoint string) (ownMount, error) {
	path, err := MountPath(mountpoint)
	if err != nil {
		return ownMount{}, err
	}
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &stx); err != nil {
		return ownMount{}, fmt.Errorf("statx %s: %w", path, err)
	}
	own := ownMount{id: int(stx.Mnt_id), dev: fmt.Sprintf("%d:%d", stx.Dev_major, stx.Dev_minor), path: path}
	ms, err := procfs.Mounts()
	if err != nil {
		return ownMount{}, err
	}
	if stx.Mask&unix.STATX_MNT_ID == 0 { // before Linux 5.8: the top mount
		top, ok := procfs.Top(ms, path)
		if !ok {
			return ownMount{}, fmt.Errorf("%s is not in the mount table", path)
		}
		own.id = top.ID
	}
	m, ok := procfs.ByID(ms, own.id)
	if !ok || m.FSType != FSType || m.Dev != own.dev || m.Point != path {
		return ownMount{}, fmt.Errorf("the mount at %s is not the new engramfs mount (%s): %+v", path, own.dev, m)
	}
	return own, nil
}

// state is where the own mount is now; cover is the mount stacked on it
// when it is covered.
func (o ownMount) state() (st mountState, cover procfs.Mount, err error) {
	ms, err := procfs.Mounts()
	if err != nil {
		return mountGone, cover, err
	}
	m, ok := procfs.ByID(ms, o.id)
	// An ID is reused once its mount is gone; the device is not while our
	// connection lives (a detached mount's does until its last user goes).
	if !ok || m.Dev != o.dev {
		return mountGone, cover, nil
	}
	if c, ok := procfs.Covering(ms, m); ok {
		return mountCovered, c, nil
	}
	return mountTop, cover, nil
}

// onTop says whether an unmount by path would reach the own mount now. When
// it would not, the mount was detached from outside (nothing to do), or it
// is covered: it stays where it is, logged, dead once the daemon exits, for
// engramfs unmount or the next mount to clear. An unknown mount (a mount
// that failed before it was identified) is taken as on top.
func (o ownMount) onTop(log *zap.Logger) (bool, error) {
	if o.id == 0 {
		return true, nil
	}
	st, cover, err := o.state()
	switch {
	case err != nil:
		return false, fmt.Errorf("unmount %s: reading the mount table: %w", o.path, err)
	case st == mountGone:
		log.Info("mount already detached from outside", zap.String("mountpoint", o.path))
		return false, nil
	case st == mountCovered:
		log.Warn("mount covered by another mount at its path: not unmounting (that would detach the one on top); "+
			"it is left in place, dead once this daemon exits, and engramfs unmount or the next mount clears it",
			zap.String("mountpoint", o.path), zap.Int("mount_id", o.id),
			zap.Int("covered_by", cover.ID), zap.String("covered_by_type", cover.FSType), zap.String("covered_by_source", cover.Source))
		return false, nil
	}
	return true, nil
}

// watchInterval is how often Detached looks at the mount.
const watchInterval = 500 * time.Millisecond

// Detached returns a channel closed once the mount Serve made has left the
// mount table: unmounted, or detached lazily from outside (engramfs unmount
// on a busy mount), which keeps the connection alive while anything maps a
// file, the daemon's own pinned mappings included. A mount stacked on ours
// is not a detach: it is logged, and serving goes on. Before Serve the
// channel is never closed.
func (s *Server) Detached() <-chan struct{} {
	out := make(chan struct{})
	s.mu.Lock()
	if s.own.id == 0 && s.srv != nil {
		// A session Serve did not mount itself (one handed over): find
		// the mount it serves now.
		if own, err := findOwnMount(s.mountpoint); err == nil {
			s.own = own
		} else {
			s.log.Warn("watching the mount: cannot identify it; a detach from outside will not be seen", zap.Error(err))
		}
	}
	own := s.own
	s.mu.Unlock()
	if own.id == 0 {
		return out
	}
	go func() {
		covered := false
		for {
			time.Sleep(watchInterval)
			// The path's device is ours while our mount is on top: a stat
			// the kernel answers from the root's cached attributes. Only
			// when it is not is the mount table read.
			var st unix.Stat_t
			if err := unix.Stat(own.path, &st); err == nil && fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev)) == own.dev {
				covered = false
				continue
			}
			state, cover, err := own.state()
			switch {
			case err != nil:
				s.log.Warn("watching the mount: reading the mount table", zap.Error(err))
			case state == mountGone:
				close(out)
				return
			case state == mountCovered && !covered:
				covered = true
				s.log.Warn("mount covered by another mount at its path: still serving the handles open on it",
					zap.String("mountpoint", own.path), zap.Int("covered_by", cover.ID),
					zap.String("covered_by_type", cover.FSType), zap.String("covered_by_source", cover.Source))
			}
		}
	}()
	return out
}

// daemonPidTimeout bounds the read of a live mount's stats file: a daemon
// that is stopped (SIGSTOP) or stuck never answers it.
const daemonPidTimeout = 5 * time.Second

// DaemonPid is the pid of the daemon serving the engramfs mount at
// mountpoint, from its stats file (in the daemon's pid namespace). It gives
// up after a few seconds if the daemon does not answer.
func DaemonPid(mountpoint string) (int, error) {
	type answer struct {
		pid int
		err error
	}
	ch := make(chan answer, 1)
	go func() {
		s, err := stats.ReadFile(mountpoint)
		ch <- answer{s.Pid, err}
	}()
	select {
	case a := <-ch:
		if a.err == nil && a.pid <= 0 {
			a.err = errors.New("its stats file has no pid")
		}
		return a.pid, a.err
	case <-time.After(daemonPidTimeout):
		return 0, fmt.Errorf("its daemon did not answer within %v", daemonPidTimeout)
	}
}

// explainMountError says what a refused mount needs: engramfs mounts FUSE
// directly (mount(2), no fusermount), which takes root or CAP_SYS_ADMIN and
// a /dev/fuse it may open. Alone, the errno said only "permission denied"
// (/dev/fuse is 0600 on some systems) or "operation not permitted".
func explainMountError(err error) error {
	switch {
	case errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM):
		return fmt.Errorf("%w: engramfs mounts FUSE directly (mount(2), no fusermount), which needs root or CAP_SYS_ADMIN "+
			"and read-write access to /dev/fuse: run it as root (sudo engramfs mount ...); in a container: --device /dev/fuse --cap-add SYS_ADMIN", err)
	case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO):
		if _, serr := os.Stat("/dev/fuse"); serr != nil {
			return fmt.Errorf("%w: no /dev/fuse: load the fuse module (modprobe fuse); in a container: --device /dev/fuse", err)
		}
	}
	return err
}

package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/internal/procfs"
)

func init() {
	register("unmount", "unmount an engramfs mount (live or dead) and wait for its daemon", runUnmount)
}

// defaultStopTimeout bounds the wait for the daemon to save its warm state
// and exit after its mount went away.
const defaultStopTimeout = 60 * time.Second

func runUnmount(args []string) error {
	fl := newFlagSet("unmount", "[--force] [--timeout 60s] MOUNTPOINT", `
Unmounts the engramfs mount on MOUNTPOINT and waits until its daemon has
saved its hot set (--state-file) and exited, so a mount started right after
starts warm.

It refuses anything that is not an engramfs mount (mountinfo's type
fuse.engramfs), and, unless --force, a mount whose table files a process
maps: it names them (pid, command, files), since a reader's next cold page
after the unmount is SIGBUS. The daemon's own mappings (its pinned pages)
do not count. A mount that a reader still uses (EBUSY) is detached lazily:
it disappears from the tree at once and the kernel frees it when the last
user lets go. A dead mount (its daemon was killed: "transport endpoint is
not connected") is detached, mapped or not.

Exit status: 0 once the daemon has exited; 1 on a refusal, or when the
daemon has not exited within --timeout (the mount is gone then).`)
	force := fl.Bool("force", false, "unmount even while processes map table files (their next cold page is SIGBUS)")
	timeout := fl.Duration("timeout", defaultStopTimeout, "how long to wait for the daemon to save its state and exit")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 1 {
		return usagef("want MOUNTPOINT, got %d arguments", fl.NArg())
	}
	if *timeout <= 0 {
		return usagef("--timeout %v: want a positive duration such as 60s", *timeout)
	}
	return unmountEngramfs(fl.Arg(0), unmountOptions{force: *force, timeout: *timeout})
}

// unmountOptions are what engramfs unmount and the umount(8) helper ask.
type unmountOptions struct {
	force   bool          // unmount though processes map table files
	timeout time.Duration // for the daemon's exit
}

// unmountEngramfs unmounts the engramfs mount on mp (see engramfs unmount
// --help) and waits for its daemon.
func unmountEngramfs(mp string, o unmountOptions) error {
	path, err := fs.MountPath(mp)
	if err != nil {
		return fmt.Errorf("%s: %w", mp, err)
	}
	ms, err := procfs.Mounts()
	if err != nil {
		return fmt.Errorf("reading the mount table: %w", err)
	}
	top, ok := procfs.Top(ms, path)
	switch {
	case !ok:
		return fmt.Errorf("%s: not a mount point", mp)
	case top.FSType != fs.FSType:
		return fmt.Errorf("%s: a %s mount of %s, not an engramfs mount (%s): not unmounting it", mp, top.FSType, top.Source, fs.FSType)
	}
	var sfs unix.Statfs_t
	live := !errors.Is(unix.Statfs(path, &sfs), unix.ENOTCONN)
	pid := 0
	if live {
		// Without the pid, the daemon's own mappings would be named as a
		// reader's, and its exit could not be waited for.
		if pid, err = fs.DaemonPid(path); err != nil {
			fmt.Fprintf(os.Stderr, "engramfs unmount: %s: %v; not waiting for the daemon\n", mp, err)
		}
	}
	if live && !o.force {
		if err := refuseMapped(mp, path, pid); err != nil {
			return err
		}
	}
	err = unix.Unmount(path, 0)
	if errors.Is(err, unix.EBUSY) {
		// A reader (or the daemon's own pins) holds the mount. Detach it
		// lazily, if the path still reaches the same mount.
		if ms, rerr := procfs.Mounts(); rerr == nil {
			if now, ok := procfs.Top(ms, path); !ok || now.ID != top.ID {
				return fmt.Errorf("%s: the mount changed while unmounting it: not detaching", mp)
			}
		}
		err = unix.Unmount(path, unix.MNT_DETACH)
	}
	switch {
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("%s: not a mount point", mp)
	case err != nil:
		return fmt.Errorf("%s: %w", mp, err)
	}
	if pid > 0 && !waitGone(pid, o.timeout) {
		return fmt.Errorf("%s: unmounted, but its daemon (pid %d) has not exited within %v: it may still be saving its hot set "+
			"(--state-file), and a mount started before it exits may start cold; wait for it, or raise --timeout", mp, pid, o.timeout)
	}
	return nil
}

// refuseMapped is an error naming the processes other than the daemon
// (pid) and this one that map files of the mount on path, if any.
func refuseMapped(mp, path string, pid int) error {
	mappers, err := procfs.Mappers(path)
	if err != nil {
		return fmt.Errorf("%s: finding the processes that map its files: %w (--force unmounts without looking)", mp, err)
	}
	var named []string
	for _, m := range mappers {
		if m.Pid == pid || m.Pid == os.Getpid() {
			continue
		}
		files := make([]string, 0, len(m.Files))
		for _, f := range m.Files {
			rel, _ := filepath.Rel(path, f)
			files = append(files, rel)
		}
		if len(files) > 3 {
			files = append(files[:3], fmt.Sprintf("and %d more", len(files)-3))
		}
		named = append(named, fmt.Sprintf("pid %d (%s: %s)", m.Pid, m.Comm, strings.Join(files, ", ")))
	}
	if len(named) == 0 {
		return nil
	}
	return fmt.Errorf("%s: not unmounting: table files are mapped by %s; "+
		"their next page not in memory would be SIGBUS once the mount is gone. Stop them first, or unmount anyway with --force",
		mp, strings.Join(named, ", "))
}

// waitGone waits up to timeout for process pid to exit; it reports whether
// it did.
func waitGone(pid int, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); procfs.Alive(pid); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

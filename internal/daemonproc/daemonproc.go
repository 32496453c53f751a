// Package daemonproc runs the real engramfs binary as a child process:
// `engramfs mount` on a model, waiting until it has mounted, reading its
// stats, CPU time and memory, and stopping it with the check that its mount
// is gone. It is the one daemon harness of the bench and the end-to-end
// tests, which both want the daemon in its own process (its CPU and memory
// apart from the reader's, and a crash that is the daemon's alone).
package daemonproc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// How long a daemon may take to mount, and to exit after SIGTERM, by
// default (a race-enabled daemon on a busy 2-CPU machine is slow to start).
const (
	DefaultMountTimeout = 60 * time.Second
	DefaultStopTimeout  = 30 * time.Second
)

// CanMount says why this process cannot mount engramfs (nil if it can): the
// daemon mounts FUSE directly, without fusermount, which needs root and
// /dev/fuse.
func CanMount() error {
	if os.Geteuid() != 0 {
		return errors.New("not running as root (engramfs mounts FUSE directly, without fusermount)")
	}
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("cannot open /dev/fuse: %w", err)
	}
	f.Close()
	return nil
}

// Options say which daemon to start, on what.
type Options struct {
	Binary   string   // the engramfs executable
	ModelDir string   // the model to mount
	Flags    []string // flags of `engramfs mount`, before the model directory
	Env      []string // added to the daemon's environment ("KEY=value")
	// Wrapper, if set, is a command that ends by exec'ing the daemon's
	// command line, which is appended to it, so the daemon keeps the
	// wrapper's pid: e.g. capsh dropping a capability, or a shell setting a
	// ulimit.
	Wrapper []string
	// Mountpoint is where to mount. Empty: a fresh directory under
	// MountDir, which Stop removes.
	Mountpoint string
	// MountDir is where a fresh mountpoint is made (default os.TempDir()).
	// A run that counts what it left mounted gives a directory of its own,
	// so that other runs' mounts do not count.
	MountDir string
	// LogDir is where the daemon's log file is made (default os.TempDir()).
	LogDir string
	// Timeouts; zero means the defaults above.
	MountTimeout, StopTimeout time.Duration
}

// Daemon is an `engramfs mount` child process.
type Daemon struct {
	ModelDir   string
	Mountpoint string
	// LogPath is the file the daemon's output goes to. A file, not a pipe:
	// a daemon that blocks writing to a full pipe stops answering faults,
	// and a reader blocked in those faults may be the very process that was
	// to drain the pipe (seen: a 30 MB crash dump did exactly that). Stop
	// removes it when the daemon ends cleanly (Log still returns it).
	LogPath string

	cmd         *exec.Cmd
	ownMount    bool // Mountpoint was made here: Stop removes it
	stopTimeout time.Duration
	exited      chan struct{}
	exitErr     error // set before exited closes

	stopMu  sync.Mutex
	stopped bool  // GUARDED_BY(stopMu)
	stopErr error // GUARDED_BY(stopMu)

	keptMu sync.Mutex
	kept   *string // the log, once its file is removed; GUARDED_BY(keptMu)
}

// Start runs `engramfs mount [flags] modelDir mountpoint` and returns once
// the daemon logs "mounted" (console or JSON log format). If it exits first,
// does not mount in time or ctx ends, it is stopped and the error says why,
// with its log.
func Start(ctx context.Context, o Options) (*Daemon, error) {
	mountTimeout, stopTimeout := o.MountTimeout, o.StopTimeout
	if mountTimeout == 0 {
		mountTimeout = DefaultMountTimeout
	}
	if stopTimeout == 0 {
		stopTimeout = DefaultStopTimeout
	}
	d := &Daemon{ModelDir: o.ModelDir, Mountpoint: o.Mountpoint, stopTimeout: stopTimeout, exited: make(chan struct{})}
	if d.Mountpoint == "" {
		mp, err := os.MkdirTemp(o.MountDir, "engramfs-mnt-")
		if err != nil {
			return nil, err
		}
		d.Mountpoint, d.ownMount = mp, true
	}
	logf, err := os.CreateTemp(o.LogDir, "engramfs-daemon-*.log")
	if err != nil {
		d.removeMountpoint()
		return nil, err
	}
	defer logf.Close() // the child has its own descriptor
	d.LogPath = logf.Name()

	args := append([]string{o.Binary, "mount"}, o.Flags...)
	args = append(args, o.ModelDir, d.Mountpoint)
	args = append(append([]string(nil), o.Wrapper...), args...)
	d.cmd = exec.Command(args[0], args[1:]...)
	if len(o.Env) > 0 {
		d.cmd.Env = append(os.Environ(), o.Env...)
	}
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{
		// Its own process group: a Ctrl-C at the terminal reaches the caller
		// only, which unmaps its files before it stops the daemon.
		Setpgid: true,
		// If the caller dies without stopping it, the daemon still gets
		// SIGTERM, and SIGTERM unmounts.
		Pdeathsig: syscall.SIGTERM,
	}
	if err := d.cmd.Start(); err != nil {
		d.removeMountpoint()
		os.Remove(d.LogPath)
		return nil, fmt.Errorf("start %s: %w", o.Binary, err)
	}
	go func() {
		d.exitErr = d.cmd.Wait()
		close(d.exited)
	}()

	deadline := time.NewTimer(mountTimeout)
	defer deadline.Stop()
	for !d.loggedMounted() {
		select {
		case <-d.exited:
			err := fmt.Errorf("engramfs mount exited before mounting (%v):\n%s", d.exitErr, d.Summary())
			d.removeMountpoint()
			os.Remove(d.LogPath) // short, and all in err
			return nil, err
		case <-ctx.Done():
			err = ctx.Err()
		case <-deadline.C:
			err = fmt.Errorf("engramfs mount did not mount within %v:\n%s", mountTimeout, d.Summary())
		case <-time.After(10 * time.Millisecond):
			continue
		}
		if serr := d.Stop(); serr != nil {
			err = fmt.Errorf("%w; stopping it: %v", err, serr)
		}
		return nil, err
	}
	return d, nil
}

// loggedMounted reports whether the daemon has logged "mounted".
func (d *Daemon) loggedMounted() bool {
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return false
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if bytes.Contains(line, []byte("\tmounted\t")) { // console format
			return true
		}
		var e struct {
			Msg string `json:"msg"`
		}
		if json.Unmarshal(line, &e) == nil && e.Msg == "mounted" {
			return true
		}
	}
	return false
}

// Pid is the daemon's process id.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// Signal sends sig to the daemon.
func (d *Daemon) Signal(sig os.Signal) error { return d.cmd.Process.Signal(sig) }

// Exited is closed when the daemon process has exited.
func (d *Daemon) Exited() <-chan struct{} { return d.exited }

// ExitErr waits for the daemon to exit and returns its exit status.
func (d *Daemon) ExitErr() error { <-d.exited; return d.exitErr }

// Stats reads the mount's .engramfs/stats.
func (d *Daemon) Stats() (stats.Snapshot, error) { return stats.ReadFile(d.Mountpoint) }

// CPU is the CPU time the daemon has used so far (10 ms ticks).
func (d *Daemon) CPU() (time.Duration, error) { return procfs.CPU(d.Pid()) }

// Switches is the daemon's context switches so far, every thread's.
func (d *Daemon) Switches() (uint64, error) { return procfs.Switches(d.Pid()) }

// Mem is the daemon's resident memory now and at its peak.
func (d *Daemon) Mem() (procfs.Mem, error) { return procfs.ReadMem(d.Pid()) }

// Stop sends SIGTERM, waits for the daemon to exit, checks that the mount
// is gone and removes a mountpoint Start made. A daemon that does not exit
// in time is killed and its mount detached; that is an error, as is a
// non-zero exit. Unmap and close every file of the mount first, or the
// daemon can only detach it lazily. Calling Stop again returns the first
// call's result.
func (d *Daemon) Stop() error {
	d.stopMu.Lock()
	defer d.stopMu.Unlock()
	if d.stopped {
		return d.stopErr
	}
	d.stopped = true
	var errs []error
	select {
	case <-d.exited:
	default:
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		timer := time.NewTimer(d.stopTimeout)
		select {
		case <-d.exited:
			timer.Stop()
		case <-timer.C:
			_ = d.cmd.Process.Kill()
			<-d.exited
			errs = append(errs, fmt.Errorf("engramfs did not exit within %v of SIGTERM; killed it", d.stopTimeout))
		}
		if d.exitErr != nil && len(errs) == 0 {
			errs = append(errs, fmt.Errorf("engramfs exited with %v after SIGTERM", d.exitErr))
		}
	}
	if procfs.Mounted(d.Mountpoint) {
		_ = unix.Unmount(d.Mountpoint, unix.MNT_DETACH)
		errs = append(errs, fmt.Errorf("%s was still mounted after the daemon exited; detached it", d.Mountpoint))
	}
	if err := d.removeMountpoint(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		d.stopErr = fmt.Errorf("%w\n%s\n(the whole log is kept in %s)", err, d.Summary(), d.LogPath)
		return d.stopErr
	}
	if b, err := os.ReadFile(d.LogPath); err == nil {
		s := string(b)
		d.keptMu.Lock()
		d.kept = &s
		d.keptMu.Unlock()
		os.Remove(d.LogPath)
	}
	return nil
}

func (d *Daemon) removeMountpoint() error {
	if !d.ownMount {
		return nil
	}
	if err := os.Remove(d.Mountpoint); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Log is everything the daemon has printed so far.
func (d *Daemon) Log() string {
	d.keptMu.Lock()
	kept := d.kept
	d.keptMu.Unlock()
	if kept != nil {
		return *kept
	}
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return fmt.Sprintf("(daemon log %s: %v)", d.LogPath, err)
	}
	return string(b)
}

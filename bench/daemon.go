package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/stats"
)

// Daemon is an `engramfs mount` child process and its temporary mountpoint.
// The bench runs the daemon as its own process so that its CPU time and
// memory can be read from /proc, apart from the reader's.
type Daemon struct {
	Mountpoint string

	cmd     *exec.Cmd
	log     *tailBuffer
	mounted chan struct{}
	exited  chan struct{}
	exitErr error // set before exited closes
	stopped bool
}

// How long a daemon may take to mount, and to exit after SIGTERM.
const (
	mountTimeout = 60 * time.Second
	stopTimeout  = 30 * time.Second
)

// StartDaemon runs `bin mount [flags] modelDir MOUNTPOINT` on a fresh
// temporary mountpoint and returns once the daemon logs "mounted".
// env, if not empty, is added to the daemon's environment.
func StartDaemon(ctx context.Context, bin string, flags, env []string, modelDir string) (*Daemon, error) {
	mp, err := os.MkdirTemp("", "engramfs-bench-mnt-")
	if err != nil {
		return nil, err
	}
	args := append([]string{"mount", "--log-format", "json"}, flags...)
	args = append(args, modelDir, mp)
	d := &Daemon{
		Mountpoint: mp,
		cmd:        exec.Command(bin, args...),
		log:        &tailBuffer{max: 64 << 10},
		mounted:    make(chan struct{}),
		exited:     make(chan struct{}),
	}
	if len(env) > 0 {
		d.cmd.Env = append(os.Environ(), env...)
	}
	d.cmd.SysProcAttr = &syscall.SysProcAttr{
		// Its own process group: a Ctrl-C at the terminal reaches the bench
		// only, which unmaps its files before it stops the daemon.
		Setpgid: true,
		// If the bench dies without stopping it, the daemon still gets
		// SIGTERM, and SIGTERM unmounts.
		Pdeathsig: syscall.SIGTERM,
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		os.Remove(mp)
		return nil, err
	}
	d.cmd.Stdout, d.cmd.Stderr = pw, pw
	if err := d.cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		os.Remove(mp)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	pw.Close()
	logDone := make(chan struct{})
	go d.readLog(pr, logDone)
	go func() {
		err := d.cmd.Wait()
		<-logDone // every line the daemon wrote is in the buffer
		d.exitErr = err
		close(d.exited)
	}()

	timer := time.NewTimer(mountTimeout)
	defer timer.Stop()
	select {
	case <-d.mounted:
		return d, nil
	case <-d.exited:
		os.Remove(mp)
		return nil, fmt.Errorf("engramfs mount exited before mounting (%v):\n%s", d.exitErr, d.log.String())
	case <-timer.C:
		err = fmt.Errorf("engramfs mount did not mount within %v:\n%s", mountTimeout, d.log.String())
	case <-ctx.Done():
		err = ctx.Err()
	}
	if serr := d.Stop(); serr != nil {
		err = fmt.Errorf("%w; stopping it: %v", err, serr)
	}
	return nil, err
}

// readLog copies the daemon's log into the tail buffer and notices the
// "mounted" line (the daemon logs JSON: --log-format json).
func (d *Daemon) readLog(r io.ReadCloser, done chan<- struct{}) {
	defer close(done)
	defer r.Close()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	seen := false
	for sc.Scan() {
		line := sc.Bytes()
		d.log.Write(append(line, '\n'))
		if !seen {
			var e struct {
				Msg string `json:"msg"`
			}
			if json.Unmarshal(line, &e) == nil && e.Msg == "mounted" {
				seen = true
				close(d.mounted)
			}
		}
	}
	_, _ = io.Copy(io.Discard, r)
}

// Pid is the daemon's process id.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// Log is the tail of what the daemon printed.
func (d *Daemon) Log() string { return d.log.String() }

// Stats reads the mount's .engramfs/stats.
func (d *Daemon) Stats() (stats.Snapshot, error) {
	var s stats.Snapshot
	b, err := os.ReadFile(filepath.Join(d.Mountpoint, ".engramfs", "stats"))
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%s/.engramfs/stats: %w", d.Mountpoint, err)
	}
	return s, nil
}

// CPU is the CPU time the daemon has used so far.
func (d *Daemon) CPU() (time.Duration, error) { return ProcCPU(d.Pid()) }

// Mem is the daemon's resident memory now and at its peak.
func (d *Daemon) Mem() (ProcMem, error) { return ReadProcMem(d.Pid()) }

// Stop sends SIGTERM, waits for the daemon to exit, checks that the mount is
// gone and removes the mountpoint. A daemon that does not exit in time is
// killed and its mount detached; that is an error. Unmap and close every file
// of the mount first, or the daemon can only detach it lazily. Calling Stop
// again is a no-op.
func (d *Daemon) Stop() error {
	if d.stopped {
		return nil
	}
	d.stopped = true
	var errs []error
	select {
	case <-d.exited:
	default:
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		timer := time.NewTimer(stopTimeout)
		select {
		case <-d.exited:
			timer.Stop()
		case <-timer.C:
			_ = d.cmd.Process.Kill()
			<-d.exited
			errs = append(errs, fmt.Errorf("engramfs did not exit within %v of SIGTERM; killed it", stopTimeout))
		}
		if d.exitErr != nil && len(errs) == 0 {
			errs = append(errs, fmt.Errorf("engramfs exited with %v after SIGTERM", d.exitErr))
		}
	}
	if Mounted(d.Mountpoint) {
		_ = unix.Unmount(d.Mountpoint, unix.MNT_DETACH)
		errs = append(errs, fmt.Errorf("%s was still mounted after the daemon exited; detached it", d.Mountpoint))
	}
	if err := os.Remove(d.Mountpoint); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w\n%s", err, d.log.String())
	}
	return nil
}

// Mounted reports whether mp is a mountpoint in this mount namespace.
func Mounted(mp string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == mp {
			return true
		}
	}
	return false
}

// DaemonFlags returns the flags `bin mount --help` lists (without dashes),
// so the bench passes a flag only to a daemon that knows it.
func DaemonFlags(bin string) (map[string]bool, error) {
	out, _ := exec.Command(bin, "mount", "--help").CombinedOutput() // --help exits 0; a usage error would not list flags anyway
	flags := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		t := strings.TrimSpace(line)
		if name, ok := strings.CutPrefix(t, "-"); ok {
			name = strings.TrimPrefix(name, "-")
			if f := strings.Fields(name); len(f) > 0 {
				flags[f[0]] = true
			}
		}
	}
	if !flags["queue-depth"] {
		return nil, fmt.Errorf("%s mount --help lists no --queue-depth: not an engramfs binary?\n%s", bin, out)
	}
	return flags, nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte // GUARDED_BY(mu)
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

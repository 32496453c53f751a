package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
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
	// LogPath is the file the daemon's output goes to. A file, not a pipe:
	// a daemon that blocks writing to a full pipe stops answering faults,
	// and a reader blocked in those faults may be the very process that was
	// to drain the pipe (seen: a 30 MB crash dump did exactly that). Stop
	// removes it when the daemon ends cleanly.
	LogPath string

	cmd     *exec.Cmd
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
	logf, err := os.CreateTemp("", "engramfs-bench-daemon-*.log")
	if err != nil {
		os.Remove(mp)
		return nil, err
	}
	defer logf.Close() // the child has its own descriptor
	args := append([]string{"mount", "--log-format", "json"}, flags...)
	args = append(args, modelDir, mp)
	d := &Daemon{
		Mountpoint: mp,
		LogPath:    logf.Name(),
		cmd:        exec.Command(bin, args...),
		exited:     make(chan struct{}),
	}
	if len(env) > 0 {
		d.cmd.Env = append(os.Environ(), env...)
	}
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{
		// Its own process group: a Ctrl-C at the terminal reaches the bench
		// only, which unmaps its files before it stops the daemon.
		Setpgid: true,
		// If the bench dies without stopping it, the daemon still gets
		// SIGTERM, and SIGTERM unmounts.
		Pdeathsig: syscall.SIGTERM,
	}
	if err := d.cmd.Start(); err != nil {
		os.Remove(mp)
		os.Remove(d.LogPath)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		d.exitErr = d.cmd.Wait()
		close(d.exited)
	}()

	deadline := time.Now().Add(mountTimeout)
	for !d.loggedMounted() {
		select {
		case <-d.exited:
			err := fmt.Errorf("engramfs mount exited before mounting (%v):\n%s", d.exitErr, d.Log())
			os.Remove(mp)
			os.Remove(d.LogPath) // short, and all in err
			return nil, err
		case <-ctx.Done():
			err = ctx.Err()
		case <-time.After(10 * time.Millisecond):
			if time.Now().Before(deadline) {
				continue
			}
			err = fmt.Errorf("engramfs mount did not mount within %v:\n%s", mountTimeout, d.Log())
		}
		if serr := d.Stop(); serr != nil {
			err = fmt.Errorf("%w; stopping it: %v", err, serr)
		}
		return nil, err
	}
	return d, nil
}

// hexDump matches a line of the stack dump a Go crash on a signal prints.
var hexDump = regexp.MustCompile(`^[0-9a-f]{16}: `)

// loggedMounted reports whether the daemon has logged "mounted" (it logs
// JSON: --log-format json).
func (d *Daemon) loggedMounted() bool {
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return false
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		var e struct {
			Msg string `json:"msg"`
		}
		if json.Unmarshal(line, &e) == nil && e.Msg == "mounted" {
			return true
		}
	}
	return false
}

// Log says what in the daemon's output matters: its warnings and errors
// (the first of each message), the first lines it printed that are not log
// lines (a crash's reason comes before its goroutine dump), and its last
// lines.
func (d *Daemon) Log() string {
	b, err := os.ReadFile(d.LogPath)
	if err != nil {
		return fmt.Sprintf("(daemon log %s: %v)", d.LogPath, err)
	}
	var out []string
	seen := map[string]bool{}
	raw := 0
	for _, line := range strings.Split(string(b), "\n") {
		var e struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		switch {
		case json.Unmarshal([]byte(line), &e) == nil:
			if e.Level != "info" && e.Level != "debug" && !seen[e.Msg] {
				seen[e.Msg] = true
				out = append(out, line)
			}
		case raw < 20 && line != "" && !strings.HasPrefix(line, "\t") && !strings.HasPrefix(line, " ") && !hexDump.MatchString(line):
			// A crash prints its reason, then goroutines, then (for a
			// signal) a hex dump of the stack: keep the reason.
			raw++
			out = append(out, line)
		}
	}
	return fmt.Sprintf("daemon log (%s); its warnings, errors and first other lines:\n%s\n... and its last lines:\n%s",
		fmtBytes(float64(len(b))), strings.Join(out, "\n"), b[max(0, len(b)-2048):])
}

// Pid is the daemon's process id.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

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
		return fmt.Errorf("%w\n%s\n(the whole log is kept in %s)", err, d.Log(), d.LogPath)
	}
	os.Remove(d.LogPath)
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

package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/sdnotify"
)

// Names under which mount(8) and umount(8) run the binary: for a filesystem
// of type fuse.engramfs they look for /sbin/mount.fuse.engramfs and
// /sbin/umount.fuse.engramfs (symlinks to engramfs).
const (
	mountHelperName  = "mount.fuse.engramfs"
	umountHelperName = "umount.fuse.engramfs"
)

func init() {
	register("mount-helper", "mount(8) helper: MODEL_DIR MOUNTPOINT -o options (run as mount.fuse.engramfs)", runMountHelper)
	register("umount-helper", "umount(8) helper: MOUNTPOINT (run as umount.fuse.engramfs)", runUmountHelper)
	// Invoked as a helper: turn argv[0] into the subcommand, so main
	// dispatches as usual.
	switch filepath.Base(os.Args[0]) {
	case mountHelperName:
		os.Args = append([]string{os.Args[0], "mount-helper"}, os.Args[1:]...)
	case umountHelperName:
		os.Args = append([]string{os.Args[0], "umount-helper"}, os.Args[1:]...)
	}
}

// genericOptions are the options mount(8) and fstab pass to every helper,
// which mean nothing to engramfs (or say what it does anyway: ro). They are
// accepted and ignored.
var genericOptions = map[string]bool{
	"defaults": true, "rw": true, "ro": true, "auto": true, "noauto": true,
	"user": true, "nouser": true, "users": true, "owner": true, "group": true,
	"suid": true, "nosuid": true, "dev": true, "nodev": true, "exec": true, "noexec": true,
	"_netdev": true, "nofail": true, "async": true, "sync": true, "dirsync": true,
	"atime": true, "noatime": true, "relatime": true, "norelatime": true, "strictatime": true,
	"diratime": true, "nodiratime": true, "lazytime": true, "nolazytime": true,
	"silent": true, "loud": true, "bg": true, "fg": true, "uhelper": true, "helper": true,
}

// optLogFile is the helper's own -o option, not a mount flag.
const optLogFile = "log_file"

// readyOnlyEnv=1 tells a daemon started by the helper that NOTIFY_SOCKET is
// the helper's, which is gone once it has heard READY=1: the daemon drops
// the variable after that message.
const readyOnlyEnv = "ENGRAMFS_NOTIFY_READY_ONLY"

// helperArgs is a mount(8) helper command line:
// SPEC DIR [-sfnv] [-N namespace] [-o options] [-t type.subtype].
type helperArgs struct {
	source, target string
	options        []string // the -o list, split
	sloppy, fake   bool
	verbose        bool
}

func parseHelperArgs(args []string) (helperArgs, error) {
	var h helperArgs
	var pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") || a == "-" {
			pos = append(pos, a)
			continue
		}
		if a == "-o" || a == "-t" || a == "-N" {
			if i+1 == len(args) {
				return h, usagef("%s needs a value", a)
			}
			v := args[i+1]
			i++
			switch a {
			case "-o":
				for _, o := range strings.Split(v, ",") {
					if o != "" {
						h.options = append(h.options, o)
					}
				}
			case "-t":
				if v != "fuse.engramfs" && v != "engramfs" {
					return h, usagef("-t %s: this helper mounts fuse.engramfs", v)
				}
			case "-N":
				return h, usagef("-N %s: mounting in another namespace is not supported", v)
			}
			continue
		}
		if strings.HasPrefix(a, "-o") { // -ocache_size=4G
			h.options = append(h.options, strings.Split(a[2:], ",")...)
			continue
		}
		for _, c := range a[1:] {
			switch c {
			case 's':
				h.sloppy = true
			case 'f':
				h.fake = true
			case 'n': // no mtab: nothing to write either way
			case 'v':
				h.verbose = true
			default:
				return h, usagef("unknown flag -%c", c)
			}
		}
	}
	if len(pos) != 2 {
		return h, usagef("want MODEL_DIR and MOUNTPOINT, got %d arguments", len(pos))
	}
	h.source, h.target = pos[0], pos[1]
	return h, nil
}

// mountArgs translates -o options into `engramfs mount` flags: name=value
// becomes --name-with-dashes=value (cache_size=4G: --cache-size=4G), a bare
// name a boolean flag (allow_other: --allow-other). Generic options are
// dropped; unknown ones are an error that lists the known ones (or, with -s,
// a warning). It also returns the helper's own log_file option.
func mountArgs(h helperArgs, warn io.Writer) (flags []string, logFile string, err error) {
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	for _, o := range h.options {
		name, value, hasValue := strings.Cut(o, "=")
		if genericOptions[name] || strings.HasPrefix(name, "x-") || name == "comment" {
			continue
		}
		if name == optLogFile {
			if !hasValue || value == "" {
				return nil, "", usagef("-o %s needs a path", optLogFile)
			}
			logFile = value
			continue
		}
		f := fl.Lookup(strings.ReplaceAll(name, "_", "-"))
		if f == nil || strings.Contains(name, "-") {
			if h.sloppy {
				fmt.Fprintf(warn, "%s: ignoring unknown option %q (-s)\n", mountHelperName, o)
				continue
			}
			return nil, "", usagef("unknown option %q; engramfs takes %s, and ignores %s",
				o, strings.Join(knownOptions(fl), ","), "rw,ro,nosuid,nodev,noexec,auto,noauto,user,_netdev,nofail,defaults,x-*")
		}
		isBool := false
		if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
			isBool = true
		}
		switch {
		case hasValue:
			if err := fl.Set(f.Name, value); err != nil {
				return nil, "", usagef("-o %s: %v", o, err)
			}
			flags = append(flags, "--"+f.Name+"="+value)
		case isBool:
			flags = append(flags, "--"+f.Name)
		default:
			return nil, "", usagef("-o %s needs a value (%s=...)", name, name)
		}
	}
	if err := checkMountValues(fl, &mf); err != nil { // the state file's directory: the daemon's
		return nil, "", err
	}
	return flags, logFile, nil
}

func knownOptions(fl *flag.FlagSet) []string {
	var out []string
	fl.VisitAll(func(f *flag.Flag) { out = append(out, strings.ReplaceAll(f.Name, "-", "_")) })
	out = append(out, optLogFile)
	slices.Sort(out)
	return out
}

// defaultLogFile is where a helper-started daemon logs when -o log_file is
// not given: /var/log/engramfs/<mountpoint, slashes as dashes>.log (as root),
// else the same name in the temporary directory.
func defaultLogFile(mountpoint string) string {
	name := logName(mountpoint)
	const dir = "/var/log/engramfs"
	if err := os.MkdirAll(dir, 0o755); err == nil && unix.Access(dir, unix.W_OK) == nil {
		return filepath.Join(dir, name+".log")
	}
	return filepath.Join(os.TempDir(), "engramfs-"+name+".log")
}

// logName is mountpoint with its slashes as dashes: /mnt/engram is mnt-engram.
func logName(mountpoint string) string {
	name := strings.ReplaceAll(strings.Trim(filepath.Clean(mountpoint), "/"), "/", "-")
	if name == "" {
		name = "root"
	}
	return name
}

// helperReadyTimeout bounds the wait for the daemon's readiness.
const helperReadyTimeout = 2 * time.Minute

func runMountHelper(args []string) error {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
		fmt.Fprintf(os.Stderr, `Usage: %s MODEL_DIR MOUNTPOINT [-sfnv] [-o OPTIONS]
       engramfs mount-helper MODEL_DIR MOUNTPOINT [-sfnv] [-o OPTIONS]

The mount(8) helper for filesystems of type fuse.engramfs: with a symlink
/sbin/mount.fuse.engramfs -> engramfs, "mount -t fuse.engramfs MODEL_DIR
MOUNTPOINT -o cache_size=4G,queue_depth=32" and /etc/fstab lines work.

Each option name=value is the flag --name-with-dashes=value of "engramfs
mount" (cache_size, queue_depth, backing_io, prefetch_queue, state_file,
metrics_addr, table_pattern, log_level, log_format, ...; allow_other and
debug_fuse take no value). rw, ro, nosuid, nodev, noexec, auto, noauto, user,
_netdev, nofail, defaults and x-* are ignored; anything else is refused
(ignored with -s). log_file=PATH sets where the daemon logs (default
/var/log/engramfs/<mountpoint>.log).

The helper starts "engramfs mount" in the background (its own session,
stdin /dev/null, stdout and stderr appended to the log file), waits until
the mount answers (the daemon's sd_notify READY=1), and exits 0; or exits 1
with the daemon's error. -f does everything but start the daemon.
`, mountHelperName)
		return nil
	}
	h, err := parseHelperArgs(args)
	if err != nil {
		return err
	}
	flags, logFile, err := mountArgs(h, os.Stderr)
	if err != nil {
		return err
	}
	source, err := filepath.Abs(h.source)
	if err != nil {
		return err
	}
	target, err := filepath.Abs(h.target)
	if err != nil {
		return err
	}
	if logFile == "" {
		logFile = defaultLogFile(target)
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("cannot find the engramfs binary: %w", err)
	}
	argv := append(append([]string{"mount"}, flags...), source, target)
	if h.verbose || h.fake {
		fmt.Fprintf(os.Stderr, "%s: %s %s >>%s 2>&1\n", mountHelperName, exe, strings.Join(argv, " "), logFile)
	}
	if h.fake {
		return nil
	}
	return startBackground(exe, argv, logFile)
}

// startBackground starts the daemon detached from the helper and waits for
// its readiness, which it learns the way systemd does: a private
// NOTIFY_SOCKET that the daemon sends READY=1 to once its mount answers.
func startBackground(exe string, argv []string, logFile string) error {
	log, err := os.OpenFile(logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	defer log.Close()
	start, _ := log.Seek(0, io.SeekEnd)
	fmt.Fprintf(log, "--- %s: engramfs %s\n", time.Now().Format(time.RFC3339), strings.Join(argv, " "))

	dir, err := os.MkdirTemp("", "engramfs-helper-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("readiness socket: %w", err)
	}
	defer conn.Close()

	cmd := exec.Command(exe, argv...)
	cmd.Stdin = nil // /dev/null
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(e string) bool {
		return strings.HasPrefix(e, sdnotify.SocketEnv+"=") || strings.HasPrefix(e, readyOnlyEnv+"=")
	}), sdnotify.SocketEnv+"="+sock, readyOnlyEnv+"=1")
	// Its own session: the daemon outlives the helper and mount(8), and no
	// terminal's hangup reaches it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the daemon: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ready := make(chan struct{})
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return
			}
			for _, l := range strings.Split(string(buf[:n]), "\n") {
				if l == "READY=1" {
					close(ready)
					return
				}
			}
		}
	}()
	select {
	case <-ready:
		return nil // the daemon runs on, reparented to init
	case err := <-exited:
		return fmt.Errorf("the daemon exited (%v) before mounting:\n%s(log: %s)", err, logTail(logFile, start), logFile)
	case <-time.After(helperReadyTimeout):
		_ = cmd.Process.Signal(syscall.SIGTERM)
		return fmt.Errorf("the daemon did not mount within %v; stopped it:\n%s(log: %s)", helperReadyTimeout, logTail(logFile, start), logFile)
	}
}

// logTail is the last lines this run wrote to the log.
func logTail(path string, from int64) string {
	b, err := os.ReadFile(path)
	if err != nil || from > int64(len(b)) {
		return ""
	}
	b = b[from:]
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	var sb strings.Builder
	for _, l := range lines {
		sb.WriteString("  ")
		sb.Write(l)
		sb.WriteByte('\n')
	}
	return sb.String()
}

func runUmountHelper(args []string) error {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
		fmt.Fprintf(os.Stderr, `Usage: %s MOUNTPOINT [-flnrv]
       engramfs umount-helper MOUNTPOINT

The umount(8) helper for fuse.engramfs mounts: "engramfs unmount" as
umount(8) runs it, for mounts recorded in /run/mount/utab (mount with
-o uhelper=engramfs). It refuses a mount whose table files a process maps,
naming the processes, unless -f or -l; otherwise it unmounts, or detaches
the mount when it is busy (the daemon maps the table files itself), then
waits up to %v for the daemon to save its warm state and exit.
`, umountHelperName, defaultStopTimeout)
		return nil
	}
	var target string
	force := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "-N" || a == "-t":
			i++ // a namespace or type: nothing to do with them here
		case strings.HasPrefix(a, "-") && len(a) > 1:
			for _, c := range a[1:] {
				switch c {
				case 'l', 'f': // lazy, force: the user takes the readers' SIGBUS
					force = true
				case 'n', 'r', 'v', 'i':
				default:
					return usagef("unknown flag -%c", c)
				}
			}
		case target == "":
			target = a
		default:
			return usagef("want MOUNTPOINT, got more arguments")
		}
	}
	if target == "" {
		return usagef("want MOUNTPOINT")
	}
	return unmountEngramfs(target, unmountOptions{force: force, timeout: defaultStopTimeout})
}

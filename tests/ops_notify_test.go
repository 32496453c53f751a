package tests

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// notifyListener is what systemd does for Type=notify: a unix datagram
// socket named in NOTIFY_SOCKET.
func notifyListener(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	addr := name
	if strings.HasPrefix(addr, "@") {
		addr = "\x00" + addr[1:]
	}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func nextNotify(t *testing.T, c *net.UnixConn, timeout time.Duration) string {
	t.Helper()
	buf := make([]byte, 4096)
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("no sd_notify message within %v: %v", timeout, err)
	}
	return string(buf[:n])
}

func hasAssignment(msg, kv string) bool {
	for _, l := range strings.Split(msg, "\n") {
		if l == kv {
			return true
		}
	}
	return false
}

func TestSystemdNotify(t *testing.T) {
	RequireFUSE(t)
	for _, kind := range []string{"path", "abstract"} {
		t.Run(kind, func(t *testing.T) {
			name := filepath.Join(t.TempDir(), "notify")
			if kind == "abstract" {
				name = fmt.Sprintf("@engramfs-test-notify-%d-%d", os.Getpid(), time.Now().UnixNano())
			}
			conn := notifyListener(t, name)
			model := Synth(t, geometries()["4096B"])
			mp := filepath.Join(t.TempDir(), "mnt")
			if err := os.Mkdir(mp, 0o755); err != nil {
				t.Fatal(err)
			}
			log := &syncBuffer{}
			cmd := exec.Command(Binary(t), "mount", "--cache-size", "1MiB", model, mp)
			cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+name)
			cmd.Stdout, cmd.Stderr = log, log
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan struct{})
			var exitErr error
			go func() { exitErr = cmd.Wait(); close(exited) }()
			t.Cleanup(func() {
				select {
				case <-exited:
				default:
					_ = cmd.Process.Kill()
					select {
					case <-exited:
					case <-time.After(10 * time.Second):
						t.Errorf("daemon %d did not die of SIGKILL", cmd.Process.Pid)
					}
				}
				if Mounted(mp) {
					_ = syscall.Unmount(mp, syscall.MNT_DETACH)
				}
			})

			msg := nextNotify(t, conn, 60*time.Second)
			// READY is sent once the mount answers: at this instant the tree
			// must be readable.
			if _, err := os.ReadFile(filepath.Join(mp, "manifest.json")); err != nil || !Mounted(mp) {
				t.Fatalf("got %q, but manifest.json is not readable (%v) or %s not mounted\n%s", msg, err, mp, log.String())
			}
			if !hasAssignment(msg, "READY=1") || !strings.Contains(msg, "STATUS=serving 4 tables of 2 layers") {
				t.Fatalf("first message %q, want READY=1 and a STATUS", msg)
			}
			// Then the FUSE connection for the file descriptor store (the
			// stale one removed first): a crash leaves the mount alive.
			for _, want := range []string{"FDSTOREREMOVE=1", "FDSTORE=1"} {
				if msg = nextNotify(t, conn, 30*time.Second); !hasAssignment(msg, want) || !hasAssignment(msg, "FDNAME=engramfs-fuse") {
					t.Fatalf("after READY got %q, want %s with FDNAME=engramfs-fuse", msg, want)
				}
			}

			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			msg = nextNotify(t, conn, 30*time.Second)
			if !hasAssignment(msg, "STOPPING=1") {
				t.Fatalf("after SIGTERM got %q, want STOPPING=1", msg)
			}
			select {
			case <-exited:
				if exitErr != nil {
					t.Fatalf("daemon exited with %v\n%s", exitErr, log.String())
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("daemon still running 30 s after SIGTERM")
			}
			if Mounted(mp) {
				t.Fatalf("still mounted after the daemon exited")
			}
		})
	}
}

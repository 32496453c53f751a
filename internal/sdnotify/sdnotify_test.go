package sdnotify

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func listen(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	addr := name
	if addr[0] == '@' {
		addr = "\x00" + addr[1:]
	}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func receive(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	buf := make([]byte, 4096)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

func TestNotifyPathAndAbstractSockets(t *testing.T) {
	for _, name := range []string{
		filepath.Join(t.TempDir(), "notify"),
		fmt.Sprintf("@engramfs-sdnotify-test-%d", os.Getpid()),
	} {
		c := listen(t, name)
		t.Setenv(SocketEnv, name)
		if err := Notify("READY=1\nSTATUS=serving"); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := receive(t, c); got != "READY=1\nSTATUS=serving" {
			t.Fatalf("%s: got %q", name, got)
		}
	}
}

func TestNotifyWithoutSocketDoesNothing(t *testing.T) {
	t.Setenv(SocketEnv, "")
	if err := Notify("READY=1"); err != nil {
		t.Fatal(err)
	}
}

func TestNotifyErrors(t *testing.T) {
	if err := NotifySocket("relative/path", "READY=1"); err == nil {
		t.Fatal("a relative socket path was accepted")
	}
	if err := NotifySocket(filepath.Join(t.TempDir(), "absent"), "READY=1"); err == nil {
		t.Fatal("a missing socket gave no error")
	}
}

// A descriptor sent for the store arrives with the state; ListenFds finds
// descriptors by name, for this pid only.
func TestFdStoreAndListenFds(t *testing.T) {
	name := filepath.Join(t.TempDir(), "notify")
	c := listen(t, name)
	t.Setenv(SocketEnv, name)
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := NotifyFds("FDSTORE=1\nFDNAME=x", int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 64), make([]byte, 64)
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 || string(buf[:n]) != "FDSTORE=1\nFDNAME=x" {
		t.Fatalf("got %q with %d control messages (%v)", buf[:n], len(msgs), err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("rights %v, %v", fds, err)
	}
	// Pretend the manager passed it as fd 3..: dup it there.
	for _, fd := range fds {
		defer unix.Close(fd)
	}
	if err := unix.Dup2(fds[0], 4); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(4)
	t.Setenv(ListenPidEnv, strconv.Itoa(os.Getpid()))
	t.Setenv(ListenFdsEnv, "2")
	t.Setenv(ListenNamesEnv, "other:x")
	got := ListenFds("x")
	if len(got) != 1 || got[0].Fd() != 4 {
		t.Fatalf("ListenFds(x) = %v, want fd 4", got)
	}
	t.Setenv(ListenPidEnv, "1")
	if got := ListenFds("x"); got != nil {
		t.Fatalf("ListenFds for another pid = %v", got)
	}
}

package sdnotify

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
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

// Package sdnotify tells a service manager about the daemon's state with
// the sd_notify protocol: one datagram of newline-separated KEY=VALUE
// assignments ("READY=1", "STATUS=...", "STOPPING=1") sent to the unix
// datagram socket named by $NOTIFY_SOCKET. A name starting with '@' is an
// abstract socket. No library: the protocol is one sendto.
package sdnotify

import (
	"fmt"
	"net"
	"os"
	"strings"
)

// SocketEnv is the variable that names the socket.
const SocketEnv = "NOTIFY_SOCKET"

// Notify sends state (e.g. "READY=1\nSTATUS=serving") to $NOTIFY_SOCKET.
// Without one (not started by a service manager) it does nothing and
// returns nil.
func Notify(state string) error {
	return NotifySocket(os.Getenv(SocketEnv), state)
}

// NotifySocket sends state to socket (a path, or '@' and an abstract name);
// an empty socket does nothing.
func NotifySocket(socket, state string) error {
	if socket == "" {
		return nil
	}
	name := socket
	if strings.HasPrefix(name, "@") {
		name = "\x00" + name[1:] // abstract namespace
	} else if !strings.HasPrefix(name, "/") {
		return fmt.Errorf("sd_notify: %s=%q: want an absolute path or @name", SocketEnv, socket)
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(state)); err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	return nil
}

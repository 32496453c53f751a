// Package sdnotify tells a service manager about the daemon's state with
// the sd_notify protocol: one datagram of newline-separated KEY=VALUE
// assignments ("READY=1", "STATUS=...", "STOPPING=1") sent to the unix
// datagram socket named by $NOTIFY_SOCKET. A name starting with '@' is an
// abstract socket. No library: the protocol is one sendto (one sendmsg
// with SCM_RIGHTS for descriptors to keep in the file descriptor store,
// which the next start of the service finds in $LISTEN_FDS).
package sdnotify

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
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
	return send(socket, state, nil)
}

// NotifyFds sends state with descriptors fds to $NOTIFY_SOCKET: with
// "FDSTORE=1\nFDNAME=name", systemd keeps them across restarts of the
// service (FileDescriptorStoreMax= must allow them) and passes them to its
// next start (ListenFds). Without a socket it does nothing.
func NotifyFds(state string, fds ...int) error {
	return send(os.Getenv(SocketEnv), state, fds)
}

func send(socket, state string, fds []int) error {
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
	if len(fds) == 0 {
		_, err = conn.Write([]byte(state))
	} else {
		rc, cerr := conn.SyscallConn()
		if cerr != nil {
			return fmt.Errorf("sd_notify: %w", cerr)
		}
		if cerr := rc.Write(func(fd uintptr) bool {
			err = unix.Sendmsg(int(fd), []byte(state), unix.UnixRights(fds...), nil, 0)
			return err != unix.EAGAIN
		}); cerr != nil {
			err = cerr
		}
	}
	if err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	return nil
}

// Listen-fd variables: the descriptors a service manager passes, from 3 on.
const (
	ListenPidEnv   = "LISTEN_PID"
	ListenFdsEnv   = "LISTEN_FDS"
	ListenNamesEnv = "LISTEN_FDNAMES"
	listenFdsStart = 3
)

// ListenFds returns the descriptors passed to this process under name
// ($LISTEN_FDS, $LISTEN_FDNAMES, for this pid only), as files. The others
// are left alone.
func ListenFds(name string) []*os.File {
	if pid, err := strconv.Atoi(os.Getenv(ListenPidEnv)); err != nil || pid != os.Getpid() {
		return nil
	}
	n, err := strconv.Atoi(os.Getenv(ListenFdsEnv))
	if err != nil || n <= 0 {
		return nil
	}
	names := strings.Split(os.Getenv(ListenNamesEnv), ":")
	var files []*os.File
	for i := 0; i < n && i < len(names); i++ {
		if names[i] != name {
			continue
		}
		fd := listenFdsStart + i
		unix.CloseOnExec(fd)
		files = append(files, os.NewFile(uintptr(fd), name))
	}
	return files
}

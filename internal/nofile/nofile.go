// Package nofile checks the process's descriptor limit (RLIMIT_NOFILE)
// against what it needs, raising the soft limit toward the hard one where
// that is enough, and says what to change where it is not.
//
// Importing it also checks, in its init, that the process has the few
// descriptors any engramfs command needs to start (MinStart): go-fuse's
// splice package creates a pipe in its own init and panics when it cannot
// (measured: RLIMIT_NOFILE 8, "panic: cannot create pipe: pipe2: too many
// open files"). Packages are initialized in import-path order among those
// whose imports are done (Go 1.21), and this one imports nothing the splice
// package does not, so its init runs first and exits with a message
// instead. Only the engramfs command imports it.
package nofile

import (
	"fmt"
	"os"
	"syscall"
)

// MinStart is the least RLIMIT_NOFILE an engramfs command starts with: the
// standard streams, the Go runtime's epoll and eventfd, go-fuse's probe
// pipe, and room for the command's own first files.
const MinStart = 16

func init() {
	if err := Need(MinStart, "to start"); err != nil {
		fmt.Fprintf(os.Stderr, "engramfs: %v\n", err)
		os.Exit(1)
	}
}

// Need makes sure the soft RLIMIT_NOFILE is at least n, raising it toward
// the hard limit, or returns an error that gives the limits, n, and for
// what (why, e.g. "for 120 tables of 60 layers in 2 shards: ...").
func Need(n uint64, why string) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("RLIMIT_NOFILE: %w", err)
	}
	if lim.Cur >= n {
		return nil
	}
	if lim.Max >= n {
		raised := lim
		raised.Cur = n
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err == nil {
			return nil
		}
	}
	return fmt.Errorf("%d file descriptors are needed %s, but RLIMIT_NOFILE is %d (hard limit %d): raise it (ulimit -n %d; LimitNOFILE=%d in a systemd unit)",
		n, why, lim.Cur, lim.Max, n, n)
}

// Limit is the soft RLIMIT_NOFILE now.
func Limit() uint64 {
	var lim syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) != nil {
		return 0
	}
	return lim.Cur
}

// Command seccompexec runs a command with some system calls refused, as a
// seccomp profile or a sandbox would refuse them: it installs a seccomp
// filter that answers the named calls with EPERM (or another errno) and
// execs the command, which keeps its pid and inherits the filter on every
// thread. The tests use it as a daemonproc wrapper (testenv.Refusing):
//
//	seccompexec io_uring_enter engramfs mount MODEL MNT
//	seccompexec io_uring_setup=ENOSYS,io_uring_enter engramfs mount MODEL MNT
package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"

	"github.com/engramfs/engramfs/internal/testenv/seccomp"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: seccompexec SYSCALL[=ERRNO][,...] COMMAND [ARG...]")
		os.Exit(2)
	}
	fmt.Fprintln(os.Stderr, "seccompexec:", run(os.Args[1], os.Args[2:]))
	os.Exit(1)
}

// run returns only on an error: the filter goes on this thread, which then
// execs argv.
func run(spec string, argv []string) error {
	prog, err := seccomp.Filter(spec)
	if err != nil {
		return err
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	if err := seccomp.RefuseThread(prog); err != nil {
		return err
	}
	return syscall.Exec(path, argv, os.Environ())
}

// Package seccomp refuses system calls the way a seccomp profile or a
// sandbox does, for tests: a BPF filter that answers the named calls with
// an errno. Tests use it through internal/testenv/seccompexec (a wrapper
// that execs the daemon with the filter) or, in a child test process,
// RefuseAll (every thread of this process, from now on).
package seccomp

import (
	"fmt"
	"runtime"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// calls are the system calls a spec may name: the ones tests refuse.
var calls = map[string]uint32{
	"io_uring_setup":    unix.SYS_IO_URING_SETUP,
	"io_uring_enter":    unix.SYS_IO_URING_ENTER,
	"io_uring_register": unix.SYS_IO_URING_REGISTER,
}

var errnos = map[string]syscall.Errno{"EPERM": unix.EPERM, "ENOSYS": unix.ENOSYS, "EACCES": unix.EACCES}

// arches is the seccomp_data.arch of this build's system call numbers.
var arches = map[string]uint32{"amd64": unix.AUDIT_ARCH_X86_64, "arm64": unix.AUDIT_ARCH_AARCH64}

// Filter builds the BPF program of spec, "CALL[=ERRNO][,CALL[=ERRNO]...]"
// (default errno EPERM): a named call returns its errno, every other call
// (and every call of another architecture) is allowed.
func Filter(spec string) ([]unix.SockFilter, error) {
	arch, ok := arches[runtime.GOARCH]
	if !ok {
		return nil, fmt.Errorf("seccomp: no architecture known for %s", runtime.GOARCH)
	}
	const (
		ld  = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeq = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		ret = unix.BPF_RET | unix.BPF_K
	)
	prog := []unix.SockFilter{
		{Code: ld, K: 4}, // seccomp_data.arch
		{Code: jeq, Jt: 1, K: arch},
		{Code: ret, K: unix.SECCOMP_RET_ALLOW},
		{Code: ld, K: 0}, // seccomp_data.nr
	}
	for _, item := range strings.Split(spec, ",") {
		name, errName, _ := strings.Cut(item, "=")
		nr, ok := calls[name]
		if !ok {
			return nil, fmt.Errorf("seccomp: unknown system call %q", name)
		}
		errno := unix.EPERM
		if errName != "" {
			if errno, ok = errnos[errName]; !ok {
				return nil, fmt.Errorf("seccomp: unknown errno %q", errName)
			}
		}
		prog = append(prog,
			unix.SockFilter{Code: jeq, Jf: 1, K: nr},
			unix.SockFilter{Code: ret, K: unix.SECCOMP_RET_ERRNO | uint32(errno)})
	}
	return append(prog, unix.SockFilter{Code: ret, K: unix.SECCOMP_RET_ALLOW}), nil
}

// RefuseThread installs prog on the calling thread only (lock it first):
// a program it then execs starts with the filter, on every thread.
func RefuseThread(prog []unix.SockFilter) error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: PR_SET_NO_NEW_PRIVS: %w", err)
	}
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&fp)), 0, 0); err != nil {
		return fmt.Errorf("seccomp: PR_SET_SECCOMP: %w", err)
	}
	return nil
}

// RefuseAll installs prog on every thread of this process
// (SECCOMP_FILTER_FLAG_TSYNC): calls made from now on are refused; one a
// thread is already sleeping in finishes.
func RefuseAll(prog []unix.SockFilter) error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: PR_SET_NO_NEW_PRIVS: %w", err)
	}
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	const setModeFilter, flagTsync = 1, 1 // SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC
	if r, _, errno := unix.Syscall(unix.SYS_SECCOMP, setModeFilter, flagTsync, uintptr(unsafe.Pointer(&fp))); errno != 0 {
		return fmt.Errorf("seccomp: SECCOMP_SET_MODE_FILTER with TSYNC: %w", errno)
	} else if r != 0 {
		return fmt.Errorf("seccomp: thread %d could not take the filter", r)
	}
	return nil
}

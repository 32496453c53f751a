package ioengine

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/ioring"
)

// This file is what a read engine needs of io_uring on top of the shared
// binding (internal/ioring: setup, the mappings, enter): the setup flags,
// READ, POLL_ADD and NOP. Layouts are from include/uapi/linux/io_uring.h.

const (
	ioringEnterGetEvents = ioring.EnterGetEvents

	ioringOpNop     = 0
	ioringOpPollAdd = 6
	ioringOpRead    = 22

	// ioringMaxEntries is the kernel's IORING_MAX_ENTRIES; with CLAMP larger
	// requests are cut to it, without CLAMP they fail with EINVAL.
	ioringMaxEntries = ioring.MaxEntries
)

// sqe is struct io_uring_sqe (64 bytes), with the unions flattened to the
// members a read uses.
type sqe struct {
	opcode      uint8
	flags       uint8
	ioprio      uint16
	fd          int32
	off         uint64
	addr        uint64
	len         uint32
	rwFlags     uint32
	userData    uint64
	bufIndex    uint16
	personality uint16
	spliceFdIn  int32
	addr3       uint64
	pad2        uint64
}

// cqe is struct io_uring_cqe.
type cqe = ioring.CQE

var _ [64]byte = [unsafe.Sizeof(sqe{})]byte{}

// ring is one io_uring instance (internal/ioring). The SQ side is written
// by whoever holds the engine's mutex; the CQ side only by the reaper.
type ring struct {
	*ioring.Ring[sqe]
}

// setupFlagSets are tried in order. COOP_TASKRUN (5.19) stops the kernel
// from interrupting a thread running user code with an IPI to post a
// completion: on these VMs every such interrupt is a hypervisor exit. The
// thread runs the completion work at its next kernel entry or wake-up
// instead (sleeping threads are still woken). SUBMIT_ALL (5.18) keeps one bad
// SQE from stopping the submission of the rest of a batch. Older kernels
// reject unknown flags with EINVAL, so each set drops the newest flags.
var setupFlagSets = []uint32{
	ioring.SetupClamp | ioring.SetupSubmitAll | ioring.SetupCoopTaskrun,
	ioring.SetupClamp | ioring.SetupSubmitAll,
	ioring.SetupClamp,
}

// newRing sets up a ring with at least entries SQEs and maps it.
func newRing(entries uint32) (*ring, error) {
	r, err := ioring.New[sqe](entries, setupFlagSets)
	if err != nil {
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return nil, setupError(errno)
		}
		return nil, err
	}
	return &ring{r}, nil
}

// setupError says why io_uring_setup failed in words an operator can act on.
func setupError(errno syscall.Errno) error {
	why := ""
	switch errno {
	case unix.ENOSYS:
		why = "kernel without io_uring, or a seccomp filter refuses it"
	case unix.EPERM:
		why = "refused by kernel.io_uring_disabled or a seccomp filter"
		if b, err := os.ReadFile("/proc/sys/kernel/io_uring_disabled"); err == nil {
			switch strings.TrimSpace(string(b)) {
			case "1":
				why = "kernel.io_uring_disabled=1: only root and kernel.io_uring_group may use it"
			case "2":
				why = "kernel.io_uring_disabled=2"
			}
		}
	case unix.ENOMEM:
		why = "ring memory refused (RLIMIT_MEMLOCK on kernels before 5.12)"
	}
	if why == "" {
		return fmt.Errorf("io_uring_setup: %w", errno)
	}
	return fmt.Errorf("io_uring_setup: %w (%s)", errno, why)
}

// close unmaps the rings and closes the fd. The kernel cancels anything
// still in flight; the engine only calls this once nothing is.
func (r *ring) close() { r.Close() }

// sqSpace is how many SQEs can be written before the kernel consumes more.
func (r *ring) sqSpace() uint32 { return r.Space() }

// unsubmitted is how many written SQEs the kernel has not consumed yet.
func (r *ring) unsubmitted() uint32 { return r.Unsubmitted() }

// pushRead writes a READ SQE and publishes it. The caller checked sqSpace
// and keeps buf reachable until the completion is reaped.
func (r *ring) pushRead(fd int, off int64, buf []byte, userData uint64) {
	s := r.Next()
	*s = sqe{opcode: ioringOpRead, fd: int32(fd), off: uint64(off), len: uint32(len(buf)), userData: userData}
	if len(buf) > 0 {
		s.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	}
	r.Publish()
}

// pushPollIn writes a one-shot POLL_ADD SQE for POLLIN on fd: it completes
// (with userData) once fd is readable.
func (r *ring) pushPollIn(fd int, userData uint64) {
	// poll32_events shares rw_flags' place in the SQE.
	*r.Next() = sqe{opcode: ioringOpPollAdd, fd: int32(fd), rwFlags: unix.POLLIN, userData: userData}
	r.Publish()
}

// pushNop writes a NOP SQE: it completes (with userData, res 0) as soon as
// it is submitted.
func (r *ring) pushNop(userData uint64) {
	*r.Next() = sqe{opcode: ioringOpNop, userData: userData}
	r.Publish()
}

// probe submits a NOP and waits for its completion: a ring that cannot do
// that (io_uring_enter refused by a seccomp profile or a sandbox that
// allows io_uring_setup) would take reads and never complete one. The NOP
// completes inline, while it is submitted, so no completion work is left
// pending on the calling thread, which need not be the reaper's.
func (r *ring) probe() error {
	r.pushNop(probeUserData)
	// Not through enter: enterHook hears the submissions of reads.
	if _, err := r.syscallEnter(1, 1, ioringEnterGetEvents); err != nil {
		return enterError(err)
	}
	cqes := r.reap(nil)
	if len(cqes) != 1 || cqes[0].UserData != probeUserData || cqes[0].Res != 0 {
		return fmt.Errorf("io_uring: a NOP completed as %+v, want one completion with result 0", cqes)
	}
	return nil
}

// probeUserData marks the probe's NOP.
const probeUserData = ^uint64(0) - 1

// enterError says why io_uring_enter failed in words an operator can act on.
func enterError(err error) error {
	switch err {
	case unix.EPERM, unix.EACCES, unix.ENOSYS:
		return fmt.Errorf("io_uring_enter: %w (refused, though io_uring_setup was not: a seccomp filter or a sandbox's profile)", err)
	}
	return fmt.Errorf("io_uring_enter: %w", err)
}

// enterHook, if set (by tests, before any ring exists), hears every
// io_uring_enter on the calling thread.
var enterHook func(toSubmit, flags uint32)

// enter is io_uring_enter(2) without a signal mask. It blocks in the
// kernel when waiting, as any blocking syscall does in Go (the P is handed
// off), so it is fine to call from a goroutine.
func (r *ring) enter(toSubmit, minComplete, flags uint32) (int, error) {
	if enterHook != nil {
		enterHook(toSubmit, flags)
	}
	return r.syscallEnter(toSubmit, minComplete, flags)
}

// syscallEnter is the io_uring_enter(2) of enter.
func (r *ring) syscallEnter(toSubmit, minComplete, flags uint32) (int, error) {
	return r.Enter(toSubmit, minComplete, flags)
}

// reap copies every available CQE into dst and releases the ring slots.
func (r *ring) reap(dst []cqe) []cqe { return r.Reap(dst) }

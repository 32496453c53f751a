package ioengine

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// This file is the whole io_uring binding: golang.org/x/sys/unix has the
// syscall numbers but no types, and the module proxy here serves no io_uring
// library. It covers only what a read engine needs: setup, the three
// mappings, enter, READ and NOP. Layouts are from include/uapi/linux/io_uring.h.

const (
	ioringOffSQRing = 0
	ioringOffCQRing = 0x8000000
	ioringOffSQEs   = 0x10000000

	ioringSetupClamp       = 1 << 4
	ioringSetupSubmitAll   = 1 << 7
	ioringSetupCoopTaskrun = 1 << 8

	ioringFeatSingleMmap = 1 << 0

	ioringEnterGetEvents = 1 << 0

	ioringOpNop     = 0
	ioringOpPollAdd = 6
	ioringOpRead    = 22

	// ioringMaxEntries is the kernel's IORING_MAX_ENTRIES; with CLAMP larger
	// requests are cut to it, without CLAMP they fail with EINVAL.
	ioringMaxEntries = 32768
)

// uringParams is struct io_uring_params (120 bytes).
type uringParams struct {
	sqEntries    uint32
	cqEntries    uint32
	flags        uint32
	sqThreadCPU  uint32
	sqThreadIdle uint32
	features     uint32
	wqFd         uint32
	resv         [3]uint32
	sqOff        sqringOffsets
	cqOff        cqringOffsets
}

// sqringOffsets is struct io_sqring_offsets.
type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

// cqringOffsets is struct io_cqring_offsets.
type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

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

// cqe is struct io_uring_cqe without the big-CQE extension (16 bytes).
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

var (
	_ [120]byte = [unsafe.Sizeof(uringParams{})]byte{}
	_ [64]byte  = [unsafe.Sizeof(sqe{})]byte{}
	_ [16]byte  = [unsafe.Sizeof(cqe{})]byte{}
)

// ring is one io_uring instance. The SQ side (sqTail, the SQEs) is written
// by whoever holds the engine's mutex; the CQ side (cqHead) only by the
// reaper. Head and tail words are shared with the kernel and are always
// accessed with sync/atomic (sequentially consistent, stronger than the
// acquire/release the kernel asks for).
type ring struct {
	fd       int
	flags    uint32 // setup flags the kernel accepted
	features uint32

	sqMap, cqMap, sqeMap []byte

	sqHead, sqTail *uint32
	sqMask         uint32
	sqEntries      uint32
	sqes           []sqe
	localSQTail    uint32 // tail as we have written it; published by atomic store

	cqHead, cqTail *uint32
	cqMask         uint32
	cqEntries      uint32
	cqes           []cqe
}

// setupFlagSets are tried in order. COOP_TASKRUN (5.19) stops the kernel
// from interrupting a thread running user code with an IPI to post a
// completion: on these VMs every such interrupt is a hypervisor exit. The
// thread runs the completion work at its next kernel entry or wake-up
// instead (sleeping threads are still woken). SUBMIT_ALL (5.18) keeps one bad
// SQE from stopping the submission of the rest of a batch. Older kernels
// reject unknown flags with EINVAL, so each set drops the newest flags.
var setupFlagSets = []uint32{
	ioringSetupClamp | ioringSetupSubmitAll | ioringSetupCoopTaskrun,
	ioringSetupClamp | ioringSetupSubmitAll,
	ioringSetupClamp,
}

// newRing sets up a ring with at least entries SQEs and maps it.
func newRing(entries uint32) (*ring, error) {
	if entries > ioringMaxEntries {
		entries = ioringMaxEntries
	}
	var p uringParams
	var fd uintptr
	var errno syscall.Errno
	for _, flags := range setupFlagSets {
		p = uringParams{flags: flags}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
		if errno != unix.EINVAL {
			break
		}
	}
	if errno != 0 {
		return nil, setupError(errno)
	}
	r := &ring{fd: int(fd), flags: p.flags, features: p.features}
	if err := r.mmap(&p); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
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

func (r *ring) mmap(p *uringParams) error {
	sqSize := uintptr(p.sqOff.array) + uintptr(p.sqEntries)*4
	cqSize := uintptr(p.cqOff.cqes) + uintptr(p.cqEntries)*unsafe.Sizeof(cqe{})
	single := p.features&ioringFeatSingleMmap != 0
	if single {
		// One mapping serves both rings (5.4+): map the larger size once.
		sqSize = max(sqSize, cqSize)
		cqSize = sqSize
	}
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_SHARED | unix.MAP_POPULATE
	var err error
	if r.sqMap, err = unix.Mmap(r.fd, ioringOffSQRing, int(sqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQ ring: %w", err)
	}
	if single {
		r.cqMap = r.sqMap
	} else if r.cqMap, err = unix.Mmap(r.fd, ioringOffCQRing, int(cqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap CQ ring: %w", err)
	}
	sqeSize := int(p.sqEntries) * int(unsafe.Sizeof(sqe{}))
	if r.sqeMap, err = unix.Mmap(r.fd, ioringOffSQEs, sqeSize, prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQEs: %w", err)
	}

	sq := unsafe.Pointer(&r.sqMap[0])
	r.sqHead = (*uint32)(unsafe.Add(sq, p.sqOff.head))
	r.sqTail = (*uint32)(unsafe.Add(sq, p.sqOff.tail))
	r.sqMask = *(*uint32)(unsafe.Add(sq, p.sqOff.ringMask))
	r.sqEntries = *(*uint32)(unsafe.Add(sq, p.sqOff.ringEntries))
	r.localSQTail = atomic.LoadUint32(r.sqTail)
	// The SQ array maps ring slots to SQE indexes; the identity mapping,
	// written once, lets slot i always use SQE i.
	array := unsafe.Slice((*uint32)(unsafe.Add(sq, p.sqOff.array)), r.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&r.sqeMap[0])), r.sqEntries)

	cq := unsafe.Pointer(&r.cqMap[0])
	r.cqHead = (*uint32)(unsafe.Add(cq, p.cqOff.head))
	r.cqTail = (*uint32)(unsafe.Add(cq, p.cqOff.tail))
	r.cqMask = *(*uint32)(unsafe.Add(cq, p.cqOff.ringMask))
	r.cqEntries = *(*uint32)(unsafe.Add(cq, p.cqOff.ringEntries))
	r.cqes = unsafe.Slice((*cqe)(unsafe.Add(cq, p.cqOff.cqes)), r.cqEntries)
	return nil
}

// close unmaps the rings and closes the fd. The kernel cancels anything
// still in flight; the engine only calls this once nothing is.
func (r *ring) close() {
	if r.sqeMap != nil {
		unix.Munmap(r.sqeMap)
	}
	if r.cqMap != nil && (r.sqMap == nil || &r.cqMap[0] != &r.sqMap[0]) {
		unix.Munmap(r.cqMap)
	}
	if r.sqMap != nil {
		unix.Munmap(r.sqMap)
	}
	r.sqMap, r.cqMap, r.sqeMap = nil, nil, nil
	if r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
}

// sqSpace is how many SQEs can be written before the kernel consumes more.
func (r *ring) sqSpace() uint32 {
	return r.sqEntries - (r.localSQTail - atomic.LoadUint32(r.sqHead))
}

// unsubmitted is how many written SQEs the kernel has not consumed yet.
func (r *ring) unsubmitted() uint32 {
	return r.localSQTail - atomic.LoadUint32(r.sqHead)
}

// pushRead writes a READ SQE and publishes it. The caller checked sqSpace
// and keeps buf reachable until the completion is reaped.
func (r *ring) pushRead(fd int, off int64, buf []byte, userData uint64) {
	s := &r.sqes[r.localSQTail&r.sqMask]
	*s = sqe{opcode: ioringOpRead, fd: int32(fd), off: uint64(off), len: uint32(len(buf)), userData: userData}
	if len(buf) > 0 {
		s.addr = uint64(uintptr(unsafe.Pointer(&buf[0])))
	}
	r.localSQTail++
	// The store publishes the SQE contents written above to the kernel.
	atomic.StoreUint32(r.sqTail, r.localSQTail)
}

// pushPollIn writes a one-shot POLL_ADD SQE for POLLIN on fd: it completes
// (with userData) once fd is readable.
func (r *ring) pushPollIn(fd int, userData uint64) {
	// poll32_events shares rw_flags' place in the SQE.
	r.sqes[r.localSQTail&r.sqMask] = sqe{opcode: ioringOpPollAdd, fd: int32(fd), rwFlags: unix.POLLIN, userData: userData}
	r.localSQTail++
	atomic.StoreUint32(r.sqTail, r.localSQTail)
}

// pushNop writes a NOP SQE: it completes (with userData, res 0) as soon as
// it is submitted.
func (r *ring) pushNop(userData uint64) {
	r.sqes[r.localSQTail&r.sqMask] = sqe{opcode: ioringOpNop, userData: userData}
	r.localSQTail++
	atomic.StoreUint32(r.sqTail, r.localSQTail)
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
	if len(cqes) != 1 || cqes[0].userData != probeUserData || cqes[0].res != 0 {
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
var enterHook func(toSubmit uint32)

// enter is io_uring_enter(2) without a signal mask. It blocks in the
// kernel when waiting, as any blocking syscall does in Go (the P is handed
// off), so it is fine to call from a goroutine.
func (r *ring) enter(toSubmit, minComplete, flags uint32) (int, error) {
	if enterHook != nil {
		enterHook(toSubmit)
	}
	return r.syscallEnter(toSubmit, minComplete, flags)
}

// syscallEnter is the io_uring_enter(2) of enter.
func (r *ring) syscallEnter(toSubmit, minComplete, flags uint32) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit), uintptr(minComplete), uintptr(flags), 0, 0)
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}

// reap copies every available CQE into dst and releases the ring slots.
func (r *ring) reap(dst []cqe) []cqe {
	head := atomic.LoadUint32(r.cqHead)
	tail := atomic.LoadUint32(r.cqTail) // acquire: CQE contents up to tail are visible
	for ; head != tail; head++ {
		dst = append(dst, r.cqes[head&r.cqMask])
	}
	// Release the slots only after copying them out.
	atomic.StoreUint32(r.cqHead, head)
	return dst
}

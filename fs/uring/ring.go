package uring

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// This file is the io_uring binding of the transport: a ring of 128-byte
// SQEs (a URING_CMD carries its command in the SQE's second half), with the
// three mappings, enter, URING_CMD and READ. backing/ioengine has its own
// binding for 64-byte SQEs; the layouts are the same
// include/uapi/linux/io_uring.h, but a shared ring would have to carry the
// SQE size through every push, and the read engine's tests pin its
// behaviour. Only the queue's own thread touches a ring after setup.

const (
	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000

	setupSubmitAll    = 1 << 7
	setupCoopTaskrun  = 1 << 8
	setupSQE128       = 1 << 10
	setupSingleIssuer = 1 << 12
	setupDeferTaskrun = 1 << 13

	featSingleMmap = 1 << 0

	enterGetEvents = 1 << 0

	opRead     = 22
	opUringCmd = 46
)

// params is struct io_uring_params (120 bytes).
type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFd uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqOffsets
	cqOff                                                                  cqOffsets
}

type sqOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

// sqe128 is struct io_uring_sqe in a ring set up with IORING_SETUP_SQE128:
// the 64-byte SQE, its last 16 bytes and the 64 after it being the 80-byte
// command area (cmd) of a URING_CMD.
type sqe128 struct {
	opcode   uint8
	flags    uint8
	ioprio   uint16
	fd       int32
	off      uint64 // a URING_CMD's cmd_op in its low 32 bits
	addr     uint64
	len      uint32
	rwFlags  uint32
	userData uint64
	bufIndex uint16
	persona  uint16
	fileIdx  int32
	cmd      [80]byte
}

type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

var (
	_ [120]byte = [unsafe.Sizeof(params{})]byte{}
	_ [128]byte = [unsafe.Sizeof(sqe128{})]byte{}
	_ [16]byte  = [unsafe.Sizeof(cqe{})]byte{}
)

type ring struct {
	fd    int
	flags uint32

	sqMap, cqMap, sqeMap []byte

	sqHead, sqTail *uint32
	sqMask         uint32
	sqEntries      uint32
	sqes           []sqe128
	localTail      uint32

	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []cqe
}

// setupFlagSets are tried in order. DEFER_TASKRUN (6.1) runs completion
// work only when the queue's thread asks for completions, never by
// interrupting it; it needs SINGLE_ISSUER, which the queue is (its thread
// creates the ring and is the only one to submit). COOP_TASKRUN is the
// older way to avoid the interrupts. SQE128 is required: FUSE refuses a
// URING_CMD without it.
var setupFlagSets = []uint32{
	setupSQE128 | setupSubmitAll | setupSingleIssuer | setupDeferTaskrun,
	setupSQE128 | setupSubmitAll | setupCoopTaskrun,
	setupSQE128,
}

// newRing sets up a ring of at least entries SQEs on the calling thread.
func newRing(entries uint32) (*ring, error) {
	var p params
	var fd uintptr
	var errno syscall.Errno
	for _, flags := range setupFlagSets {
		p = params{flags: flags}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
		if errno != unix.EINVAL {
			break
		}
	}
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &ring{fd: int(fd), flags: p.flags}
	if err := r.mmap(&p); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *ring) mmap(p *params) error {
	sqSize := uintptr(p.sqOff.array) + uintptr(p.sqEntries)*4
	cqSize := uintptr(p.cqOff.cqes) + uintptr(p.cqEntries)*unsafe.Sizeof(cqe{})
	single := p.features&featSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
		cqSize = sqSize
	}
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_SHARED | unix.MAP_POPULATE
	var err error
	if r.sqMap, err = unix.Mmap(r.fd, offSQRing, int(sqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQ ring: %w", err)
	}
	if single {
		r.cqMap = r.sqMap
	} else if r.cqMap, err = unix.Mmap(r.fd, offCQRing, int(cqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap CQ ring: %w", err)
	}
	if r.sqeMap, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*int(unsafe.Sizeof(sqe128{})), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQEs: %w", err)
	}
	sq := unsafe.Pointer(&r.sqMap[0])
	r.sqHead = (*uint32)(unsafe.Add(sq, p.sqOff.head))
	r.sqTail = (*uint32)(unsafe.Add(sq, p.sqOff.tail))
	r.sqMask = *(*uint32)(unsafe.Add(sq, p.sqOff.ringMask))
	r.sqEntries = *(*uint32)(unsafe.Add(sq, p.sqOff.ringEntries))
	r.localTail = atomic.LoadUint32(r.sqTail)
	array := unsafe.Slice((*uint32)(unsafe.Add(sq, p.sqOff.array)), r.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.sqes = unsafe.Slice((*sqe128)(unsafe.Pointer(&r.sqeMap[0])), r.sqEntries)
	cq := unsafe.Pointer(&r.cqMap[0])
	r.cqHead = (*uint32)(unsafe.Add(cq, p.cqOff.head))
	r.cqTail = (*uint32)(unsafe.Add(cq, p.cqOff.tail))
	r.cqMask = *(*uint32)(unsafe.Add(cq, p.cqOff.ringMask))
	r.cqes = unsafe.Slice((*cqe)(unsafe.Add(cq, p.cqOff.cqes)), *(*uint32)(unsafe.Add(cq, p.cqOff.ringEntries)))
	return nil
}

// close unmaps the ring and closes it; the kernel cancels what is parked
// in it (FUSE answers a parked fetch with ENOTCONN).
func (r *ring) close() {
	if r.sqeMap != nil {
		_ = unix.Munmap(r.sqeMap)
	}
	if r.cqMap != nil && (r.sqMap == nil || &r.cqMap[0] != &r.sqMap[0]) {
		_ = unix.Munmap(r.cqMap)
	}
	if r.sqMap != nil {
		_ = unix.Munmap(r.sqMap)
	}
	r.sqMap, r.cqMap, r.sqeMap = nil, nil, nil
	if r.fd >= 0 {
		_ = unix.Close(r.fd)
		r.fd = -1
	}
}

// next returns the next free SQE, zeroed; the caller fills it and calls
// publish. The queue never has more SQEs pending than the ring has
// entries (one per ring entry, one for the wake-up read).
func (r *ring) next() *sqe128 {
	s := &r.sqes[r.localTail&r.sqMask]
	*s = sqe128{}
	return s
}

// publish makes the SQE written since the last next visible to the kernel.
func (r *ring) publish() {
	r.localTail++
	atomic.StoreUint32(r.sqTail, r.localTail)
}

// unsubmitted is how many published SQEs the kernel has not consumed.
func (r *ring) unsubmitted() uint32 {
	return r.localTail - atomic.LoadUint32(r.sqHead)
}

func (r *ring) enter(toSubmit, minComplete, flags uint32) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit), uintptr(minComplete), uintptr(flags), 0, 0)
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}

// reap copies every available CQE into dst and releases the slots.
func (r *ring) reap(dst []cqe) []cqe {
	head := atomic.LoadUint32(r.cqHead)
	tail := atomic.LoadUint32(r.cqTail)
	for ; head != tail; head++ {
		dst = append(dst, r.cqes[head&r.cqMask])
	}
	atomic.StoreUint32(r.cqHead, head)
	return dst
}

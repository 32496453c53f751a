// Package ioring is the io_uring binding shared by the read engine
// (backing/ioengine: 64-byte SQEs of reads) and the FUSE transport
// (fs/uring: 128-byte SQEs of URING_CMDs): setup, the three mappings, the
// submission and completion rings, enter. golang.org/x/sys/unix has the
// system call numbers but no types, and the module proxy here serves no
// io_uring library. Layouts are from include/uapi/linux/io_uring.h; what
// goes into an SQE is the caller's, as its own SQE type.
//
// A Ring is not safe for concurrent use: its callers keep its SQ side to
// one submitter (under a lock, or on one thread) and its CQ side to one
// reaper.
package ioring

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Setup flags and features (io_uring_setup(2)).
const (
	SetupClamp        = 1 << 4
	SetupSubmitAll    = 1 << 7
	SetupCoopTaskrun  = 1 << 8
	SetupSQE128       = 1 << 10
	SetupSingleIssuer = 1 << 12
	SetupDeferTaskrun = 1 << 13

	featSingleMmap = 1 << 0
	// featNoIOWait: the kernel takes EnterNoIOWait (6.15+).
	featNoIOWait = 1 << 17

	// EnterGetEvents makes Enter wait for completions.
	EnterGetEvents = 1 << 0
	// EnterNoIOWait keeps a wait in Enter from counting as iowait; see
	// NoIOWait.
	EnterNoIOWait = 1 << 7

	// MaxEntries is the kernel's IORING_MAX_ENTRIES.
	MaxEntries = 32768

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000
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

// CQE is struct io_uring_cqe without the big-CQE extension (16 bytes).
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

var (
	_ [120]byte = [unsafe.Sizeof(params{})]byte{}
	_ [16]byte  = [unsafe.Sizeof(CQE{})]byte{}
)

// Ring is one io_uring instance whose SQEs are of type S (64 bytes, or 128
// with SetupSQE128). Head and tail words are shared with the kernel and
// always accessed with sync/atomic (sequentially consistent, stronger than
// the acquire/release the kernel asks for).
type Ring[S any] struct {
	FD       int
	Flags    uint32 // setup flags the kernel accepted
	Features uint32

	sqMap, cqMap, sqeMap []byte

	sqHead, sqTail *uint32
	sqMask         uint32
	SQEntries      uint32
	sqes           []S
	localTail      uint32 // tail as written; published by atomic store

	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []CQE
}

// New sets up a ring of at least entries SQEs with the first of flagSets
// the kernel accepts (older kernels refuse unknown flags with EINVAL, so
// each set should drop the newest), and maps it. An io_uring_setup error
// wraps its syscall.Errno.
func New[S any](entries uint32, flagSets []uint32) (*Ring[S], error) {
	var sz S
	if s := unsafe.Sizeof(sz); s != 64 && s != 128 {
		return nil, fmt.Errorf("io_uring: an SQE of %d bytes", s)
	}
	entries = min(entries, MaxEntries)
	var p params
	var fd uintptr
	errno := syscall.Errno(unix.EINVAL)
	for _, flags := range flagSets {
		p = params{flags: flags}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
		if errno != unix.EINVAL {
			break
		}
	}
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &Ring[S]{FD: int(fd), Flags: p.flags, Features: p.features}
	if err := r.mmap(&p); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

func (r *Ring[S]) mmap(p *params) error {
	sqSize := uintptr(p.sqOff.array) + uintptr(p.sqEntries)*4
	cqSize := uintptr(p.cqOff.cqes) + uintptr(p.cqEntries)*unsafe.Sizeof(CQE{})
	single := p.features&featSingleMmap != 0
	if single {
		// One mapping serves both rings (5.4+): map the larger size once.
		sqSize = max(sqSize, cqSize)
		cqSize = sqSize
	}
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_SHARED | unix.MAP_POPULATE
	var err error
	if r.sqMap, err = unix.Mmap(r.FD, offSQRing, int(sqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQ ring: %w", err)
	}
	if single {
		r.cqMap = r.sqMap
	} else if r.cqMap, err = unix.Mmap(r.FD, offCQRing, int(cqSize), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap CQ ring: %w", err)
	}
	var sz S
	if r.sqeMap, err = unix.Mmap(r.FD, offSQEs, int(p.sqEntries)*int(unsafe.Sizeof(sz)), prot, flags); err != nil {
		return fmt.Errorf("io_uring: mmap SQEs: %w", err)
	}

	sq := unsafe.Pointer(&r.sqMap[0])
	r.sqHead = (*uint32)(unsafe.Add(sq, p.sqOff.head))
	r.sqTail = (*uint32)(unsafe.Add(sq, p.sqOff.tail))
	r.sqMask = *(*uint32)(unsafe.Add(sq, p.sqOff.ringMask))
	r.SQEntries = *(*uint32)(unsafe.Add(sq, p.sqOff.ringEntries))
	r.localTail = atomic.LoadUint32(r.sqTail)
	// The SQ array maps ring slots to SQE indexes; the identity mapping,
	// written once, lets slot i always use SQE i.
	array := unsafe.Slice((*uint32)(unsafe.Add(sq, p.sqOff.array)), r.SQEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.sqes = unsafe.Slice((*S)(unsafe.Pointer(&r.sqeMap[0])), r.SQEntries)

	cq := unsafe.Pointer(&r.cqMap[0])
	r.cqHead = (*uint32)(unsafe.Add(cq, p.cqOff.head))
	r.cqTail = (*uint32)(unsafe.Add(cq, p.cqOff.tail))
	r.cqMask = *(*uint32)(unsafe.Add(cq, p.cqOff.ringMask))
	r.cqes = unsafe.Slice((*CQE)(unsafe.Add(cq, p.cqOff.cqes)), *(*uint32)(unsafe.Add(cq, p.cqOff.ringEntries)))
	return nil
}

// Close unmaps the rings and closes the ring; the kernel cancels anything
// still in flight.
func (r *Ring[S]) Close() {
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
	if r.FD >= 0 {
		_ = unix.Close(r.FD)
		r.FD = -1
	}
}

// Space is how many SQEs can be written before the kernel consumes more.
func (r *Ring[S]) Space() uint32 {
	return r.SQEntries - (r.localTail - atomic.LoadUint32(r.sqHead))
}

// Unsubmitted is how many published SQEs the kernel has not consumed yet.
func (r *Ring[S]) Unsubmitted() uint32 {
	return r.localTail - atomic.LoadUint32(r.sqHead)
}

// Next returns the next SQE, zeroed, for the caller to fill before
// Publish. The caller has checked Space.
func (r *Ring[S]) Next() *S {
	s := &r.sqes[r.localTail&r.sqMask]
	var zero S
	*s = zero
	return s
}

// Publish hands the SQE filled since Next to the kernel: the tail's store
// publishes its contents.
func (r *Ring[S]) Publish() {
	r.localTail++
	atomic.StoreUint32(r.sqTail, r.localTail)
}

// Enter is io_uring_enter(2) without a signal mask. It blocks in the kernel
// when waiting, as any blocking system call does in Go (the P is handed
// off).
func (r *Ring[S]) Enter(toSubmit, minComplete, flags uint32) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.FD), uintptr(toSubmit), uintptr(minComplete), uintptr(flags), 0, 0)
	if errno != 0 {
		return int(n), errno
	}
	return int(n), nil
}

// NoIOWait is EnterNoIOWait where the kernel takes it, else 0. Since 6.5
// a thread waiting in io_uring_enter while any request of its ring is in
// flight sleeps as iowait: a ring that always holds a request it does not
// expect to complete soon (a FUSE queue's fetch commands, an eventfd poll)
// makes an idle daemon show one CPU in iowait and the node's I/O pressure
// at 100% for as long as it runs (vmstat, node exporters, PSI alerts).
// Waits for such requests pass it; waits for disk reads do not (iowait is
// what they are). Kernels 6.5-6.14 have the accounting and not the flag.
func (r *Ring[S]) NoIOWait() uint32 {
	if r.Features&featNoIOWait != 0 {
		return EnterNoIOWait
	}
	return 0
}

// Reap copies every available CQE into dst and releases their slots.
func (r *Ring[S]) Reap(dst []CQE) []CQE {
	head := atomic.LoadUint32(r.cqHead)
	tail := atomic.LoadUint32(r.cqTail) // acquire: CQE contents up to tail are visible
	for ; head != tail; head++ {
		dst = append(dst, r.cqes[head&r.cqMask])
	}
	// Release the slots only after copying them out.
	atomic.StoreUint32(r.cqHead, head)
	return dst
}

package uring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/ioring"
)

// Registration states of an entry: its thread moves pending → registering
// before it submits its REGISTER, the coordinator pending → abandoned when
// it gives up waiting. Whichever comes first wins, so an entry registers
// only while the coordinator still waits for it: a late REGISTER after a
// fallback could complete the set and make the kernel switch the
// connection to rings nobody serves.
const (
	statePending int32 = iota
	stateRegistering
	stateAbandoned
)

// entry is one ring entry of a queue, served by a thread of its own: the
// thread locks itself, pins itself to the queue's CPU, owns a ring of its
// own and the entry's header and payload, parks the entry with the kernel,
// sleeps in io_uring_enter until a request comes, serves it inline and
// commits the answer, which parks the entry again, in one io_uring_enter.
//
// Why a thread per entry. The kernel delivers a request as task work of
// the thread that parked the entry, which runs only when that thread waits
// in io_uring_enter (DEFER_TASKRUN). A queue served by one thread that
// handed requests to goroutines and committed their answers paid two more
// wake-ups a request (the handler's thread, then the queue's through an
// eventfd): measured with 8 faulting threads, 5 context switches a fault
// instead of /dev/fuse's 3, 1.7× its daemon CPU a fault and 0.5-0.6× its
// faults a second. Here a request costs one wake-up and one system call,
// and a handler that blocks (a backing read, an object-store GET, a
// barrier) holds only its own entry: the kernel sends the queue's next
// requests to its other entries, each parked by a thread that is free.
// A thread never sleeps anywhere but in io_uring_enter and in its own
// handler, which never waits on the mount itself.
type entry struct {
	t   *Transport
	qid int

	r       *ring
	hdrMap  []byte // one page: the 288-byte header
	payload []byte
	iov     [2]unix.Iovec
	lastCmd uint32

	state    atomic.Int32
	start    chan *fuse.ProtocolServer // nil: end without registering
	setupErr chan error
	regErr   chan error
}

func newEntry(t *Transport, qid int) *entry {
	return &entry{
		t: t, qid: qid,
		start:    make(chan *fuse.ProtocolServer, 1),
		setupErr: make(chan error, 1),
		regErr:   make(chan error, 1),
	}
}

// run is the entry's thread, from setup to the end of the mount.
func (e *entry) run() {
	// Never unlocked: the thread ends with the goroutine, and with it
	// anything the kernel still meant for it.
	runtime.LockOSThread()
	err := e.setup()
	e.setupErr <- err
	if err != nil {
		e.release()
		return
	}
	ps := <-e.start
	if ps == nil || !e.state.CompareAndSwap(statePending, stateRegistering) {
		e.release()
		return
	}
	err = e.register()
	e.regErr <- err
	if err != nil {
		e.release()
		return
	}
	if e.serve(ps) {
		e.release()
	}
}

// setup pins the thread, makes the ring and the buffers.
func (e *entry) setup() error {
	var set unix.CPUSet
	set.Set(e.qid)
	// A possible CPU that is offline (or outside the daemon's cpuset)
	// sends no requests; its queue's threads need not run there.
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		e.t.log.Debug("fuse ring thread not pinned", zap.Int("queue", e.qid), zap.Error(err))
	}
	var err error
	if e.r, err = newRing(2); err != nil {
		return err
	}
	// A NOP through io_uring_enter: a sandbox may allow io_uring_setup and
	// refuse io_uring_enter, and that must be known before INIT asks the
	// kernel for rings, or nothing could register, nor force the fallback.
	e.r.Next().opcode = opNop
	e.r.Publish()
	if _, err := e.r.Enter(1, 1, ioring.EnterGetEvents); err != nil {
		return fmt.Errorf("io_uring_enter: %w", err)
	}
	if c := e.r.Reap(nil); len(c) != 1 || c[0].Res != 0 {
		return fmt.Errorf("io_uring: a NOP completed as %+v", c)
	}
	// The buffers are the daemon's own anonymous memory, their first pages
	// populated now: the kernel copies requests into them from the
	// thread's task work, and a page fault there takes the daemon's
	// mmap_lock, which the pin worker's populate of our own mount may hold
	// while it waits for a READ (docs/design.md, the MADV_POPULATE_READ
	// fact; only this entry would wait: every entry has its own thread).
	// Not locked: the daemon's locked memory is the hot tier's budget
	// (cache_used_bytes, RLIMIT_MEMLOCK), and 256 KiB an entry locked
	// showed up as 8 MiB over it.
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if e.hdrMap, err = unix.Mmap(-1, 0, unix.Getpagesize(), prot, flags|unix.MAP_POPULATE); err != nil {
		return fmt.Errorf("ring header: %w", err)
	}
	if e.payload, err = unix.Mmap(-1, 0, e.t.payload, prot, flags|unix.MAP_NORESERVE); err != nil {
		return fmt.Errorf("ring payload: %w", err)
	}
	// Only the payload's first page: a READ's answer (a page) is written
	// there by this thread's handler, and what the kernel copies in from
	// task work is the header and a name or a hint frame; the rest of 256
	// KiB is touched only by large writes.
	e.payload[0] = 0
	e.iov[0] = unix.Iovec{Base: &e.hdrMap[0]}
	e.iov[0].SetLen(hdrSize)
	e.iov[1] = unix.Iovec{Base: &e.payload[0]}
	e.iov[1].SetLen(len(e.payload))
	return nil
}

// release closes the ring (the kernel cancels what is parked in it), then
// frees the buffers: until the ring is closed the kernel may write them.
func (e *entry) release() {
	if e.r != nil {
		e.r.Close()
	}
	if e.hdrMap != nil {
		_ = unix.Munmap(e.hdrMap)
	}
	if e.payload != nil {
		_ = unix.Munmap(e.payload)
	}
	e.hdrMap, e.payload = nil, nil
}

// register parks the entry with the kernel. A REGISTER that fails
// completes as it is submitted; one that succeeds stays parked until a
// request comes, so a CQE now is a failure.
func (e *entry) register() error {
	if err := e.r.registerFile(e.t.fd); err != nil {
		return err
	}
	e.push(cmdRegister, 0)
	if _, err := e.r.Enter(1, 0, 0); err != nil {
		return fmt.Errorf("queue %d: io_uring_enter: %w", e.qid, err)
	}
	if c := e.r.Reap(nil); len(c) > 0 {
		return fmt.Errorf("queue %d: REGISTER: %w", e.qid, syscall.Errno(-c[0].Res))
	}
	if e.r.Unsubmitted() > 0 {
		return fmt.Errorf("queue %d: the kernel did not take the REGISTER", e.qid)
	}
	return nil
}

// push writes the entry's URING_CMD.
func (e *entry) push(cmd uint32, commitID uint64) {
	e.lastCmd = cmd
	s := e.r.Next()
	s.opcode = opUringCmd
	s.flags = sqeFixedFile
	s.off = uint64(cmd)
	if cmd == cmdRegister {
		s.addr = uint64(uintptr(unsafe.Pointer(&e.iov[0])))
		s.len = 2
	}
	cmdReq(s, commitID, uint16(e.qid))
	e.r.Publish()
}

// serve is the entry's loop: sleep in enter until a request comes, serve
// it, commit the answer and sleep again, in the same enter. It ends when
// the kernel ends the entry: ENOTCONN once the mount is gone. It returns
// false when it gave up with the ring in an unknown state: the buffers
// then stay mapped.
func (e *entry) serve(ps *fuse.ProtocolServer) bool {
	var cqes []ioring.CQE
	for {
		// A queue waits for requests, not for I/O: no iowait (NoIOWait).
		_, err := e.r.Enter(e.r.Unsubmitted(), 1, ioring.EnterGetEvents|e.r.NoIOWait())
		e.t.enters.Add(1)
		if err != nil && !errors.Is(err, unix.EINTR) && !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EBUSY) {
			// Nothing a retry changes (EBADF, EFAULT, EPERM): this entry's
			// requests would wait for ever; say so loudly.
			e.t.log.Error("fuse ring thread failed: a request of its queue may stall until unmount", zap.Int("queue", e.qid), zap.Error(err))
			return false
		}
		cqes = e.r.Reap(cqes[:0])
		for _, c := range cqes {
			hdr := e.hdrMap[:hdrSize]
			switch {
			case c.Res == 0:
				e.t.requests.Add(1)
				e.handle(ps, hdr)
				e.push(cmdCommitAndFetch, binary.LittleEndian.Uint64(hdr[hdrCommitID:]))
			case c.Res == -int32(unix.EINTR) || c.Res == -int32(unix.EAGAIN):
				e.push(e.lastCmd, binary.LittleEndian.Uint64(hdr[hdrCommitID:]))
			default:
				// ENOTCONN: the mount is gone; anything else ends the
				// entry too, and is worth a line.
				if c.Res != -int32(unix.ENOTCONN) && c.Res != -int32(unix.ECONNABORTED) {
					e.t.log.Warn("fuse ring entry ended", zap.Int("queue", e.qid), zap.Error(syscall.Errno(-c.Res)))
				}
				return true
			}
		}
	}
}

// handle serves the request in hdr and the payload and writes its answer
// into them.
func (e *entry) handle(ps *fuse.ProtocolServer, hdr []byte) {
	inLen := int(binary.LittleEndian.Uint32(hdr[0:]))
	opcode := binary.LittleEndian.Uint32(hdr[4:])
	unique := binary.LittleEndian.Uint64(hdr[8:])
	payloadLen := int(binary.LittleEndian.Uint32(hdr[hdrPayload:]))
	opLen := inLen - inHeaderSize - payloadLen
	n := 0
	status := fuse.EIO
	if payloadLen <= len(e.payload) && opLen >= 0 && opLen <= hdrOpInSize {
		in := [][]byte{hdr[:inHeaderSize], hdr[hdrOpIn : hdrOpIn+opLen], e.payload[:payloadLen]}
		if payloadLen > 0 && opcode != opWrite {
			// The answer is written into the same payload buffer, and an
			// operation with both (a name in, a value out) would read
			// what it writes. A WRITE answers no payload; its data stays.
			in[2] = append([]byte(nil), in[2]...)
		}
		n, status = ps.HandleRequest(in, [][]byte{hdr[:outHeaderSize], e.payload})
	}
	if n < outHeaderSize || !status.Ok() {
		// A request go-fuse could not parse, or one it answers nothing
		// (the connection is gone): the entry still needs its commit.
		eio := -int32(syscall.EIO)
		binary.LittleEndian.PutUint32(hdr[0:], outHeaderSize)
		binary.LittleEndian.PutUint32(hdr[4:], uint32(eio))
		binary.LittleEndian.PutUint64(hdr[8:], unique)
		n = outHeaderSize
	}
	binary.LittleEndian.PutUint32(hdr[hdrPayload:], uint32(n-outHeaderSize))
}

// opWrite is FUSE_WRITE.
const opWrite = 16

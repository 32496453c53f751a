package uring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// wakeUserData marks the completion of the eventfd read that wakes a
// queue's thread; entry indexes never reach it.
const wakeUserData = ^uint64(0)

// Registration states of a queue: the thread moves pending → registering
// before it submits its REGISTERs, the coordinator pending → abandoned when
// it gives up waiting. Whichever comes first wins, so a queue registers
// only if the coordinator still waits for it: a late REGISTER after a
// fallback would make the kernel switch the connection to rings nobody
// serves.
const (
	statePending int32 = iota
	stateRegistering
	stateAbandoned
)

// entry is one ring entry: its header and payload (in the queue's own
// mappings) and the iovec registered for them.
type entry struct {
	hdr     []byte
	payload []byte
	iov     [2]unix.Iovec
	lastCmd uint32
}

// queue is the ring of one possible CPU and the thread that owns it. Its
// thread is locked and pinned to the CPU: the kernel sends a request to the
// queue of the CPU its caller runs on, and delivers it as task work of the
// thread that parked the entry, which only the queue's thread does. That
// thread only ever sleeps in io_uring_enter, which runs task work, never in
// a request's handler: handlers run on goroutines (a backing read, an
// object-store GET or a barrier may take milliseconds, and the queue's
// other requests must not wait for them), and their answers are committed
// by the queue's thread, woken through an eventfd it reads in its ring.
type queue struct {
	t     *Transport
	qid   int
	depth int

	r        *ring
	efd      int
	hdrMap   []byte
	plMap    []byte
	ents     []entry
	efdBuf   [8]byte
	ps       *fuse.ProtocolServer
	state    atomic.Int32
	start    chan *fuse.ProtocolServer // nil: stop without registering
	setupErr chan error
	regErr   chan error
	done     chan struct{}

	mu       sync.Mutex
	ready    []uint16 // GUARDED_BY(mu): entries whose answer is written
	sleeping bool     // GUARDED_BY(mu): the thread is (about to be) in enter
	woken    bool     // GUARDED_BY(mu): an eventfd write is on its way
	stopping bool     // GUARDED_BY(mu): close the ring and end
	// wakers counts the callers that decided to write the eventfd and have
	// not yet; the eventfd is closed only once the thread is gone and none
	// is left, or a late write could land in a file that took its number.
	wakers int  // GUARDED_BY(mu)
	gone   bool // GUARDED_BY(mu)
}

func newQueue(t *Transport, qid, depth int) *queue {
	return &queue{
		t: t, qid: qid, depth: depth, efd: -1,
		start:    make(chan *fuse.ProtocolServer, 1),
		setupErr: make(chan error, 1),
		regErr:   make(chan error, 1),
		done:     make(chan struct{}),
	}
}

// run is the queue's thread, from setup to the last entry's end.
func (q *queue) run() {
	// Never unlocked: the thread ends with the goroutine, and with it
	// anything the kernel still meant for it.
	runtime.LockOSThread()
	defer close(q.done)
	err := q.setup()
	q.setupErr <- err
	if err != nil {
		q.release()
		return
	}
	ps := <-q.start
	if ps == nil || !q.state.CompareAndSwap(statePending, stateRegistering) {
		q.release()
		return
	}
	q.ps = ps
	err = q.register()
	q.regErr <- err
	if err != nil {
		q.release()
		return
	}
	if q.serve() {
		q.release()
	}
}

// setup pins the thread, makes the ring, the eventfd and the buffers.
func (q *queue) setup() error {
	var set unix.CPUSet
	set.Set(q.qid)
	// A possible CPU that is offline (or outside the daemon's cpuset)
	// sends no requests; its queue need not run there.
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		q.t.log.Debug("fuse ring queue not pinned", zap.Int("queue", q.qid), zap.Error(err))
	}
	var err error
	// One SQE per entry and one for the wake-up read: never more pending.
	if q.r, err = newRing(uint32(q.depth + 1)); err != nil {
		return err
	}
	if q.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return fmt.Errorf("eventfd: %w", err)
	}
	// The buffers are the daemon's own anonymous memory, populated and
	// (where allowed) locked now: the kernel copies requests into them from
	// the thread's task work, and a page fault there takes the daemon's
	// mmap_lock, which the pin worker's populate of our own mount may hold
	// while it waits for a READ that this very thread has to deliver
	// (docs/design.md, the MADV_POPULATE_READ fact).
	page := unix.Getpagesize()
	hdrStride := (hdrSize + page - 1) / page * page
	const prot = unix.PROT_READ | unix.PROT_WRITE
	const flags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_POPULATE
	if q.hdrMap, err = unix.Mmap(-1, 0, hdrStride*q.depth, prot, flags); err != nil {
		return fmt.Errorf("ring headers: %w", err)
	}
	if q.plMap, err = unix.Mmap(-1, 0, q.t.payload*q.depth, prot, flags); err != nil {
		return fmt.Errorf("ring payloads: %w", err)
	}
	_ = unix.Mlock(q.hdrMap)
	_ = unix.Mlock(q.plMap)
	q.ents = make([]entry, q.depth)
	for i := range q.ents {
		e := &q.ents[i]
		e.hdr = q.hdrMap[i*hdrStride : i*hdrStride+hdrSize : i*hdrStride+hdrSize]
		e.payload = q.plMap[i*q.t.payload : (i+1)*q.t.payload : (i+1)*q.t.payload]
		e.iov[0] = unix.Iovec{Base: &e.hdr[0]}
		e.iov[0].SetLen(len(e.hdr))
		e.iov[1] = unix.Iovec{Base: &e.payload[0]}
		e.iov[1].SetLen(len(e.payload))
	}
	return nil
}

// release closes the ring (the kernel cancels what is parked in it) and
// frees the buffers. Only once the ring is closed: until then the kernel
// may write into them.
func (q *queue) release() {
	if q.r != nil {
		q.r.close()
	}
	q.mu.Lock()
	q.gone = true
	q.closeEventfdLocked()
	q.mu.Unlock()
	if q.hdrMap != nil {
		_ = unix.Munmap(q.hdrMap)
	}
	if q.plMap != nil {
		_ = unix.Munmap(q.plMap)
	}
	q.hdrMap, q.plMap, q.ents = nil, nil, nil
}

// register parks every entry of the queue with the kernel. A REGISTER that
// fails completes as it is submitted; one that succeeds stays parked until
// a request comes, so a CQE now is a failure.
func (q *queue) register() error {
	if err := q.r.registerFile(q.t.fd); err != nil {
		return err
	}
	for i := range q.ents {
		q.push(i, cmdRegister, 0)
	}
	n := q.r.unsubmitted()
	if _, err := q.r.enter(n, 0, 0); err != nil {
		return fmt.Errorf("queue %d: io_uring_enter: %w", q.qid, err)
	}
	if c := q.r.reap(nil); len(c) > 0 {
		return fmt.Errorf("queue %d: REGISTER: %w", q.qid, syscall.Errno(-c[0].res))
	}
	if left := q.r.unsubmitted(); left > 0 {
		return fmt.Errorf("queue %d: the kernel took %d of %d REGISTERs", q.qid, n-left, n)
	}
	return nil
}

// push writes a URING_CMD for entry i.
func (q *queue) push(i int, cmd uint32, commitID uint64) {
	e := &q.ents[i]
	e.lastCmd = cmd
	s := q.r.next()
	s.opcode = opUringCmd
	s.flags = sqeFixedFile
	s.fd = 0
	s.off = uint64(cmd)
	s.userData = uint64(i)
	if cmd == cmdRegister {
		s.addr = uint64(uintptr(unsafe.Pointer(&e.iov[0])))
		s.len = 2
	}
	cmdReq(s, commitID, uint16(q.qid))
	q.r.publish()
}

// serve is the queue's loop: commit the answers written, sleep in enter
// until a request or an answer comes, hand requests to handlers. It ends
// when every entry has ended (the kernel answers each parked entry with
// ENOTCONN once the mount is gone, and each commit of a request it
// dropped at unmount), or the queue is stopped. It returns false when
// handlers may still write into the buffers, which must then stay mapped.
func (q *queue) serve() bool {
	live := len(q.ents)
	armed := false
	var cqes []cqe
	var commits []uint16
	for live > 0 {
		q.mu.Lock()
		if q.stopping {
			q.mu.Unlock()
			return true
		}
		commits, q.ready = q.ready, commits[:0]
		q.sleeping = true
		q.mu.Unlock()
		for _, i := range commits {
			e := &q.ents[i]
			q.push(int(i), cmdCommitAndFetch, binary.LittleEndian.Uint64(e.hdr[hdrCommitID:]))
		}
		q.t.commits.Add(uint64(len(commits)))
		if !armed {
			s := q.r.next()
			s.opcode = opRead
			s.fd = int32(q.efd)
			s.addr = uint64(uintptr(unsafe.Pointer(&q.efdBuf[0])))
			s.len = uint32(len(q.efdBuf))
			s.userData = wakeUserData
			q.r.publish()
			armed = true
		}
		_, err := q.r.enter(q.r.unsubmitted(), 1, enterGetEvents)
		q.t.enters.Add(1)
		if err != nil && !errors.Is(err, unix.EINTR) && !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EBUSY) {
			// Nothing a retry changes (EBADF, EFAULT, EPERM): the mount's
			// requests on this queue would wait for ever; say so loudly.
			q.t.log.Error("fuse ring queue failed: its requests stall until unmount", zap.Int("queue", q.qid), zap.Error(err))
			return false
		}
		q.mu.Lock()
		q.sleeping = false
		q.mu.Unlock()
		cqes = q.r.reap(cqes[:0])
		for _, c := range cqes {
			if c.userData == wakeUserData {
				armed = false
				q.mu.Lock()
				q.woken = false
				q.mu.Unlock()
				continue
			}
			i := int(c.userData)
			switch {
			case c.res == 0:
				q.t.requests.Add(1)
				go q.handle(i)
			case c.res == -int32(unix.EINTR) || c.res == -int32(unix.EAGAIN):
				e := &q.ents[i]
				q.push(i, e.lastCmd, binary.LittleEndian.Uint64(e.hdr[hdrCommitID:]))
			default:
				// ENOTCONN: the mount is gone (or stopping); anything else
				// ends the entry too, and is worth a line.
				live--
				if c.res != -int32(unix.ENOTCONN) && c.res != -int32(unix.ECONNABORTED) {
					q.t.log.Warn("fuse ring entry ended", zap.Int("queue", q.qid), zap.Int("entry", i), zap.Error(syscall.Errno(-c.res)))
				}
			}
		}
	}
	return true
}

// handle serves the request in entry i and queues its answer for commit.
// It runs on its own goroutine: the handler may block.
func (q *queue) handle(i int) {
	e := &q.ents[i]
	inLen := int(binary.LittleEndian.Uint32(e.hdr[0:]))
	opcode := binary.LittleEndian.Uint32(e.hdr[4:])
	unique := binary.LittleEndian.Uint64(e.hdr[8:])
	payloadLen := int(binary.LittleEndian.Uint32(e.hdr[hdrPayload:]))
	opLen := inLen - inHeaderSize - payloadLen
	n := 0
	status := fuse.EIO
	if payloadLen <= len(e.payload) && opLen >= 0 && opLen <= hdrOpInSize {
		in := [][]byte{e.hdr[:inHeaderSize], e.hdr[hdrOpIn : hdrOpIn+opLen], e.payload[:payloadLen]}
		if payloadLen > 0 && opcode != opWrite {
			// The answer is written into the same payload buffer, and an
			// operation with both (a name in, a value out) would read
			// what it writes. A WRITE answers no payload; its data stays.
			in[2] = append([]byte(nil), in[2]...)
		}
		n, status = q.ps.HandleRequest(in, [][]byte{e.hdr[:outHeaderSize], e.payload})
	}
	if n < outHeaderSize || !status.Ok() {
		// A request go-fuse could not parse, or one it answers nothing
		// (the connection is gone): the entry still needs its commit.
		binary.LittleEndian.PutUint32(e.hdr[0:], outHeaderSize)
		eio := -int32(syscall.EIO)
		binary.LittleEndian.PutUint32(e.hdr[4:], uint32(eio))
		binary.LittleEndian.PutUint64(e.hdr[8:], unique)
		n = outHeaderSize
	}
	binary.LittleEndian.PutUint32(e.hdr[hdrPayload:], uint32(n-outHeaderSize))
	q.answered(i)
}

// opWrite is FUSE_WRITE.
const opWrite = 16

// answered queues entry i for commit and wakes the thread if it sleeps.
func (q *queue) answered(i int) {
	q.mu.Lock()
	q.ready = append(q.ready, uint16(i))
	q.wakeLocked()
}

// wakeLocked writes the eventfd the thread reads in its ring if the thread
// sleeps and nobody did yet. It unlocks q.mu.
func (q *queue) wakeLocked() {
	if !q.sleeping || q.woken || q.gone {
		q.mu.Unlock()
		return
	}
	q.woken = true
	q.wakers++
	efd := q.efd
	q.mu.Unlock()
	var one [8]byte
	binary.LittleEndian.PutUint64(one[:], 1)
	_, _ = unix.Write(efd, one[:])
	q.t.wakeups.Add(1)
	q.mu.Lock()
	q.wakers--
	q.closeEventfdLocked()
	q.mu.Unlock()
}

// closeEventfdLocked closes the eventfd once the thread is gone and no
// writer is left.
func (q *queue) closeEventfdLocked() {
	if q.gone && q.wakers == 0 && q.efd >= 0 {
		_ = unix.Close(q.efd)
		q.efd = -1
	}
}

// stop ends a queue that is not serving a mount: before it registered, or
// after a fallback. A serving queue ends by itself when the mount goes.
func (q *queue) stop() {
	q.mu.Lock()
	q.stopping = true
	q.wakeLocked()
}

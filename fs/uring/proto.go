package uring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/ioring"
)

// The FUSE-over-io_uring protocol, include/uapi/linux/fuse.h (7.42) and
// fs/fuse/dev_uring.c. A ring entry is two buffers registered with the
// kernel: a 288-byte header (fuse_uring_req_header) and a payload. A
// request arrives as the CQE of the SQE that parked the entry: the
// fuse_in_header in the header's first 128 bytes, the operation's own
// struct (its first argument) in the next 128, the other arguments in the
// payload, their length in ring_ent_in_out. The answer goes back the same
// way: fuse_out_header first, every output argument in the payload, and a
// COMMIT_AND_FETCH SQE that also parks the entry for the next request.
const (
	cmdRegister       = 1 // FUSE_IO_URING_CMD_REGISTER
	cmdCommitAndFetch = 2 // FUSE_IO_URING_CMD_COMMIT_AND_FETCH

	hdrSize     = 288 // sizeof(struct fuse_uring_req_header)
	hdrOpIn     = 128 // offset of op_in
	hdrOpInSize = 128 // FUSE_URING_OP_IN_OUT_SZ
	hdrCommitID = 256 + 8
	hdrPayload  = 256 + 16 // ring_ent_in_out.payload_sz

	inHeaderSize  = 40 // sizeof(struct fuse_in_header)
	outHeaderSize = 16 // sizeof(struct fuse_out_header)

	// minPayload is FUSE_MIN_READ_BUFFER: the kernel wants every payload
	// buffer to hold max(8 KiB, max_write, max_pages pages).
	minPayload = 8192

	sqeFixedFile   = 1 << 0 // IOSQE_FIXED_FILE
	registerFiles  = 2      // IORING_REGISTER_FILES
	enableUringSys = "/sys/module/fuse/parameters/enable_uring"
	possibleCPUs   = "/sys/devices/system/cpu/possible"
)

// cmdReq writes struct fuse_uring_cmd_req into a URING_CMD's command area.
func cmdReq(s *sqe128, commitID uint64, qid uint16) {
	binary.LittleEndian.PutUint64(s.cmd[0:], 0) // flags
	binary.LittleEndian.PutUint64(s.cmd[8:], commitID)
	binary.LittleEndian.PutUint16(s.cmd[16:], qid)
}

// enabled reports whether the fuse module offers io_uring to new mounts
// (the enable_uring parameter, off by default; root may write it).
func enabled() (bool, error) {
	b, err := os.ReadFile(enableUringSys)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, errors.New("the kernel's fuse module has no io_uring (no enable_uring parameter: before 6.14, or CONFIG_FUSE_IO_URING off)")
		}
		return false, err
	}
	return strings.TrimSpace(string(b)) == "Y", nil
}

// numPossibleCPUs is the kernel's num_possible_cpus(): FUSE makes one queue
// per possible CPU (not per online one), and serves nothing until every one
// of them is registered.
func numPossibleCPUs() (int, error) {
	b, err := os.ReadFile(possibleCPUs)
	if err != nil {
		return 0, err
	}
	return parseCPUList(strings.TrimSpace(string(b)))
}

// parseCPUList counts the CPUs of a list such as "0-3,8".
func parseCPUList(s string) (int, error) {
	n := 0
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return 0, fmt.Errorf("cpu list %q: %w", s, err)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return 0, fmt.Errorf("cpu list %q: bad range %q", s, part)
			}
		}
		n += b - a + 1
	}
	return n, nil
}

// protocolServer returns a ProtocolServer that shares srv's own request
// state: the INIT settings it parses requests with, and the list of
// requests in flight that srv's /dev/fuse loop looks an INTERRUPT up in.
// The kernel sends the INTERRUPT of a request served on a ring through
// /dev/fuse; a ProtocolServer of its own (fuse.NewProtocolServer) would
// never hear of it (go-fuse's answer, EAGAIN, then finds no request on
// /dev/fuse and the interrupt is lost), and a barrier read on the ring
// could not be interrupted. fuse.Server and fuse.ProtocolServer both start
// with the same embedded protocolServer; checkLayout proves it for the
// go-fuse this is built with, and New refuses the rings otherwise.
func protocolServer(srv *fuse.Server) *fuse.ProtocolServer {
	return (*fuse.ProtocolServer)(unsafe.Pointer(srv))
}

// checkLayout is the proof protocolServer relies on.
func checkLayout() error {
	s, p := reflect.TypeFor[fuse.Server](), reflect.TypeFor[fuse.ProtocolServer]()
	if s.NumField() == 0 || p.NumField() != 1 {
		return errors.New("go-fuse's Server or ProtocolServer changed shape")
	}
	sf, pf := s.Field(0), p.Field(0)
	if !sf.Anonymous || !pf.Anonymous || sf.Offset != 0 || sf.Type != pf.Type || p.Size() != pf.Type.Size() {
		return errors.New("go-fuse's Server no longer starts with ProtocolServer's protocolServer")
	}
	return nil
}

// fuseFD is the /dev/fuse descriptor srv reads. go-fuse does not export it;
// it is read (not copied: Fd would make the file blocking) through the
// os.File srv holds.
func fuseFD(srv *fuse.Server) (int, error) {
	v := reflect.ValueOf(srv).Elem().FieldByName("fuseFD")
	if !v.IsValid() || v.Kind() != reflect.Pointer || v.IsNil() {
		return -1, errors.New("go-fuse's Server has no fuseFD")
	}
	f := v.Elem().FieldByName("file")
	if !f.IsValid() || f.Type() != reflect.TypeFor[*os.File]() || f.IsNil() {
		return -1, errors.New("go-fuse's fuseFD has no file")
	}
	file := (*os.File)(unsafe.Pointer(f.Pointer()))
	rc, err := file.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// registerFile registers fd as the ring's fixed file 0: every URING_CMD
// names it so, and the ring holds its own reference to /dev/fuse.
func (r *ring) registerFile(fd int) error {
	fds := []int32{int32(fd)}
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.FD), registerFiles, uintptr(unsafe.Pointer(&fds[0])), 1, 0, 0)
	if errno != 0 {
		return fmt.Errorf("io_uring_register(FILES): %w", errno)
	}
	return nil
}

// forceFallback makes the kernel give up the rings of the connection on
// fd: a REGISTER that fails clears the connection's io_uring flag, and the
// requests waiting for the rings to be ready then go to /dev/fuse
// (fuse_uring_cmd in fs/fuse/dev_uring.c). It is what a queue that could
// not register, or did not in time, leaves behind. The REGISTER has no
// iovec, so it fails as it is submitted: nothing is parked on the calling
// thread.
func forceFallback(fd int) error {
	// The ring is single-issuer: made, entered and closed on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r, err := newRing(2)
	if err != nil {
		return err
	}
	defer r.Close()
	s := r.Next()
	s.opcode = opUringCmd
	s.fd = int32(fd)
	s.off = cmdRegister
	s.len = 0 // the kernel wants 2 iovecs: EINVAL
	r.Publish()
	if _, err := r.Enter(1, 1, ioring.EnterGetEvents); err != nil {
		return fmt.Errorf("io_uring_enter: %w", err)
	}
	c := r.Reap(nil)
	if len(c) != 1 || c[0].Res >= 0 {
		return fmt.Errorf("a REGISTER meant to fail completed as %+v", c)
	}
	return nil
}

package uring

import (
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/engramfs/engramfs/internal/ioring"
)

// The rings of the transport: 128-byte SQEs (a URING_CMD carries its
// command in the SQE's second half) on the shared binding, internal/ioring.
// Only the thread that made a ring touches it.

const (
	opNop      = 0  // IORING_OP_NOP
	opUringCmd = 46 // IORING_OP_URING_CMD
)

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

var _ [128]byte = [unsafe.Sizeof(sqe128{})]byte{}

type ring struct {
	*ioring.Ring[sqe128]
}

// setupFlagSets are tried in order. DEFER_TASKRUN (6.1) runs completion
// work only when the ring's thread asks for completions, never by
// interrupting it; it needs SINGLE_ISSUER, which every ring here is (its
// thread makes it and is the only one to submit). COOP_TASKRUN is the
// older way to avoid the interrupts. SQE128 is required: FUSE refuses a
// URING_CMD without it.
var setupFlagSets = []uint32{
	ioring.SetupSQE128 | ioring.SetupSubmitAll | ioring.SetupSingleIssuer | ioring.SetupDeferTaskrun,
	ioring.SetupSQE128 | ioring.SetupSubmitAll | ioring.SetupCoopTaskrun,
	ioring.SetupSQE128,
}

// newRing sets up a ring of at least entries SQEs on the calling thread.
func newRing(entries uint32) (*ring, error) {
	r, err := ioring.New[sqe128](entries, setupFlagSets)
	if errors.Is(err, syscall.ENOMEM) {
		// Measured under Docker's defaults (64 KiB, no CAP_IPC_LOCK).
		return nil, fmt.Errorf("fuse ring: %w (ring memory is charged to RLIMIT_MEMLOCK without CAP_IPC_LOCK)", err)
	}
	if err != nil {
		return nil, fmt.Errorf("fuse ring: %w", err)
	}
	return &ring{r}, nil
}

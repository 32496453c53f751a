package hints

import (
	"encoding/binary"
	"fmt"
)

// The step: a decode step's frames and its barrier in one ioctl(2) on a
// control handle, one FUSE request where a write per frame and a barrier
// read are a request each (BenchmarkDecodeStepAllResident: the round trips
// are most of a step whose pages are all resident).
//
// The command is _IOWR(StepIoctlType, StepIoctlNr, size): the kernel copies
// size bytes of the caller's buffer to the filesystem and size bytes of the
// answer back into it (a FUSE "restricted" ioctl, whose sizes the command
// carries). The buffer going in:
//
//	u32 length of the frames (little-endian) · the frames · anything
//
// and coming back:
//
//	u32 length of the status line · the barrier's status line (JSON and "\n")
//	· zeros
//
// The frames are taken as a write(2) of the same bytes would take them, and
// the handle's barrier follows, so the line counts what settled since the
// previous barrier on the handle, earlier writes included. A frame the
// filesystem rejects does not fail the call: the line's "error" says why.
// The call fails with EINVAL when the buffer is smaller than StepMinBytes,
// the length does not fit it, or the frames do not begin and end at a frame
// boundary of the handle's stream; with EAGAIN, nothing taken, when a decode
// frame meets the handle's full decode backlog (send it again); with EINTR
// when a signal ended the wait: the frames were taken, and the next barrier
// waits for them.
const (
	StepIoctlType = 0xE6 // arbitrary: only the control file answers it
	StepIoctlNr   = 1
	// StepMaxBytes is the largest buffer a command can name: _IOC_SIZE
	// has 14 bits. A step of one layer holds at most (StepMaxBytes-4-12)/8
	// = 2,045 rows, of two 2,044; a larger step is sent as writes and a
	// read.
	StepMaxBytes = 1<<14 - 1
	// StepMinBytes leaves room for the status line (the read barrier asks
	// for 256 bytes too).
	StepMinBytes = stepHeader + 256
	stepHeader   = 4

	// <asm-generic/ioctl.h>
	iocWrite     = 1
	iocRead      = 2
	iocSizeBits  = 14
	iocTypeShift = 8
	iocSizeShift = 16
	iocDirShift  = 30
)

// StepCmd is the ioctl command of a step whose buffer is size bytes
// (StepMinBytes..StepMaxBytes).
func StepCmd(size int) uint32 {
	return (iocRead|iocWrite)<<iocDirShift | uint32(size)<<iocSizeShift |
		StepIoctlType<<iocTypeShift | StepIoctlNr
}

// StepSize is the buffer size a step command names; ok is false for a
// command that is not a step's.
func StepSize(cmd uint32) (size int, ok bool) {
	size = int(cmd >> iocSizeShift & (1<<iocSizeBits - 1))
	return size, cmd == StepCmd(size)
}

// StepBuffer returns a step's buffer holding frames (whole frames, encoded
// with AppendBinary or AppendText), sized for them and the status line, in
// dst's memory; ok is false when they do not fit one step.
func StepBuffer(dst, frames []byte) (buf []byte, ok bool) {
	if stepHeader+len(frames) > StepMaxBytes {
		return dst, false
	}
	return endStep(append(append(dst[:0], 0, 0, 0, 0), frames...)), true
}

// DecodeStepBuffer is StepBuffer of a decode frame of rows[j] for each
// layers[j] (each within 0..MaxLayer), the frames encoded in place; ok is
// false, and nothing encoded, when they do not fit one step.
func DecodeStepBuffer(dst []byte, layers []int, rows [][]uint64) (buf []byte, ok bool) {
	size := stepHeader
	for _, rs := range rows {
		if size += headerLen + rowLen*len(rs); size > StepMaxBytes {
			return dst, false
		}
	}
	buf = append(dst[:0], 0, 0, 0, 0)
	for j, l := range layers {
		buf = AppendBinary(buf, Decode, l, rows[j])
	}
	return endStep(buf), true
}

// endStep puts the length of the frames after buf's header and pads buf
// with zeros to StepMinBytes, the room of the status line.
func endStep(buf []byte) []byte {
	binary.LittleEndian.PutUint32(buf, uint32(len(buf)-stepHeader))
	if len(buf) < StepMinBytes {
		buf = append(buf, make([]byte, StepMinBytes-len(buf))...)
	}
	return buf
}

// StepFrames returns the frames of a step's buffer.
func StepFrames(buf []byte) ([]byte, error) {
	if len(buf) < StepMinBytes {
		return nil, fmt.Errorf("a step's buffer has %d bytes, fewer than %d", len(buf), StepMinBytes)
	}
	n := binary.LittleEndian.Uint32(buf)
	if uint64(n) > uint64(len(buf)-stepHeader) {
		return nil, fmt.Errorf("a step names %d bytes of frames in a buffer of %d", n, len(buf))
	}
	return buf[stepHeader : stepHeader+int(n)], nil
}

// PutStepStatus writes the answer of a step into buf (the same size as the
// request's): line's length, line, zeros.
func PutStepStatus(buf, line []byte) error {
	if stepHeader+len(line) > len(buf) {
		return fmt.Errorf("a status line of %d bytes does not fit a step's buffer of %d", len(line), len(buf))
	}
	binary.LittleEndian.PutUint32(buf, uint32(len(line)))
	clear(buf[stepHeader+copy(buf[stepHeader:], line):])
	return nil
}

// StepStatus returns the status line of a step's answer.
func StepStatus(buf []byte) ([]byte, error) {
	if len(buf) < stepHeader {
		return nil, fmt.Errorf("a step's answer has %d bytes", len(buf))
	}
	n := binary.LittleEndian.Uint32(buf)
	if uint64(n) > uint64(len(buf)-stepHeader) {
		return nil, fmt.Errorf("a step's answer names a line of %d bytes in %d", n, len(buf))
	}
	return buf[stepHeader : stepHeader+int(n)], nil
}

package hints

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// The command as <asm-generic/ioctl.h>'s _IOWR(0xE6, 1, 260) spells it.
func TestStepCmdIsIOWR(t *testing.T) {
	if got := StepCmd(260); got != 0xC104E601 {
		t.Fatalf("StepCmd(260) = %#x, want 0xc104e601", got)
	}
	for _, size := range []int{0, StepMinBytes, 1000, StepMaxBytes} {
		if got, ok := StepSize(StepCmd(size)); !ok || got != size {
			t.Errorf("StepSize(StepCmd(%d)) = %d, %v", size, got, ok)
		}
	}
	for _, cmd := range []uint32{StepCmd(300) &^ 0xff, StepCmd(300) ^ 0xE6<<8 | 0x45<<8, StepCmd(300) &^ (1 << 30), 0x5401} {
		if _, ok := StepSize(cmd); ok {
			t.Errorf("StepSize(%#x) took a command that is not a step's", cmd)
		}
	}
}

func TestStepBufferRoundTrip(t *testing.T) {
	frames := AppendBinary(nil, Decode, 2, []uint64{1, 2, 3})
	frames = AppendBinary(frames, Decode, 5, []uint64{9})
	buf, ok := StepBuffer(nil, frames)
	if !ok || len(buf) != StepMinBytes {
		t.Fatalf("StepBuffer of %d bytes: %d bytes, %v; want %d", len(frames), len(buf), ok, StepMinBytes)
	}
	got, err := StepFrames(buf)
	if err != nil || !bytes.Equal(got, frames) {
		t.Fatalf("StepFrames: %x, %v; want %x", got, err, frames)
	}
	line := []byte(`{"frames":2}` + "\n")
	if err := PutStepStatus(buf, line); err != nil {
		t.Fatal(err)
	}
	if got, err := StepStatus(buf); err != nil || !bytes.Equal(got, line) {
		t.Fatalf("StepStatus: %q, %v", got, err)
	}
	if !bytes.Equal(buf[4+len(line):], make([]byte, len(buf)-4-len(line))) {
		t.Error("the answer after its line is not zeros")
	}

	big := AppendBinary(nil, Decode, 0, make([]uint64, (StepMaxBytes-4-12)/8))
	if buf, ok := StepBuffer(nil, big); !ok || len(buf) > StepMaxBytes {
		t.Errorf("the largest step (%d bytes of frames) does not fit: %d, %v", len(big), len(buf), ok)
	}
	if _, ok := StepBuffer(nil, append(big, make([]byte, StepMaxBytes-4-len(big)+1)...)); ok {
		t.Error("a step over StepMaxBytes fits")
	}
}

func TestStepFramesRefusesBadBuffers(t *testing.T) {
	buf := make([]byte, StepMinBytes)
	binary.LittleEndian.PutUint32(buf, StepMinBytes-3) // one more than the buffer holds
	if _, err := StepFrames(buf); err == nil {
		t.Error("a length past the buffer was taken")
	}
	if _, err := StepFrames(buf[:StepMinBytes-1]); err == nil {
		t.Error("a buffer smaller than StepMinBytes was taken")
	}
	if err := PutStepStatus(buf[:10], make([]byte, 7)); err == nil {
		t.Error("a line longer than the buffer was put")
	}
	buf[0] = 255
	if _, err := StepStatus(buf[:100]); err == nil {
		t.Error("an answer naming a line past its buffer was taken")
	}
}

// DecodeStepBuffer encodes what StepBuffer of the same frames holds, in a
// reused buffer too, and refuses a step too large before encoding it.
func TestDecodeStepBufferIsStepBufferOfItsFrames(t *testing.T) {
	layers, rows := []int{2, 5}, [][]uint64{{1, 2, 3}, {9}}
	var frames []byte
	for j, l := range layers {
		frames = AppendBinary(frames, Decode, l, rows[j])
	}
	want, _ := StepBuffer(nil, frames)
	dirty := bytes.Repeat([]byte{0xff}, 2*StepMinBytes)
	for _, dst := range [][]byte{nil, dirty} {
		got, ok := DecodeStepBuffer(dst, layers, rows)
		if !ok || !bytes.Equal(got, want) {
			t.Fatalf("DecodeStepBuffer: %x, %v; want %x", got, ok, want)
		}
	}
	most := (StepMaxBytes - 4 - 2*12) / 8
	if buf, ok := DecodeStepBuffer(nil, layers, [][]uint64{make([]uint64, most-1), {1}}); !ok || len(buf) > StepMaxBytes {
		t.Errorf("a two-layer step of %d rows does not fit: %d bytes, %v", most, len(buf), ok)
	}
	if buf, ok := DecodeStepBuffer(dirty[:1], layers, [][]uint64{make([]uint64, most), {1}}); ok || len(buf) != 1 {
		t.Errorf("a step of %d rows fits (%v), or was encoded (%d bytes)", most+1, ok, len(buf))
	}
}

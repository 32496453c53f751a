package tests

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	mfs "github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
)

// TestStepMakesRowsResident: a step (the frames of both layers and the
// barrier in one ioctl) returns once every table's rows are resident,
// with the barrier's counts, answered by the step itself (hint_steps), not
// by the writes and read a daemon without it would need.
func TestStepMakesRowsResident(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	rows := [][]uint64{
		randomRows(rand.New(rand.NewPCG(61, 62)), 100, spec.Rows),
		randomRows(rand.New(rand.NewPCG(63, 64)), 100, spec.Rows),
	}
	maps := []map[*backing.Table][]byte{layerMaps(t, d, m, m.Layers[0]), layerMaps(t, d, m, m.Layers[1])}
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	untilNoOutsideDrop(t, "stepped rows", func() error {
		before := d.Stats(t)
		st, err := h.Step(m.Layers, rows)
		if err != nil {
			t.Fatal(err)
		}
		after := d.Stats(t)
		if steps := after.HintSteps - before.HintSteps; steps != 1 {
			t.Fatalf("%d steps answered by the step ioctl, want 1 (the client fell back to writes?)", steps)
		}
		if st.Frames != 2 || st.Failed != 0 || st.Pages == 0 || st.Pages != st.Resident+st.Pinned {
			t.Fatalf("step status %+v: want 2 frames, every page resident or pinned", st)
		}
		for j, rs := range rows {
			if err := allResident(t, maps[j], rs); err != nil {
				return fmt.Errorf("layer %d: %w", m.Layers[j], err)
			}
			if err := gatherFromMemoryErr(t, d, maps[j], rs); err != nil {
				return fmt.Errorf("layer %d: %w", m.Layers[j], err)
			}
		}
		return nil
	})
}

// TestStepSaysWhyAFrameWasRejected: a step whose second frame names a row
// out of range answers with the reason (the call itself succeeds: the
// frames before the bad one were taken and waited for), and the mount
// goes on serving steps.
func TestStepSaysWhyAFrameWasRejected(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, m.Layers[0])
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	good := []uint64{1, 500, 1400}
	st, err := h.Step(m.Layers, [][]uint64{good, {2, spec.Rows}})
	if !errors.Is(err, client.ErrRejected) || !strings.Contains(err.Error(), "out of range") {
		t.Fatalf("a step with a row out of range: %v, want a rejection that says out of range", err)
	}
	if st.Frames != 1 || st.Failed != 0 {
		t.Fatalf("status %+v: want the good frame only, nothing failed", st)
	}
	untilNoOutsideDrop(t, "the good frame's rows", func() error {
		if _, err := h.Step(m.Layers[:1], [][]uint64{good}); err != nil {
			t.Fatal(err)
		}
		return allResident(t, maps, good)
	})
	if s := d.Stats(t); s.HintRejected != 1 {
		t.Errorf("hint_rejected %d, want 1", s.HintRejected)
	}
}

// stepIoctl makes the step's ioctl with cmd on f, buf its buffer.
func stepIoctl(f *os.File, cmd uint32, buf []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(cmd), uintptr(unsafe.Pointer(&buf[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// TestStepRefusesWhatIsNotAStep: the ioctl's own errors, each with the
// mount serving on: another command, a buffer too small for the status
// line, frames longer than the buffer, a step that would continue a frame
// a write left unfinished, and a step whose last frame is cut short. The
// frame-boundary errors say why at the next barrier.
func TestStepRefusesWhatIsNotAStep(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	f, err := os.OpenFile(filepath.Join(d.Mountpoint, mfs.ControlDir, mfs.ControlFile), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	frame := hints.AppendBinary(nil, hints.Decode, m.Layers[0], []uint64{3, 4, 5})
	good, ok := hints.StepBuffer(nil, frame)
	if !ok {
		t.Fatal("a 3-row step does not fit")
	}
	barrierSays := func(want string) {
		t.Helper()
		buf := make([]byte, 4096)
		n, err := f.Read(buf)
		if err != nil || !strings.Contains(string(buf[:n]), want) {
			t.Fatalf("barrier after a refused step: %q, %v; want it to say %q", buf[:n], err, want)
		}
	}

	other := hints.StepCmd(len(good))&^0xff | 2 // another nr
	if err := stepIoctl(f, other, good); err != unix.ENOTTY {
		t.Errorf("ioctl nr 2: %v, want ENOTTY", err)
	}
	small := make([]byte, hints.StepMinBytes-1)
	binary.LittleEndian.PutUint32(small, 0)
	if err := stepIoctl(f, hints.StepCmd(len(small)), small); err != unix.EINVAL {
		t.Errorf("a %d-byte step: %v, want EINVAL", len(small), err)
	}
	long := append([]byte(nil), good...)
	binary.LittleEndian.PutUint32(long, uint32(len(long)))
	if err := stepIoctl(f, hints.StepCmd(len(long)), long); err != unix.EINVAL {
		t.Errorf("a step naming more frames than its buffer: %v, want EINVAL", err)
	}
	// A write that leaves a frame unfinished, then a step.
	if _, err := f.Write(frame[:len(frame)-3]); err != nil {
		t.Fatal(err)
	}
	if err := stepIoctl(f, hints.StepCmd(len(good)), append([]byte(nil), good...)); err != unix.EINVAL {
		t.Errorf("a step inside an unfinished frame: %v, want EINVAL", err)
	}
	if _, err := f.Write(frame[len(frame)-3:]); err != nil { // the frame's end
		t.Fatal(err)
	}
	barrierSays("unfinished")
	cut, _ := hints.StepBuffer(nil, frame[:len(frame)-5])
	if err := stepIoctl(f, hints.StepCmd(len(cut)), cut); err != unix.EINVAL {
		t.Errorf("a step whose last frame is cut short: %v, want EINVAL", err)
	}
	barrierSays("cut short")

	// Still serving steps, on the same handle.
	buf := append([]byte(nil), good...)
	if err := stepIoctl(f, hints.StepCmd(len(buf)), buf); err != nil {
		t.Fatalf("a good step after the refused ones: %v", err)
	}
	line, err := hints.StepStatus(buf)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(line), `"frames":1`) || strings.Contains(string(line), `"error"`) {
		t.Fatalf("a good step's status %q: want its one frame, no error", line)
	}
}

// TestPythonClientStep: the Python client's step, from another process,
// answered by the step ioctl.
func TestPythonClientStep(t *testing.T) {
	python := requireNumpy(t)
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec))
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, m.Layers[1])
	rows := randomRows(rand.New(rand.NewPCG(65, 66)), 300, spec.Rows)
	var lit []string
	for _, r := range rows {
		lit = append(lit, fmt.Sprint(r))
	}
	script := fmt.Sprintf(`
import sys
sys.path.insert(0, "../hints/python")
import numpy as np
from engramfs_hints import Hinter
rows = np.array([%s], dtype=np.uint64)
with Hinter(%q) as h:
    st = h.step([(%d, rows[:100]), (%d, rows)])
assert st['frames'] == 2 and st['failed'] == 0 and st['pages'] == st['resident'] + st['pinned'], st
print("OK")
`, strings.Join(lit, ","), d.Mountpoint, m.Layers[0], m.Layers[1])
	untilNoOutsideDrop(t, "rows stepped from Python", func() error {
		before := d.Stats(t)
		out, err := exec.Command(python, "-c", script).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "OK") {
			t.Fatalf("python step: %v\n%s", err, out)
		}
		if steps := d.Stats(t).HintSteps - before.HintSteps; steps != 1 {
			t.Fatalf("%d steps answered by the step ioctl, want 1", steps)
		}
		return allResident(t, maps, rows)
	})
}

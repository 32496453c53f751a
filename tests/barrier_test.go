package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
)

// checkStatus fails t unless st accounts for every page it names, with none
// dropped or failed.
func checkStatus(t testing.TB, what string, st hints.Status) {
	t.Helper()
	if st.Failed != 0 || st.Dropped != 0 || st.Resident+st.Pinned != st.Pages || st.Pages == 0 {
		t.Fatalf("%s: status %+v; want every page resident or pinned", what, st)
	}
}

// waitFor polls cond until it holds, failing t after a generous bound.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startHint starts `engramfs hint MOUNT [args] LAYER` with rows on stdin: a
// separate process that sends one frame and blocks on its read barrier.
// exited is closed when it exits (its status is then in cmd.ProcessState).
func startHint(t testing.TB, d *Daemon, rows []uint64, args ...string) (cmd *exec.Cmd, exited chan struct{}, out *syncBuffer) {
	t.Helper()
	var lines []string
	for _, r := range rows {
		lines = append(lines, fmt.Sprint(r))
	}
	cmd = exec.Command(Binary(t), append([]string{"hint", d.Mountpoint}, args...)...)
	cmd.Stdin = strings.NewReader(strings.Join(lines, "\n") + "\n")
	out = &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited = make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	return cmd, exited, out
}

// A decode step and its read barrier in this process complete while another
// process is still blocked on the read barrier of a prefill chunk that slow
// backing needs many seconds for: the barrier blocks no other handle, and
// decode work overtakes the queued prefill.
func TestReadBarrierIsNotHeldUpByAnotherProcess(t *testing.T) {
	spec := geometries()["4096B"]
	spec.Rows = 10000
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=20ms", "--queue-depth", "2")
	rng := rand.New(rand.NewPCG(31, 32))
	prefill := randomRows(rng, 8000, spec.Rows)
	cmd, exited, out := startHint(t, d, prefill, "0")
	// The other process's frame is complete: it is in (or entering) its barrier.
	waitFor(t, "the prefill frame", func() bool { return d.Stats(t).HintFrames >= 1 })

	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	rows := randomRows(rng, 72, spec.Rows)
	var st hints.Status
	hintResidentAndServed(t, d, 0, rows, func() {
		if err := h.Decode(0, rows); err != nil {
			t.Fatal(err)
		}
		if st, err = h.Barrier(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-exited:
			t.Fatalf("the prefill barrier of the other process returned (%v) before the decode barrier did: the test proves nothing\n%s", cmd.ProcessState, out.String())
		default:
		}
		checkStatus(t, "decode beside a blocked prefill barrier", st)
	})
	t.Logf("decode status %+v; the other process is still waiting", st)
}

// A hint sent before any reader has opened the table files lands: the daemon
// looked its own files up at mount, so the store finds the inode.
func TestHintOnAFreshMountLands(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	rows := []uint64{1, 2, 3, 4, 5}
	hint := func() []byte {
		args := []string{"hint", d.Mountpoint, "--decode", "1"}
		for _, r := range rows {
			args = append(args, fmt.Sprint(r))
		}
		out, err := exec.Command(Binary(t), args...).CombinedOutput()
		if err != nil {
			t.Fatalf("engramfs hint: %v\n%s", err, out)
		}
		return out
	}
	drops := dropCount(t)
	out := hint()
	var st hints.Status
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatalf("hint printed %q, want the status line: %v", out, err)
	}
	checkStatus(t, "hint on a fresh mount", st)
	if s := d.Stats(t); s.PrefetchStoreErrors != 0 || s.PrefetchPagesStored == 0 {
		t.Fatalf("stores: %d errors, %d stored", s.PrefetchStoreErrors, s.PrefetchPagesStored)
	}
	// The residency check; the hint is sent again first where the page
	// cache was dropped from outside since it, and before each attempt
	// after a first one that found pages evicted from outside.
	tries := 0
	hintResidentAndServed(t, d, 1, rows, func() {
		if tries++; tries > 1 || dropCount(t) != drops {
			hint()
		}
	})
}

// Failed backing reads reach the barrier: the status counts them, the Go
// client returns ErrFailed, and fsync keeps its meaning (EIO).
func TestBarrierReportsFailedPages(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "eio=1")
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.Decode(0, []uint64{1, 5000, 9000}); err != nil {
		t.Fatal(err)
	}
	st, err := h.Barrier()
	if !errors.Is(err, client.ErrFailed) || st.Failed == 0 || st.Failed+st.Resident+st.Pinned != st.Pages {
		t.Fatalf("barrier over failing backing: %+v, %v; want failed pages and ErrFailed", st, err)
	}
	ctl := openControl(t, d)
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, 0, []uint64{7000})); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("fsync over failing backing: %v, want EIO", err)
	}
}

// A read barrier with nothing sent returns at once, with nothing (EOF).
func TestIdleReadBarrierReturnsAtOnce(t *testing.T) {
	d := Mount(t, Synth(t, geometries()["flash"]))
	f, err := os.OpenFile(filepath.Join(d.Mountpoint, ".engramfs", "control"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 512)
	if n, err := f.Read(buf); n != 0 {
		t.Fatalf("idle barrier read %q (%v), want nothing", buf[:n], err)
	}
	if _, err := f.Write([]byte("decode 0 1 2 3\n")); err != nil {
		t.Fatal(err)
	}
	n, err := f.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	var st hints.Status
	if err := json.Unmarshal(buf[:n], &st); err != nil || st.Frames != 1 {
		t.Fatalf("barrier line %q: %+v, %v", buf[:n], st, err)
	}
	checkStatus(t, "text frame", st)
}

// A handle whose decode backlog is full gets EAGAIN for its next decode
// frame (never for a prefill frame), at once and without a byte taken; the Go client sends it again, and it
// lands. Other handles are not refused.
func TestFullDecodeBacklogRefusesWithEAGAIN(t *testing.T) {
	spec := geometries()["4096B"]
	spec.Rows = 4000
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=1s", "--queue-depth", "1", "--decode-queue", "256")
	ctl := openControl(t, d)
	rows := make([]uint64, 600) // 600+ decode pages: over the 256-page minimum bound
	for i := range rows {
		rows[i] = uint64(i * 6)
	}
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, 0, rows)); err != nil {
		t.Fatal(err)
	}
	// A raw write: os.File would park on the netpoller after EAGAIN (the
	// kernel lets a FUSE file be polled), waiting for an edge that never
	// comes. The Go client does the same.
	_, err := syscall.Write(int(ctl.Fd()), hints.AppendBinary(nil, hints.Decode, 0, []uint64{1}))
	if !errors.Is(err, syscall.EAGAIN) {
		t.Fatalf("second decode frame on a full handle: %v, want EAGAIN", err)
	}
	if s := d.Stats(t); s.HintRefused == 0 || s.HintFrames != 1 {
		t.Fatalf("hint_refused %d, hint_frames %d; want a refusal and one frame", s.HintRefused, s.HintFrames)
	}
	// Prefill frames are never refused, on a full decode backlog either.
	prefill := hints.AppendBinary(nil, hints.Prefill, 0, []uint64{1, 2})
	if n, err := syscall.Write(int(ctl.Fd()), prefill); err != nil || n != len(prefill) {
		t.Fatalf("prefill frame on a full decode backlog: %d, %v; want it taken", n, err)
	}
	// Another handle is not refused.
	other := openControl(t, d)
	if _, err := syscall.Write(int(other.Fd()), hints.AppendBinary(nil, hints.Decode, 0, []uint64{3999})); err != nil {
		t.Fatalf("another handle: %v", err)
	}
	// The Go client sends a refused frame again until it is taken.
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.Decode(0, rows); err != nil {
		t.Fatal(err)
	}
	if err := h.Decode(0, []uint64{2}); err != nil {
		t.Fatalf("the client's retried frame: %v", err)
	}
}

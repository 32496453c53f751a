package tests

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/testenv"
)

// The warning startDaemon logs when auto does not get io_uring.
const noUringWarning = "io_uring unavailable"

// hintedStep sends a decode step of rows for every layer of m and waits
// for its barrier, failing t (instead of hanging it) when the barrier does
// not return within a minute; it returns the barrier's status.
func hintedStep(t *testing.T, d *Daemon, m *backing.Model, rows []uint64) hints.Status {
	t.Helper()
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	type answer struct {
		st  hints.Status
		err error
	}
	done := make(chan answer, 1)
	go func() {
		var total hints.Status
		for _, l := range m.Layers {
			if err := h.Decode(l, rows); err != nil {
				done <- answer{err: err}
				return
			}
			st, err := h.Barrier()
			if err != nil {
				done <- answer{err: err}
				return
			}
			total.Pages += st.Pages
			total.Resident += st.Resident
			total.Pinned += st.Pinned
			total.Failed += st.Failed
			total.Dropped += st.Dropped
		}
		done <- answer{st: total}
	}()
	select {
	case a := <-done:
		h.Close()
		if a.err != nil {
			t.Fatal(a.err)
		}
		return a.st
	case <-time.After(time.Minute):
		t.Fatalf("a hinted decode step's barrier did not return within a minute (read_engine %q)\n%s", d.Stats(t).ReadEngine, d.Summary())
		return hints.Status{}
	}
}

// engineModel is a small model, and rows to hint in it.
func engineModel(t *testing.T) (string, []uint64) {
	spec := backing.DefaultSynth()
	spec.Rows = 4096
	rows := randomRows(rand.New(rand.NewPCG(41, 42)), 64, spec.Rows)
	return Synth(t, spec), rows
}

// Where io_uring works, auto reads with it: read_engine says io_uring and
// nothing is said about a fallback.
func TestReadEngineAutoPicksIoUring(t *testing.T) {
	e, _, err := ioengine.New("io_uring", 1)
	if err != nil {
		t.Skipf("io_uring unavailable to this process too (%v): TestReadEngineFallsBackWhenIoUringRefused covers the fallback", err)
	}
	e.Close()
	dir, rows := engineModel(t)
	d := Mount(t, dir, "--cache-size", "0")
	if got := d.Stats(t).ReadEngine; got != "io_uring" {
		t.Errorf("read_engine %q on a machine where io_uring works, want io_uring\n%s", got, d.Summary())
	}
	checkStatus(t, "hinted step", hintedStep(t, d, Model(t, dir), rows))
	if strings.Contains(d.Log(), noUringWarning) {
		t.Errorf("the daemon says io_uring is unavailable where it works:\n%s", d.Summary())
	}
}

// With io_uring refused by a seccomp filter (io_uring_setup, or only
// io_uring_enter: a profile that allows the one and not the other), auto
// reads with the pread pool, says so in read_engine, and logs why; hinted
// reads complete and SIGTERM stops the daemon (the harness checks).
func TestReadEngineFallsBackWhenIoUringRefused(t *testing.T) {
	for _, refused := range []string{"io_uring_setup", "io_uring_enter"} {
		t.Run(refused, func(t *testing.T) {
			dir, rows := engineModel(t)
			d := MountWrapped(t, testenv.Refusing(t, refused), dir, "--cache-size", "0")
			if got := d.Stats(t).ReadEngine; got != "pread" {
				t.Errorf("read_engine %q with %s refused, want pread", got, refused)
			}
			var warning string
			for _, line := range strings.Split(d.Log(), "\n") {
				if strings.Contains(line, noUringWarning) {
					warning = line
				}
			}
			if !strings.Contains(warning, refused) || !strings.Contains(warning, "operation not permitted") {
				t.Errorf("with %s refused, the fallback's log line %q does not give the reason (the call and EPERM)\n%s", refused, warning, d.Summary())
			}
			m := Model(t, dir)
			checkStatus(t, "hinted step", hintedStep(t, d, m, rows))
			maps := map[*backing.Table][]byte{}
			for _, l := range m.Layers {
				for tb, b := range layerMaps(t, d, m, l) {
					maps[tb] = b
				}
			}
			gatherAndCheck(t, d, maps, rows)
		})
	}
}

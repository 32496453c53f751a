package tests

import (
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/hints/client"
)

// hintResidentAndServed runs hint (a client sending rows of layer and
// waiting for them), then checks that the rows of every table of layer are
// resident and that gathering them does not reach FUSE; again if the page
// cache was dropped from outside meanwhile (untilNoOutsideDrop).
func hintResidentAndServed(t *testing.T, d *Daemon, layer int, rows []uint64, hint func()) {
	t.Helper()
	maps := layerMaps(t, d, Model(t, d.ModelDir), layer)
	untilNoOutsideDrop(t, "hinted rows", func() error {
		hint()
		if err := allResident(t, maps, rows); err != nil {
			return err
		}
		return gatherFromMemoryErr(t, d, maps, rows)
	})
}

func TestHintCommand(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	// Keep the inodes known to the kernel, as a reader that maps the files
	// does; a store into an inode the kernel has not looked up is skipped.
	layerMaps(t, d, Model(t, d.ModelDir), 0)
	rows := randomRows(rand.New(rand.NewPCG(12, 13)), 40, spec.Rows)
	var args []string
	for _, r := range rows[:20] {
		args = append(args, fmt.Sprint(r))
	}
	var stdin []string
	for _, r := range rows[20:] {
		stdin = append(stdin, fmt.Sprint(r))
	}
	hintResidentAndServed(t, d, 0, rows, func() {
		out, err := exec.Command(Binary(t), append([]string{"hint", d.Mountpoint, "--decode", "0"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("engramfs hint: %v\n%s", err, out)
		}
		cmd := exec.Command(Binary(t), "hint", d.Mountpoint, "0")
		cmd.Stdin = strings.NewReader(strings.Join(stdin, "\n") + "\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("engramfs hint (rows on stdin): %v\n%s", err, out)
		}
	})

	out, err := exec.Command(Binary(t), "hint", d.Mountpoint, "0", fmt.Sprint(spec.Rows)).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "invalid argument") {
		t.Fatalf("hint of a row out of range: %v\n%s; want an invalid argument error", err, out)
	}
}

func TestGoClient(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec))
	layerMaps(t, d, Model(t, d.ModelDir), 1)
	rows := randomRows(rand.New(rand.NewPCG(14, 15)), 1000, spec.Rows)
	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	hintResidentAndServed(t, d, 1, rows, func() {
		if err := h.Prefill(1, rows[:500]); err != nil {
			t.Fatal(err)
		}
		if err := h.Decode(1, rows[500:]); err != nil {
			t.Fatal(err)
		}
		if err := h.Wait(); err != nil {
			t.Fatal(err)
		}
	})
}

func TestPythonClientFromAnotherProcess(t *testing.T) {
	python := requireNumpy(t)
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	layerMaps(t, d, Model(t, d.ModelDir), 1)
	rows := randomRows(rand.New(rand.NewPCG(16, 17)), 300, spec.Rows)
	var lit []string
	for _, r := range rows {
		lit = append(lit, fmt.Sprint(r))
	}
	script := fmt.Sprintf(`
import sys
sys.path.insert(0, "../hints/python")
import numpy as np
from engramfs_hints import Hinter
rows = np.array([%s], dtype=np.int64)
with Hinter(%q) as h:
    h.prefill(1, rows[:150])
    h.decode(1, rows[150:])
    h.wait()
print("OK")
`, strings.Join(lit, ","), d.Mountpoint)
	hintResidentAndServed(t, d, 1, rows, func() {
		out, err := exec.Command(python, "-c", script).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "OK") {
			t.Fatalf("python hinter: %v\n%s", err, out)
		}
	})
}

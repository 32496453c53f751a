package tests

import (
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/engramfs/engramfs/hints/client"
)

// A hint the mount rejects fails its write with EINVAL, which carries no
// text; every client says why, read from the barrier's status line. Failed
// pages say why too. The backing fails every read (eio=1) here, so a hint
// of good rows fails its pages.
func TestHintErrorsReachTheClient(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--inject-faults", "eio=1,seed=3")
	layerMaps(t, d, Model(t, d.ModelDir), 0)
	bad := spec.Rows + 5
	rejected := fmt.Sprintf("row %d out of range (layer 0 has %d rows)", bad, spec.Rows)
	const failed = "pages failed: "

	t.Run("go", func(t *testing.T) {
		h, err := client.Open(d.Mountpoint)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		err = h.Decode(0, []uint64{bad})
		if !errors.Is(err, client.ErrRejected) || !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), rejected) {
			t.Fatalf("Decode of row %d: %v; want EINVAL, rejected: %q", bad, err, rejected)
		}
		if err := h.Decode(0, []uint64{1, 2}); err != nil {
			t.Fatal(err)
		}
		st, err := h.Barrier()
		if !errors.Is(err, client.ErrFailed) || st.Failed == 0 || !strings.HasPrefix(st.Error, failed) ||
			!strings.Contains(err.Error(), "input/output error") {
			t.Fatalf("Barrier over failing pages: %+v, %v; want the failure's reason", st, err)
		}
	})

	t.Run("hint command", func(t *testing.T) {
		out, err := exec.Command(Binary(t), "hint", d.Mountpoint, "--decode", "0", fmt.Sprint(bad)).CombinedOutput()
		if code := exitCode(err); code != 1 || !strings.Contains(string(out), rejected) || !strings.Contains(string(out), "invalid argument") {
			t.Fatalf("engramfs hint of row %d: exit %d\n%s\nwant exit 1 and %q", bad, code, out, rejected)
		}
		t.Logf("%s", out)
		out, err = exec.Command(Binary(t), "hint", d.Mountpoint, "--decode", "0", "7").CombinedOutput()
		t.Logf("%s", out)
		if code := exitCode(err); code != 1 || !strings.Contains(string(out), `"error":"`+failed) {
			t.Fatalf("engramfs hint of failing pages: exit %d\n%s\nwant exit 1 and the status line's reason", code, out)
		}
	})

	t.Run("python", func(t *testing.T) {
		script := fmt.Sprintf(`
import sys
sys.path.insert(0, "../hints/python")
import engramfs_hints as eh
with eh.Hinter(%q) as h:
    try:
        h.decode(0, [%d])
    except eh.HintRejected as e:
        print("REJECTED", e.errno, e.reason)
    h.decode(0, [9])
    try:
        h.wait()
    except eh.HintFailed as e:
        print("FAILED", e.errno, e.status["error"])
`, d.Mountpoint, bad)
		out, err := exec.Command("/usr/bin/python3", "-B", "-c", script).CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.Contains(string(out), fmt.Sprintf("REJECTED %d hint frame: %s\n", syscall.EINVAL, rejected)) ||
			!strings.Contains(string(out), fmt.Sprintf("FAILED %d %s", syscall.EIO, failed)) {
			t.Fatalf("python client: %v\n%s", err, out)
		}
	})
}

// exitCode is a command's exit status (0 for no error, -1 for one that did
// not exit).
func exitCode(err error) int {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	}
	return -1
}

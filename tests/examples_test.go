package tests

import (
	"os/exec"
	"strings"
	"testing"
)

// The vLLM stand-in (examples/vllm/standin.py) replays the engine's calls on
// a synthetic model through the mount: prefill chunk N+1 hinted while chunk
// N computes, decode steps with a barrier, four rank processes forked from
// a parent that hinted first. Every decode barrier must find its pages
// resident, none dropped or failed.
func TestVLLMStandIn(t *testing.T) {
	python := requireNumpy(t)
	spec := geometries()["flash"]
	spec.Rows = 50000
	d := Mount(t, Synth(t, spec))
	out, err := exec.Command(python, "../examples/vllm/standin.py", d.Mountpoint,
		"--ranks", "4", "--chunks", "3", "--chunk-rows", "2000", "--compute-ms", "20", "--decode-steps", "10").CombinedOutput()
	if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "OK") {
		t.Fatalf("standin.py: %v\n%s", err, out)
	}
	if n := strings.Count(string(out), `"rank"`); n != 4 {
		t.Fatalf("%d rank reports, want 4:\n%s", n, out)
	}
	st := d.Stats(t)
	if st.HintFrames == 0 || st.PrefetchPagesFailed != 0 {
		t.Fatalf("stats after the stand-in: %d frames, %d failed pages", st.HintFrames, st.PrefetchPagesFailed)
	}
	t.Logf("%s", out)
}

package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The vLLM stand-in (examples/vllm/standin.py) makes the patched engine's
// calls through engramfs_prefetch.py on a synthetic model and a real mount:
// the tables retargeted from the shards to the mount's table files, prefill
// chunk N+1 hinted while chunk N computes, decode steps with a barrier, four
// rank processes forked from a parent that hinted first. Every decode
// barrier must find its pages resident, none dropped or failed, and every
// row gathered from the mount must equal the shard's.
func TestVLLMStandIn(t *testing.T) {
	python := requireNumpy(t)
	spec := geometries()["flash"]
	spec.Rows = 50000
	d := Mount(t, Synth(t, spec))
	out, err := exec.Command(python, "-B", "../examples/vllm/standin.py", d.ModelDir, d.Mountpoint,
		"--ranks", "4", "--chunks", "3", "--chunk-rows", "2000", "--compute-ms", "20", "--decode-steps", "10").CombinedOutput()
	if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "OK") {
		t.Fatalf("standin.py: %v\n%s", err, out)
	}
	ranks := 0
	for _, line := range strings.Split(string(out), "\n") {
		var r struct {
			ReadFrom     string `json:"read_from"`
			RowsChecked  int    `json:"rows_checked"`
			PrefillWaits int    `json:"prefill_waits"`
		}
		if !strings.HasPrefix(line, "{") {
			continue
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("rank report %q: %v", line, err)
		}
		if !strings.HasPrefix(r.ReadFrom, d.Mountpoint+"/layers/") || r.RowsChecked == 0 {
			t.Fatalf("rank report %q: want rows read from the mount's table files and checked", line)
		}
		if r.PrefillWaits != 3 {
			t.Fatalf("rank report %q: want a prefill wait a chunk (3)", line)
		}
		ranks++
	}
	if ranks != 4 {
		t.Fatalf("%d rank reports, want 4:\n%s", ranks, out)
	}
	st := d.Stats(t)
	if st.HintFrames == 0 || st.PrefetchPagesFailed != 0 || st.FuseReads == 0 {
		t.Fatalf("stats after the stand-in: %d frames, %d failed pages, %d FUSE reads", st.HintFrames, st.PrefetchPagesFailed, st.FuseReads)
	}
	if st.HintSteps < 4*10 { // a step a rank and decode step
		t.Fatalf("%d decode steps answered by the step ioctl, want the 40 the ranks took", st.HintSteps)
	}
	t.Logf("%s", out)
}

// examples/vllm/engram-engramfs.diff applies without fuzz to the seed's
// engine code after its stage 6-8 patch (engram.py.stage8-excerpt: the
// regions the seed's diff shows), and at exactly its line numbers once the
// elided regions are filled back to their lengths.
func TestVLLMPatchApplies(t *testing.T) {
	patchBin, err := exec.LookPath("patch")
	if err != nil {
		t.Skip("patch(1) not installed")
	}
	excerpt, err := os.ReadFile("../examples/vllm/engram.py.stage8-excerpt")
	if err != nil {
		t.Fatal(err)
	}
	diff, err := filepath.Abs("../examples/vllm/engram-engramfs.diff")
	if err != nil {
		t.Fatal(err)
	}
	apply := func(t *testing.T, engram []byte) string {
		t.Helper()
		dir := t.TempDir()
		file := filepath.Join(dir, "models", "deepseek_v4_1", "common", "engram.py")
		if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(file, engram, 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(patchBin, "-p1", "-F0", "-i", diff)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil || strings.Contains(string(out), "fuzz") {
			t.Fatalf("patch -p1 -F0: %v\n%s", err, out)
		}
		patched, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"_KAI_ENGRAMFS = _kai_engramfs.enabled()", "_kai_engramfs.retarget(self, model_dir, layer_id)",
			"table.engramfs.prefill(rows)", "_kai_engramfs.decode_and_wait(requests)", "_kai_engramfs.wait_prefill(requests)"} {
			if !strings.Contains(string(patched), want) {
				t.Fatalf("the patched engram.py lacks %q", want)
			}
		}
		return string(out)
	}
	t.Run("excerpt", func(t *testing.T) { apply(t, excerpt) })
	t.Run("line numbers", func(t *testing.T) {
		// Each "[engram.py lines A-B: ...]" marker stands for B-A+1 lines.
		marker := regexp.MustCompile(`^# \[engram\.py lines (\d+)-(\d*):`)
		var full []string
		for _, line := range strings.Split(strings.TrimSuffix(string(excerpt), "\n"), "\n") {
			m := marker.FindStringSubmatch(line)
			if m == nil {
				full = append(full, line)
				continue
			}
			a, _ := strconv.Atoi(m[1])
			b, err := strconv.Atoi(m[2])
			if err != nil {
				b = a // the tail: one line will do
			}
			if len(full) != a-1 {
				t.Fatalf("marker %q at line %d of the filled file", line, len(full)+1)
			}
			for i := a; i <= b; i++ {
				full = append(full, fmt.Sprintf("# engram.py line %d", i))
			}
		}
		if out := apply(t, []byte(strings.Join(full, "\n")+"\n")); strings.Contains(out, "offset") {
			t.Fatalf("the hunks' line numbers are not the engine's:\n%s", out)
		}
	})
}

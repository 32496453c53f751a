package tests

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/internal/stats"
)

func TestStatsCommand(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec), "--cache-size", "4MiB")
	maps := layerMaps(t, d, Model(t, d.ModelDir), 0)
	_ = layerMaps(t, d, Model(t, d.ModelDir), 1) // looked up: pushes land
	for tb, b := range maps {
		Touch(b, int(tb.DataPage()+3)*4096)
	}
	decodeStep(t, openControl(t, d), 1, []uint64{5, 6, 7})
	settle(t, d)

	out, err := exec.Command(Binary(t), "stats", d.Mountpoint).CombinedOutput()
	if err != nil {
		t.Fatalf("engramfs stats: %v\n%s", err, out)
	}
	for _, want := range []string{"fuse_reads", "backing_reads", "cache_used_bytes", "hint_rows", "prefetch_pages_stored",
		"prefetch_late", "warm_pages_done", "Hint accuracy by layer"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the stats table does not mention %s:\n%s", want, out)
		}
	}

	out, err = exec.Command(Binary(t), "stats", "--json", d.Mountpoint).Output()
	if err != nil {
		t.Fatalf("engramfs stats --json: %v", err)
	}
	var s stats.Snapshot
	if err := json.Unmarshal(out, &s); err != nil {
		t.Fatalf("--json is not the stats JSON: %v\n%s", err, out)
	}
	if s.FuseReads == 0 || s.HintRows != 3 || len(s.Layers) != 2 || s.Layers[1].Pushed == 0 || s.Pid != d.Pid() {
		t.Fatalf("--json: %+v", s)
	}

	// --watch with an interval and a count: successive tables with rates.
	out, err = exec.Command(Binary(t), "stats", d.Mountpoint, "--watch", "100ms", "--count", "3").CombinedOutput()
	if err != nil {
		t.Fatalf("engramfs stats --watch: %v\n%s", err, out)
	}
	if n := strings.Count(string(out), "faults/s"); n != 2 {
		t.Fatalf("3 refreshes printed %d rate lines, want 2 (the first has no interval yet):\n%s", n, out)
	}
	for _, want := range []string{"hit ratio", "MB/s", "pages/s", "late prefetches/s"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("--watch does not show %s", want)
		}
	}
	if out, err := exec.Command(Binary(t), "stats", t.TempDir()).CombinedOutput(); err == nil {
		t.Fatalf("stats of a plain directory succeeded:\n%s", out)
	}
}

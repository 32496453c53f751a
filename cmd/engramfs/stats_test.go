package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/internal/stats"
)

// TestStatsTableShowsEveryField: the table is made from stats.Fields, so
// every field and its label is on it (the object store's sections only for
// an object store source).
func TestStatsTableShowsEveryField(t *testing.T) {
	var c stats.Counters
	c.SetLayers([]int{0, 2})
	c.Layer(2).Refaulted.Add(7)
	c.CacheCapacityBytes.Store(4 << 20)
	c.CacheUsedBytes.Store(1 << 20)
	c.ReadEngine = "s3"
	var b bytes.Buffer
	renderStats(&b, "/mnt/e", c.Snapshot(), nil, 0)
	out := b.String()
	for _, f := range stats.Fields {
		name := f.Name
		if f.PerLayer() {
			name = f.JSONKey()
		}
		if !strings.Contains(out, name) || !strings.Contains(out, f.Label) {
			t.Errorf("the table lacks %s or its label %q", name, f.Label)
		}
	}
	for _, want := range []string{"1MiB (25.0%)", "4MiB", stats.GroupLayers} {
		if !strings.Contains(out, want) {
			t.Errorf("the table lacks %q", want)
		}
	}
	var layer2 string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "2" {
			layer2 = line
		}
	}
	if f := strings.Fields(layer2); len(f) != 4 || f[2] != "7" {
		t.Errorf("layer 2's row is %q, want refaulted 7 in the third column:\n%s", layer2, out)
	}

	c.ReadEngine = "io_uring"
	b.Reset()
	renderStats(&b, "/mnt/e", c.Snapshot(), nil, 0)
	if strings.Contains(b.String(), "s3_gets") || !regexp.MustCompile(`read_engine +io_uring`).MatchString(b.String()) {
		t.Errorf("a shard mount's table shows the object store, or not its read engine:\n%s", b.String())
	}
	c.S3Retries.Add(1) // shown when not zero, whatever the engine says
	b.Reset()
	renderStats(&b, "/mnt/e", c.Snapshot(), nil, 0)
	if !strings.Contains(b.String(), "s3_retries") {
		t.Errorf("a non-zero object store counter is hidden:\n%s", b.String())
	}
}

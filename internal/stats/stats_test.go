package stats

import (
	"encoding/json"
	"testing"
)

func TestJSONShape(t *testing.T) {
	var c Counters
	c.SetLayers([]int{0, 3})
	c.FuseReads.Add(2)
	c.Layer(3).Pushed.Add(5)
	c.Layer(3).Refaulted.Add(1)
	c.WarmPagesTotal.Store(9)
	if c.Layer(1) != nil {
		t.Fatal("Layer(1) of a model without layer 1 is not nil")
	}
	var got map[string]any
	if err := json.Unmarshal(c.JSON(), &got); err != nil {
		t.Fatal(err)
	}
	// The existing names are a contract; the new ones are additions.
	for _, k := range []string{"fuse_reads", "backing_reads", "cache_used_bytes", "hint_rows", "prefetch_late", "goroutines",
		"warm_pages_total", "warm_pages_done", "layers", "pid"} {
		if _, ok := got[k]; !ok {
			t.Errorf("stats JSON lacks %q", k)
		}
	}
	layers := got["layers"].(map[string]any)
	l3 := layers["3"].(map[string]any)
	if l3["pushed"] != 5.0 || l3["refaulted"] != 1.0 || l3["dropped"] != 0.0 || len(layers) != 2 {
		t.Fatalf("layers: %v", layers)
	}
	var s Snapshot
	if err := json.Unmarshal(c.JSON(), &s); err != nil || s.Layers[3].Pushed != 5 || s.WarmPagesTotal != 9 {
		t.Fatalf("round trip: %+v, %v", s, err)
	}
}

package metrics

import (
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

func TestEveryStatHasAMetric(t *testing.T) {
	typ := reflect.TypeFor[stats.Snapshot]()
	for i := range typ.NumField() {
		name, _, _ := strings.Cut(typ.Field(i).Tag.Get("json"), ",")
		_, exported := statMetrics[name]
		_, skipped := notExported[name]
		if exported == skipped {
			t.Errorf("stats field %q: want exactly one of a metric in statMetrics or a reason in notExported", name)
		}
	}
	for _, m := range statMetrics {
		if (m.kind == counter) != strings.HasSuffix(m.name, "_total") {
			t.Errorf("%s: counters, and only counters, end in _total", m.name)
		}
	}
}

func testModel(t testing.TB) *backing.Model {
	t.Helper()
	dir := t.TempDir()
	spec := backing.DefaultSynth()
	spec.Rows = 64
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func gather(t *testing.T, st *stats.Counters, tm *Timings) map[string]*dto.MetricFamily {
	t.Helper()
	reg, err := Registry(st, tm)
	if err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func TestCollectorReadsTheCountersAtScrapeTime(t *testing.T) {
	m := testModel(t)
	st := &stats.Counters{}
	st.SetLayers(m.Layers)
	tm := NewTimings(m)
	st.FuseReads.Add(7)
	st.CachePinned.Store(true)
	st.Layer(1).Refaulted.Add(3)
	mfs := gather(t, st, tm)
	if v := mfs["engramfs_fuse_reads_total"].GetMetric()[0].GetCounter().GetValue(); v != 7 {
		t.Fatalf("fuse_reads_total %v, want 7", v)
	}
	if v := mfs["engramfs_cache_pinned"].GetMetric()[0].GetGauge().GetValue(); v != 1 {
		t.Fatalf("cache_pinned %v, want 1", v)
	}
	found := false
	for _, mt := range mfs["engramfs_hint_pages_refaulted_total"].GetMetric() {
		if mt.GetLabel()[0].GetValue() == "1" {
			found = mt.GetCounter().GetValue() == 3
		}
	}
	if !found {
		t.Fatalf("hint_pages_refaulted_total{layer=\"1\"} is not 3: %v", mfs["engramfs_hint_pages_refaulted_total"])
	}
	st.FuseReads.Add(1) // no copy: the next scrape sees it
	if v := gather(t, st, NewTimings(m))["engramfs_fuse_reads_total"].GetMetric()[0].GetCounter().GetValue(); v != 8 {
		t.Fatalf("after one more read: %v, want 8", v)
	}
}

func TestTimingsLabelByLayer(t *testing.T) {
	m := testModel(t)
	st := &stats.Counters{}
	tm := NewTimings(m)
	for _, tb := range m.Tables {
		tm.FaultServed(tb.ID, 50*time.Microsecond)
	}
	tm.BackingRead(0, time.Millisecond)
	tm.BarrierWaited(1, time.Millisecond)
	tm.BarrierWaited(stats.BarrierSeveralLayers, time.Millisecond)
	tm.BarrierWaited(stats.BarrierNoLayer, time.Millisecond)
	tm.BarrierWaited(99, time.Millisecond) // not a layer of the model: "several", no new label
	mfs := gather(t, st, tm)
	counts := func(name string) map[string]uint64 {
		out := map[string]uint64{}
		for _, mt := range mfs[name].GetMetric() {
			l := ""
			if len(mt.GetLabel()) > 0 {
				l = mt.GetLabel()[0].GetValue()
			}
			out[l] = mt.GetHistogram().GetSampleCount()
		}
		return out
	}
	if got := counts("engramfs_fault_seconds"); !reflect.DeepEqual(got, map[string]uint64{"0": 2, "1": 2}) {
		t.Fatalf("fault_seconds counts %v", got)
	}
	if got := counts("engramfs_backing_read_seconds"); got[""] != 1 {
		t.Fatalf("backing_read_seconds counts %v", got)
	}
	if got := counts("engramfs_barrier_wait_seconds"); !reflect.DeepEqual(got, map[string]uint64{"0": 0, "1": 1, "several": 2, "none": 1}) {
		t.Fatalf("barrier_wait_seconds counts %v", got)
	}
}

func TestServe(t *testing.T) {
	m := testModel(t)
	st := &stats.Counters{}
	st.HintRows.Add(42)
	tm := NewTimings(m)
	reg, err := Registry(st, tm)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Serve("127.0.0.1:0", reg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	resp, err := http.Get("http://" + s.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "engramfs_hint_rows_total 42") || !strings.Contains(string(b), "go_goroutines") {
		t.Fatalf("/metrics lacks engramfs_hint_rows_total 42 or the Go collector:\n%.2000s", b)
	}
}

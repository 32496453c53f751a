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

// TestEveryFieldIsExported: every Counter and Gauge of stats.Fields is on
// /metrics, with its type and its Meaning as help.
func TestEveryFieldIsExported(t *testing.T) {
	st := &stats.Counters{}
	st.SetLayers([]int{0})
	mfs := gather(t, st, NewTimings(testModel(t)))
	for _, f := range stats.Fields {
		if f.Metric == "" {
			continue
		}
		mf, ok := mfs[fqName(f.Metric)]
		want := dto.MetricType_COUNTER
		if f.Kind == stats.Gauge {
			want = dto.MetricType_GAUGE
		}
		if !ok || mf.GetType() != want || mf.GetHelp() != f.Meaning {
			t.Errorf("%s: want %s on /metrics as a %v with its Meaning as help, got %v", f.Name, fqName(f.Metric), want, mf)
		}
	}
}

// TestMetricNamesAreStable: dashboards query these names; a field may add
// a metric, never rename one.
func TestMetricNamesAreStable(t *testing.T) {
	st := &stats.Counters{}
	st.SetLayers([]int{0})
	mfs := gather(t, st, NewTimings(testModel(t)))
	for _, name := range []string{
		"fuse_reads_total", "fuse_read_bytes_total",
		"backing_reads_total", "backing_bytes_total", "backing_errors_total", "backing_fail_fast_total",
		"s3_gets_total", "s3_get_bytes_total", "s3_retries_total", "s3_hedges_total", "s3_etag_failures_total",
		"mirror_hits_total", "mirror_bytes_read_total", "mirror_bytes_written_total", "mirror_evictions_total",
		"cache_capacity_bytes", "cache_used_bytes", "cache_hits_total", "cache_misses_total", "cache_evictions_total",
		"cache_pinned", "cache_pin_dropped_total",
		"hint_frames_total", "hint_rows_total", "hint_rejected_total", "hint_refused_total",
		"prefetch_pages_queued_total", "prefetch_pages_stored_total", "prefetch_pages_dropped_total",
		"prefetch_store_errors_total", "prefetch_late_total", "prefetch_pages_failed_total",
		"warm_pages", "warm_pages_done", "goroutines",
		"hint_pages_pushed_total", "hint_pages_refaulted_total", "hint_pages_dropped_total",
		"fault_seconds", "backing_read_seconds", "barrier_wait_seconds",
	} {
		if _, ok := mfs[fqName(name)]; !ok {
			t.Errorf("/metrics lost %s", fqName(name))
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

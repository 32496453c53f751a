package tests

import (
	"net/http"
	"regexp"
	"strconv"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/engramfs/engramfs/hints"
)

var metricsAddrRE = regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/metrics`)

func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

func value(t *testing.T, mfs map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	mf, ok := mfs[name]
	if !ok {
		t.Fatalf("/metrics has no %s", name)
	}
next:
	for _, m := range mf.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.GetCounter().GetValue()
		case m.Gauge != nil:
			return m.GetGauge().GetValue()
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	t.Fatalf("/metrics has no %s%v", name, labels)
	return 0
}

func TestMetricsMatchStats(t *testing.T) {
	spec := geometries()["flash"]
	d := Mount(t, Synth(t, spec), "--cache-size", "4MiB", "--metrics-addr", "127.0.0.1:0")
	mm := metricsAddrRE.FindStringSubmatch(d.Log())
	if mm == nil {
		t.Fatalf("the daemon did not log its metrics address:\n%s", d.Log())
	}
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	for tb, b := range maps { // demand faults on layer 0
		for p := tb.DataPage(); p < tb.DataPage()+20 && p < tb.Pages(); p++ {
			Touch(b, int(p)*4096)
		}
	}
	_ = layerMaps(t, d, m, 1) // looked up, so pushes land
	ctl := openControl(t, d)
	decodeStep(t, ctl, 1, []uint64{100, 5000, 9000})
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Prefill, 1, []uint64{12000, 15000})); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); err != nil {
		t.Fatal(err)
	}
	settle(t, d)

	mfs := scrape(t, mm[1])
	st := d.Stats(t)
	counters := map[string]uint64{
		"engramfs_fuse_reads_total":             st.FuseReads,
		"engramfs_fuse_read_bytes_total":        st.FuseReadBytes,
		"engramfs_backing_reads_total":          st.BackingReads,
		"engramfs_backing_bytes_total":          st.BackingBytes,
		"engramfs_backing_errors_total":         st.BackingErrors,
		"engramfs_cache_hits_total":             st.CacheHits,
		"engramfs_cache_misses_total":           st.CacheMisses,
		"engramfs_cache_evictions_total":        st.CacheEvictions,
		"engramfs_hint_frames_total":            st.HintFrames,
		"engramfs_hint_rows_total":              st.HintRows,
		"engramfs_hint_rejected_total":          st.HintRejected,
		"engramfs_prefetch_pages_queued_total":  st.PrefetchPagesQueued,
		"engramfs_prefetch_pages_stored_total":  st.PrefetchPagesStored,
		"engramfs_prefetch_pages_dropped_total": st.PrefetchPagesDropped,
		"engramfs_prefetch_store_errors_total":  st.PrefetchStoreErrors,
		"engramfs_prefetch_late_total":          st.PrefetchLate,
		"engramfs_warm_pages":                   st.WarmPagesTotal,
		"engramfs_warm_pages_done":              st.WarmPagesDone,
		"engramfs_cache_capacity_bytes":         uint64(st.CacheCapacityBytes),
		"engramfs_cache_used_bytes":             uint64(st.CacheUsedBytes),
	}
	for name, want := range counters {
		if got := value(t, mfs, name); got != float64(want) {
			t.Errorf("%s = %v, .engramfs/stats says %d", name, got, want)
		}
	}
	if st.FuseReads == 0 || st.HintRows != 5 {
		t.Fatalf("the workload did not happen: %+v", st)
	}
	for layer, ls := range st.Layers {
		l := strconv.Itoa(layer)
		for name, want := range map[string]uint64{
			"engramfs_hint_pages_pushed_total": ls.Pushed, "engramfs_hint_pages_refaulted_total": ls.Refaulted,
			"engramfs_hint_pages_dropped_total": ls.Dropped,
		} {
			if got := value(t, mfs, name, "layer", l); got != float64(want) {
				t.Errorf("%s{layer=%s} = %v, stats say %d", name, l, got, want)
			}
		}
	}
	if st.Layers[1].Pushed == 0 {
		t.Errorf("layer 1 pushed nothing: %+v", st.Layers)
	}
	// Histograms: faults on layer 0's files, backing reads, barriers of layer 1.
	if n := value(t, mfs, "engramfs_fault_seconds", "layer", "0"); n < 20 {
		t.Errorf("fault_seconds{layer=0} counted %v faults, want at least 20", n)
	}
	if n := value(t, mfs, "engramfs_backing_read_seconds"); n != float64(st.BackingReads) {
		t.Errorf("backing_read_seconds counted %v reads, stats say %d", n, st.BackingReads)
	}
	if n := value(t, mfs, "engramfs_barrier_wait_seconds", "layer", "1"); n != 2 {
		t.Errorf("barrier_wait_seconds{layer=1} counted %v fsyncs, want 2", n)
	}
	if value(t, mfs, "go_goroutines") == 0 {
		t.Errorf("no Go runtime metrics")
	}
}

// TestHintAccuracyByLayer checks the three per-layer numbers against what
// the test did: pages pushed, pages read through FUSE after their push
// (drop_caches evicts them: prefill pages are not pinned), pages dropped.
func TestHintAccuracyByLayer(t *testing.T) {
	spec := geometries()["4096B"] // one weight page per row; 32 scale rows a page
	d := Mount(t, Synth(t, spec), "--cache-size", "0")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	rows := []uint64{10, 20, 30, 40, 500}
	ctl := openControl(t, d)
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Prefill, 0, rows)); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); err != nil {
		t.Fatal(err)
	}
	pages := 0
	for tb := range maps {
		seen := map[uint64]bool{}
		for _, p := range pagesOf(tb, rows) {
			seen[p] = true
		}
		pages += len(seen)
	}
	st := d.Stats(t)
	if l := st.Layers[0]; l.Pushed != uint64(pages) || l.Refaulted != 0 || l.Dropped != 0 {
		t.Fatalf("after a prefill hint of %d pages: layer 0 %+v, want all pushed, none refaulted", pages, l)
	}
	// Evicted before use: every pushed page is faulted in again, once.
	dropCaches(t)
	gatherAndCheck(t, d, maps, rows)
	gatherAndCheck(t, d, maps, rows)
	st = d.Stats(t)
	if l := st.Layers[0]; l.Refaulted != uint64(pages) {
		t.Fatalf("after drop_caches and two gathers: layer 0 %+v, want %d refaulted (once each)", l, pages)
	}
	if l := st.Layers[1]; l.Pushed+l.Refaulted+l.Dropped != 0 {
		t.Fatalf("layer 1 was never hinted: %+v", l)
	}
}

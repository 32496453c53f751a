// Package metrics serves the engramfs counters and service-time histograms
// to Prometheus on --metrics-addr. The counters are not copied: a Collector
// reads the atomics of stats.Counters at scrape time, so `.engramfs/stats`
// and /metrics are one source of truth. Every metric name is in names.go.
package metrics

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// statsCollector exports stats.Counters at scrape time.
type statsCollector struct {
	st     *stats.Counters
	fields []statField // fields of stats.Snapshot that have a metric
	layer  struct{ pushed, refaulted, dropped *prometheus.Desc }
}

type statField struct {
	index int // in stats.Snapshot
	desc  *prometheus.Desc
	kind  kind
}

func fqName(name string) string { return prometheus.BuildFQName(namespace, "", name) }

func newStatsCollector(st *stats.Counters) (*statsCollector, error) {
	c := &statsCollector{st: st}
	typ := reflect.TypeFor[stats.Snapshot]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		json, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if _, skip := notExported[json]; skip {
			continue
		}
		m, ok := statMetrics[json]
		if !ok {
			return nil, fmt.Errorf("stats field %s (%q) has no metric in names.go", f.Name, json)
		}
		c.fields = append(c.fields, statField{index: i, kind: m.kind, desc: prometheus.NewDesc(fqName(m.name), m.help, nil, nil)})
	}
	desc := func(m statMetric) *prometheus.Desc {
		return prometheus.NewDesc(fqName(m.name), m.help, []string{labelLayer}, nil)
	}
	c.layer.pushed, c.layer.refaulted, c.layer.dropped = desc(layerMetrics.pushed), desc(layerMetrics.refaulted), desc(layerMetrics.dropped)
	return c, nil
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, f := range c.fields {
		ch <- f.desc
	}
	ch <- c.layer.pushed
	ch <- c.layer.refaulted
	ch <- c.layer.dropped
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	snap := c.st.Snapshot()
	v := reflect.ValueOf(snap)
	for _, f := range c.fields {
		val := v.Field(f.index)
		var x float64
		switch val.Kind() {
		case reflect.Uint64, reflect.Uint32, reflect.Uint:
			x = float64(val.Uint())
		case reflect.Int64, reflect.Int32, reflect.Int:
			x = float64(val.Int())
		case reflect.Bool:
			if val.Bool() {
				x = 1
			}
		}
		typ := prometheus.CounterValue
		if f.kind == gauge {
			typ = prometheus.GaugeValue
		}
		ch <- prometheus.MustNewConstMetric(f.desc, typ, x)
	}
	for layer, ls := range snap.Layers {
		l := strconv.Itoa(layer)
		ch <- prometheus.MustNewConstMetric(c.layer.pushed, prometheus.CounterValue, float64(ls.Pushed), l)
		ch <- prometheus.MustNewConstMetric(c.layer.refaulted, prometheus.CounterValue, float64(ls.Refaulted), l)
		ch <- prometheus.MustNewConstMetric(c.layer.dropped, prometheus.CounterValue, float64(ls.Dropped), l)
	}
}

// Timings implements stats.Timings with histograms. Every observer is
// resolved when it is built, so an observation is an index and an atomic
// add: no label hashing on the fault path.
type Timings struct {
	fault          []prometheus.Observer // by table ID
	backing        prometheus.Observer
	barrier        map[int]prometheus.Observer // by layer; read-only
	barrierSeveral prometheus.Observer
	barrierNone    prometheus.Observer

	collectors []prometheus.Collector
}

var _ stats.Timings = (*Timings)(nil)

// Buckets: a FUSE round trip is ~25-50 µs, a 4 KiB NVMe read ~60 µs, an NFS
// read a millisecond or more; a barrier waits for up to a prefill chunk
// (tens of thousands of rows: up to seconds).
var (
	faultBuckets   = prometheus.ExponentialBuckets(4e-6, 2, 19)  // 4 µs .. 1 s
	backingBuckets = prometheus.ExponentialBuckets(16e-6, 2, 17) // 16 µs .. 1 s
	barrierBuckets = prometheus.ExponentialBuckets(16e-6, 2, 21) // 16 µs .. 16 s
)

// NewTimings builds the histograms for model m.
func NewTimings(m *backing.Model) *Timings {
	fault := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: fqName(faultSecondsName), Help: faultSecondsHelp, Buckets: faultBuckets,
	}, []string{labelLayer})
	backingH := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: fqName(backingSecondsName), Help: backingSecondsHelp, Buckets: backingBuckets,
	})
	barrier := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: fqName(barrierSecondsName), Help: barrierSecondsHelp, Buckets: barrierBuckets,
	}, []string{labelLayer})
	t := &Timings{
		fault:          make([]prometheus.Observer, len(m.Tables)),
		backing:        backingH,
		barrier:        map[int]prometheus.Observer{},
		barrierSeveral: barrier.WithLabelValues(barrierSeveralLayers),
		barrierNone:    barrier.WithLabelValues(barrierNoLayer),
		collectors:     []prometheus.Collector{fault, backingH, barrier},
	}
	for i, tb := range m.Tables {
		t.fault[i] = fault.WithLabelValues(strconv.Itoa(tb.Layer))
	}
	for _, l := range m.Layers {
		t.barrier[l] = barrier.WithLabelValues(strconv.Itoa(l))
	}
	return t
}

// FaultServed implements stats.Timings.
func (t *Timings) FaultServed(table uint32, d time.Duration) {
	if int(table) < len(t.fault) {
		t.fault[table].Observe(d.Seconds())
	}
}

// BackingRead implements stats.Timings.
func (t *Timings) BackingRead(table uint32, d time.Duration) { t.backing.Observe(d.Seconds()) }

// BarrierWaited implements stats.Timings.
func (t *Timings) BarrierWaited(layer int, d time.Duration) {
	o, ok := t.barrier[layer]
	switch {
	case ok:
	case layer == stats.BarrierNoLayer:
		o = t.barrierNone
	default:
		o = t.barrierSeveral
	}
	o.Observe(d.Seconds())
}

// Registry gathers everything /metrics serves: the counters of st, the
// histograms of t, and the Go runtime and process collectors.
func Registry(st *stats.Counters, t *Timings) (*prometheus.Registry, error) {
	sc, err := newStatsCollector(st)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	cs := append([]prometheus.Collector{sc,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}, t.collectors...)
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return reg, nil
}

// Server serves /metrics.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

// Serve listens on addr (host:port; port 0 picks one, see Addr) and serves
// reg on /metrics until Close.
func Serve(addr string, reg *prometheus.Registry, log *zap.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	s := &Server{
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
			ErrorLog: zap.NewStdLog(log.Named("metrics"))},
		ln:   ln,
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", zap.Error(err))
		}
	}()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server.
func (s *Server) Close() error {
	err := s.srv.Close()
	<-s.done
	return err
}

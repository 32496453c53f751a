// Package metrics serves the engramfs counters and service-time histograms
// to Prometheus on --metrics-addr. The counters are not copied: a Collector
// reads the atomics of stats.Counters at scrape time, so `.engramfs/stats`
// and /metrics are one source of truth. The counters and gauges are named
// and described by stats.Fields; the histograms' names are in names.go.
package metrics

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// statsCollector exports stats.Counters at scrape time: every Counter and
// Gauge of stats.Fields, under its Metric name with its Meaning as help.
type statsCollector struct {
	st     *stats.Counters
	fields []statField // of the Snapshot
	layer  []statField // of each LayerSnapshot, labelled by layer
}

type statField struct {
	f    stats.Field
	desc *prometheus.Desc
	typ  prometheus.ValueType
}

func fqName(name string) string { return prometheus.BuildFQName(namespace, "", name) }

func newStatsCollector(st *stats.Counters) *statsCollector {
	c := &statsCollector{st: st}
	for _, f := range stats.Fields {
		if f.Metric == "" {
			continue // Info: a setting or identity, not a measurement
		}
		typ := prometheus.CounterValue
		if f.Kind == stats.Gauge {
			typ = prometheus.GaugeValue
		}
		if f.PerLayer() {
			c.layer = append(c.layer, statField{f, prometheus.NewDesc(fqName(f.Metric), f.Meaning, []string{labelLayer}, nil), typ})
		} else {
			c.fields = append(c.fields, statField{f, prometheus.NewDesc(fqName(f.Metric), f.Meaning, nil, nil), typ})
		}
	}
	return c
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, f := range c.fields {
		ch <- f.desc
	}
	for _, f := range c.layer {
		ch <- f.desc
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	snap := c.st.Snapshot()
	for _, f := range c.fields {
		ch <- prometheus.MustNewConstMetric(f.desc, f.typ, number(snap.Value(f.f, 0)))
	}
	for layer := range snap.Layers {
		l := strconv.Itoa(layer)
		for _, f := range c.layer {
			ch <- prometheus.MustNewConstMetric(f.desc, f.typ, number(snap.Value(f.f, layer)), l)
		}
	}
}

// number is a stats value as a sample: booleans are 0 and 1.
func number(v any) float64 {
	switch x := v.(type) {
	case uint64:
		return float64(x)
	case int64:
		return float64(x)
	case int:
		return float64(x)
	case bool:
		if x {
			return 1
		}
	}
	return 0
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
	reg := prometheus.NewRegistry()
	cs := append([]prometheus.Collector{newStatsCollector(st),
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

package s3serve

import (
	"context"
	"encoding/json"
	"errors"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	neturl "net/url"
	"sync"
	"sync/atomic"
	"time"
)

// Latency is the first-byte latency a LatencyProxy injects: every
// response's first byte leaves the proxy no sooner than FirstByte after its
// request arrived, or SlowFirstByte for a fraction SlowFraction of the
// responses (a store's tail: a busy disk, a slow partition), drawn from a
// generator seeded with Seed.
type Latency struct {
	FirstByte     time.Duration
	SlowFirstByte time.Duration
	SlowFraction  float64
	Seed          uint64
}

// LatencyProxy forwards every request to an S3 endpoint unchanged (Host
// kept: signatures stay valid) and holds each response's headers back until
// its injected first-byte latency has passed since the request arrived. An
// upstream slower than that is not delayed further: the latency is the
// store's, not added to it.
type LatencyProxy struct {
	URL string // http://127.0.0.1:PORT

	lat Latency
	srv *http.Server
	ln  net.Listener

	mu  sync.Mutex
	rng *rand.Rand // GUARDED_BY(mu)

	responses, slow atomic.Uint64
}

// NewLatencyProxy starts a proxy to endpoint on a free loopback port.
func NewLatencyProxy(endpoint string, lat Latency) (*LatencyProxy, error) {
	target, err := neturl.Parse(endpoint)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	// The daemon keeps up to 64 GETs in flight: keep as many connections
	// to the store open, not the default 2 (a new connection per GET).
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = 256, 256
	rp.Transport = tr
	// A GET the daemon gave up on (the losing half of a hedge, a stopped
	// mount) is a canceled request, not a proxy failure worth a log line;
	// anything else is still logged.
	rp.ErrorHandler = func(w http.ResponseWriter, r *http.Request, err error) {
		if !errors.Is(err, context.Canceled) {
			log.Printf("latency proxy: %s %s: %v", r.Method, r.URL.Path, err)
		}
		w.WriteHeader(http.StatusBadGateway)
	}
	p := &LatencyProxy{URL: "http://" + ln.Addr().String(), lat: lat, ln: ln, rng: rand.New(rand.NewPCG(lat.Seed, 0x1a7e))}
	p.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == statsPath {
			all, slow := p.Responses()
			_ = json.NewEncoder(w).Encode(proxyCounts{Responses: all, Slow: slow})
			return
		}
		rp.ServeHTTP(&delayWriter{ResponseWriter: w, until: time.Now().Add(p.delay())}, r)
	})}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

// delay draws one response's first-byte latency.
func (p *LatencyProxy) delay() time.Duration {
	p.responses.Add(1)
	p.mu.Lock()
	x := p.rng.Float64()
	p.mu.Unlock()
	if x < p.lat.SlowFraction {
		p.slow.Add(1)
		return p.lat.SlowFirstByte
	}
	return p.lat.FirstByte
}

// Responses counts the responses delayed so far, and of them the slow ones.
func (p *LatencyProxy) Responses() (all, slow uint64) { return p.responses.Load(), p.slow.Load() }

// Close stops the proxy and the requests it is serving.
func (p *LatencyProxy) Close() error {
	err := p.srv.Close()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// delayWriter sleeps until its deadline before the response's headers (and
// so its first byte) are written.
type delayWriter struct {
	http.ResponseWriter
	until time.Time
	woke  bool
}

func (d *delayWriter) wait() {
	if !d.woke {
		d.woke = true
		time.Sleep(time.Until(d.until))
	}
}

func (d *delayWriter) WriteHeader(code int) {
	d.wait()
	d.ResponseWriter.WriteHeader(code)
}

func (d *delayWriter) Write(b []byte) (int, error) {
	d.wait()
	return d.ResponseWriter.Write(b)
}

func (d *delayWriter) Flush() {
	d.wait()
	if f, ok := d.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the connection.
func (d *delayWriter) Unwrap() http.ResponseWriter { return d.ResponseWriter }

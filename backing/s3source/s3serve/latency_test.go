package s3serve

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"testing"
	"time"
)

// The proxy forwards requests and responses byte-exact (method, path,
// Host, headers and body up; status, headers and body down), and no first
// byte reaches the client before the injected latency: the fast one, or
// the slow one for every response at SlowFraction 1. Only lower bounds on
// time: the machine may be busy.
func TestLatencyProxy(t *testing.T) {
	body := make([]byte, 3<<20+17)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range body {
		body[i] = byte(rng.Uint32())
	}
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, err := io.ReadAll(r.Body)
		if err != nil {
			t.Error(err)
		}
		w.Header().Set("X-Seen", r.Method+" "+r.URL.RequestURI()+" "+r.Host+" "+r.Header.Get("Range"))
		w.WriteHeader(http.StatusPartialContent)
		if r.Method == http.MethodPut {
			_, _ = w.Write(in) // an echo
			return
		}
		_, _ = w.Write(body)
	}))
	defer upstream.Close()

	for _, tc := range []struct {
		name string
		lat  Latency
		want time.Duration
	}{
		{"fast", Latency{FirstByte: 30 * time.Millisecond, SlowFirstByte: time.Hour, SlowFraction: 0}, 30 * time.Millisecond},
		{"slow", Latency{FirstByte: time.Millisecond, SlowFirstByte: 120 * time.Millisecond, SlowFraction: 1}, 120 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := NewLatencyProxy(upstream.URL, tc.lat)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			for i, method := range []string{http.MethodGet, http.MethodPut, http.MethodGet} {
				var sent io.Reader
				if method == http.MethodPut {
					sent = bytes.NewReader(body[:1<<20])
				}
				req, err := http.NewRequest(method, p.URL+"/models/dsv41/shard?x=1", sent)
				if err != nil {
					t.Fatal(err)
				}
				req.Host = "signed.example:7070"
				req.Header.Set("Range", "bytes=0-")
				var first time.Time
				req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
					GotFirstResponseByte: func() { first = time.Now() },
				}))
				start := time.Now()
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil {
					t.Fatal(err)
				}
				if resp.StatusCode != http.StatusPartialContent {
					t.Errorf("%s: status %d", method, resp.StatusCode)
				}
				if seen, want := resp.Header.Get("X-Seen"), method+" /models/dsv41/shard?x=1 signed.example:7070 bytes=0-"; seen != want {
					t.Errorf("%s: upstream saw %q, want %q", method, seen, want)
				}
				want := body
				if method == http.MethodPut {
					want = body[:1<<20]
				}
				if !bytes.Equal(got, want) {
					t.Errorf("%s: %d bytes back, want %d, byte-exact", method, len(got), len(want))
				}
				if ttfb := first.Sub(start); ttfb < tc.want {
					t.Errorf("request %d (%s): first byte after %v, want at least %v", i, method, ttfb, tc.want)
				}
			}
			all, slow := p.Responses()
			wantSlow := uint64(0)
			if tc.lat.SlowFraction == 1 {
				wantSlow = 3
			}
			if all != 3 || slow != wantSlow {
				t.Errorf("responses %d (slow %d), want 3 (slow %d)", all, slow, wantSlow)
			}
		})
	}
}

// The proxy in a child process (the test binary re-run): the same bytes,
// no first byte before the injected latency, its counts over HTTP.
func TestLatencyProxyProcess(t *testing.T) {
	body := bytes.Repeat([]byte("engram rows "), 50_000)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }))
	defer upstream.Close()
	const delay = 40 * time.Millisecond
	p, err := StartLatencyProxy(upstream.URL, Latency{FirstByte: delay, SlowFirstByte: delay, SlowFraction: 0.5, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	for i := 0; i < 4; i++ {
		start := time.Now()
		resp, err := http.Get(p.URL + "/models/x")
		if err != nil {
			t.Fatal(err)
		}
		ttfb := time.Since(start) // Get returns once the headers are in
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !bytes.Equal(got, body) {
			t.Fatalf("GET %d: %d bytes (%v), want the %d upstream bytes", i, len(got), err, len(body))
		}
		if ttfb < delay {
			t.Errorf("GET %d: headers after %v, want at least %v", i, ttfb, delay)
		}
	}
	all, slow, err := p.Responses()
	if err != nil || all != 4 || slow > 4 {
		t.Errorf("counts %d (slow %d), %v; want 4", all, slow, err)
	}
}

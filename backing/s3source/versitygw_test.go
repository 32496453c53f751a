package s3source

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	neturl "net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/s3source/s3test"
	"github.com/engramfs/engramfs/backing/sourcetest"
	"github.com/engramfs/engramfs/internal/stats"
)

// newServerSource uploads dir to a fresh versitygw and opens it as a Source.
func newServerSource(t *testing.T, dir string, cfg Config, st *stats.Counters) (*Source, *s3test.Server, string) {
	srv := s3test.Start(t)
	srv.Env(t)
	srv.Bucket(t, "models")
	url := srv.Upload(t, dir, "models", "dsv41/engram")
	cfg.Client = ClientConfig{Endpoint: srv.Endpoint, PathStyle: true}
	src, err := New(context.Background(), url, cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, srv, url
}

func TestConformanceVersitygw(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		src, _, _ := newServerSource(t, dir, DefaultConfig(), nil)
		return src
	})
}

func TestConformanceVersitygwMirror(t *testing.T) {
	sourcetest.Run(t, func(t *testing.T, dir string) backing.Source {
		cfg := DefaultConfig()
		cfg.Mirror = MirrorConfig{Dir: t.TempDir(), Size: 64 << 20}
		src, _, _ := newServerSource(t, dir, cfg, nil)
		t.Cleanup(func() { src.Close() })
		return src
	})
}

// A synthetic model uploaded to versitygw reads byte-exact through
// LoadSource and the Store, rows picked at random; then a shard rewritten
// under the open store fails with ErrShardChanged, never with new bytes.
func TestStoreOnVersitygw(t *testing.T) {
	dir := t.TempDir()
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	st := &stats.Counters{}
	src, srv, url := newServerSource(t, dir, DefaultConfig(), st)
	m, err := backing.LoadSource(src, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	if m.Dir != url || len(m.Tables) != 2*spec.Layers {
		t.Fatalf("model %s with %d tables", m.Dir, len(m.Tables))
	}
	local, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	store, err := backing.Open(m, src, st)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	rng := rand.New(rand.NewPCG(7, 8))
	for i := 0; i < 200; i++ {
		ti := rng.IntN(len(m.Tables))
		tb := m.Tables[ti]
		row := rng.Int64N(int64(tb.Rows))
		got, err := backing.ReadTable(store, tb, row*tb.RowBytes, int(tb.RowBytes))
		if err != nil {
			t.Fatalf("table %s row %d: %v", tb.Name, row, err)
		}
		want := make([]byte, tb.RowBytes)
		if _, err := readLocal(dir, local.Tables[ti], row*tb.RowBytes, want); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("table %s row %d: wrong bytes", tb.Name, row)
		}
	}
	if st.S3Gets.Load() == 0 || st.S3ETagFailures.Load() != 0 {
		t.Fatalf("GETs %d, ETag failures %d", st.S3Gets.Load(), st.S3ETagFailures.Load())
	}

	// Rewrite the first shard with other bytes of the same size.
	tb := m.Tables[0]
	b, err := os.ReadFile(filepath.Join(dir, tb.Shard.Name))
	if err != nil {
		t.Fatal(err)
	}
	old := bytes.Clone(b[tb.DataStart : tb.DataStart+4096])
	for i := range b {
		b[i] ^= 0xA5
	}
	srv.Put(t, "models", "dsv41/engram/"+tb.Shard.Name, b)
	got, err := backing.ReadTable(store, tb, 0, 4096)
	if !errors.Is(err, backing.ErrShardChanged) || got != nil {
		t.Fatalf("read after the rewrite: %d bytes (old bytes: %v), %v; want ErrShardChanged", len(got), bytes.Equal(got, old), err)
	}
	if st.S3ETagFailures.Load() == 0 {
		t.Error("no ETag failure counted")
	}
	// A new store over the changed model refuses it at open.
	if _, err := backing.Open(m, src, st); !errors.Is(err, backing.ErrShardChanged) {
		t.Errorf("Open over a rewritten shard: %v, want ErrShardChanged", err)
	}
}

// The mirror against versitygw: pages fetched once are read with 0 GETs,
// in this mount and the next (a new Source over the same directory); an
// object rewritten between the mounts is fetched again, new bytes only.
func TestMirrorVersitygw(t *testing.T) {
	dir := synth(t)
	srv := s3test.Start(t)
	srv.Env(t)
	srv.Bucket(t, "models")
	url := srv.Upload(t, dir, "models", "dsv41/engram")
	mdir := t.TempDir()
	mount := func() (*Source, backing.ShardFile, *stats.Counters) {
		cfg := DefaultConfig()
		cfg.Client = ClientConfig{Endpoint: srv.Endpoint, PathStyle: true}
		cfg.Mirror = MirrorConfig{Dir: mdir, Size: 64 << 20}
		st := &stats.Counters{}
		src, err := New(context.Background(), url, cfg, st)
		if err != nil {
			t.Fatal(err)
		}
		names, err := src.List(".safetensors")
		if err != nil {
			t.Fatal(err)
		}
		sf, err := src.Open(names[0])
		if err != nil {
			t.Fatal(err)
		}
		return src, sf, st
	}
	src, sf, st := mount()
	name := sf.(*shard).name
	want, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	offs := []int64{0, 8192, 1 << 20, int64(len(want)) / 4096 * 4096 / 2}
	check(t, sf, want, offs, 4096)
	src.mir.sync()
	gets := st.S3Gets.Load()
	check(t, sf, want, offs, 4096)
	if st.S3Gets.Load() != gets {
		t.Errorf("%d GETs for mirrored pages, want 0", st.S3Gets.Load()-gets)
	}
	closeAll(t, sf, src)

	src, sf, st = mount()
	check(t, sf, want, offs, 4096)
	if st.S3Gets.Load() != 0 || st.MirrorHits.Load() != uint64(len(offs)) {
		t.Errorf("remount: %d GETs (want 0), %d mirror hits (want %d)", st.S3Gets.Load(), st.MirrorHits.Load(), len(offs))
	}
	closeAll(t, sf, src)

	changed := bytes.Clone(want)
	for i := range changed {
		changed[i] ^= 0x3C
	}
	srv.Put(t, "models", "dsv41/engram/"+name, changed)
	src, sf, st = mount()
	check(t, sf, changed, offs, 4096)
	if st.S3Gets.Load() == 0 || st.S3Gets.Load() != st.BackingReads.Load() || st.MirrorHits.Load() != 0 {
		t.Errorf("after a rewrite: %d GETs (want one per merged read, %d), %d mirror hits (want 0)", st.S3Gets.Load(), st.BackingReads.Load(), st.MirrorHits.Load())
	}
	closeAll(t, sf, src)
}

// The soak through versitygw, behind a proxy that fails 20% of the GETs
// (503, resets before the headers, bodies cut short, a 200 with other
// bytes to a range request): not one wrong byte.
func TestSoakVersitygw(t *testing.T) {
	dir := soakModel(t)
	srv := s3test.Start(t)
	srv.Env(t)
	srv.Bucket(t, "models")
	url := srv.Upload(t, dir, "models", "dsv41/engram")
	proxy := faultProxy(t, srv.Endpoint, 0.20)
	cfg := testConfig()
	cfg.Client = ClientConfig{Endpoint: proxy, PathStyle: true}
	st := &stats.Counters{}
	src, err := New(context.Background(), url, cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	soak(t, dir, src, st, func(name string, b []byte) { srv.Put(t, "models", "dsv41/engram/"+name, b) }, false)
}

// faultProxy forwards requests to endpoint (Host kept: signatures stay
// valid) and fails about rate of the ranged GETs.
func faultProxy(t *testing.T, endpoint string, rate float64) string {
	target, err := neturl.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(21, 22))
	ps := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.Header.Get("Range") == "" {
			rp.ServeHTTP(w, r)
			return
		}
		mu.Lock()
		x := rng.Float64() / rate
		mu.Unlock()
		switch {
		case x < 0.4:
			http.Error(w, "<Error><Code>SlowDown</Code></Error>", http.StatusServiceUnavailable)
		case x < 0.6:
			panic(http.ErrAbortHandler) // reset before the headers
		case x < 0.8:
			rp.ServeHTTP(&cutWriter{ResponseWriter: w}, r) // the body ends early
		case x < 1:
			w.Header().Set("Content-Length", "8192")
			_, _ = w.Write(make([]byte, 8192)) // a 200 of other bytes
		default:
			rp.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(ps.Close)
	return ps.URL
}

// cutWriter passes half of the first body write, then aborts the
// connection.
type cutWriter struct{ http.ResponseWriter }

func (c *cutWriter) Write(p []byte) (int, error) {
	_, _ = c.ResponseWriter.Write(p[:len(p)/2])
	panic(http.ErrAbortHandler)
}

func readLocal(dir string, tb *backing.Table, off int64, p []byte) (int, error) {
	f, err := os.Open(filepath.Join(dir, tb.Shard.Name))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.ReadAt(p, tb.DataStart+off)
}

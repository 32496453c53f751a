package s3source

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

// The benchmarks compare the client CPU of one 4 KiB ranged GET through
// the data path (signed net/http), the SDK's GetObject and the whole
// Source (merging, slots, hedge timer, retries) with a bare net/http GET of
// the same range, against the same
// minimal server. The server runs in a child process (this test binary
// again), so the CPU measured (getrusage of this process, reported as
// cpu-ns/op) is the client's alone.
//
//	go test -run '^$' -bench GetRange -benchtime 20000x ./backing/s3source/

const benchServerEnv = "S3SOURCE_BENCH_SERVER"

const (
	benchObject = "bench/object"
	benchSize   = 64 << 20
	benchETag   = `"0123456789abcdef0123456789abcdef"`
)

func TestMain(m *testing.M) {
	if os.Getenv(benchServerEnv) == "1" {
		serveBench()
		return
	}
	os.Exit(m.Run())
}

// serveBench answers HEAD and ranged GETs of one object of zeros, printing
// its address on stdout, until stdin closes.
func serveBench() {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	fmt.Println(l.Addr().String())
	zeros := make([]byte, 1<<20)
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); os.Exit(0) }()
	_ = http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("ETag", benchETag)
		if r.Method == http.MethodHead {
			h.Set("Content-Length", strconv.Itoa(benchSize))
			return
		}
		var lo, hi int
		if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &lo, &hi); err != nil || hi-lo+1 > len(zeros) {
			http.Error(w, "bad range", http.StatusRequestedRangeNotSatisfiable)
			return
		}
		h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", lo, hi, benchSize))
		h.Set("Content-Length", strconv.Itoa(hi-lo+1))
		w.WriteHeader(http.StatusPartialContent)
		_, _ = w.Write(zeros[:hi-lo+1])
	}))
}

var benchServer struct {
	once  sync.Once
	addr  string
	err   error
	stdin io.WriteCloser // the child exits when it closes: keep it from the GC
}

func startBenchServer(b *testing.B) string {
	benchServer.once.Do(func() {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), benchServerEnv+"=1")
		benchServer.stdin, _ = cmd.StdinPipe() // closed when this process exits: the child follows
		out, err := cmd.StdoutPipe()
		if err != nil {
			benchServer.err = err
			return
		}
		if err := cmd.Start(); err != nil {
			benchServer.err = err
			return
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		benchServer.addr, benchServer.err = strings.TrimSpace(line), err
	})
	if benchServer.err != nil {
		b.Fatal(benchServer.err)
	}
	return benchServer.addr
}

// cpuTime is this process's user+system CPU so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// measure runs get b.N times and reports client CPU per GET.
func measure(b *testing.B, get func(off int64) error) {
	for i := 0; i < 100; i++ { // warm the connection pool
		if err := get(int64(i) * 4096); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu := cpuTime()
	for i := 0; i < b.N; i++ {
		if err := get(int64(i%(benchSize/4096)) * 4096); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
}

func BenchmarkGetRangeNetHTTP(b *testing.B) {
	addr := startBenchServer(b)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 64
	client := &http.Client{Transport: tr}
	url := "http://" + addr + "/" + benchObject
	buf := make([]byte, 4096)
	measure(b, func(off int64) error {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		req.Header.Set("Range", rangeHeader(off, 4096))
		req.Header.Set("If-Match", benchETag)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusPartialContent {
			return fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		_, err = io.ReadFull(resp.Body, buf)
		return err
	})
}

func benchEnv(b *testing.B) {
	b.Setenv("AWS_ACCESS_KEY_ID", "bench")
	b.Setenv("AWS_SECRET_ACCESS_KEY", "bench-secret")
	b.Setenv("AWS_REGION", "us-east-1")
	b.Setenv("AWS_CONFIG_FILE", os.DevNull)
	b.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	b.Setenv("AWS_EC2_METADATA_DISABLED", "true")
}

func benchClient(b *testing.B) *sdkClient {
	addr := startBenchServer(b)
	benchEnv(b)
	c, err := newSDKClient(context.Background(), "bench", ClientConfig{Endpoint: "http://" + addr, PathStyle: true, Conns: 64})
	if err != nil {
		b.Fatal(err)
	}
	return c
}

func benchGet(b *testing.B, get func(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error)) {
	buf := make([]byte, 4096)
	measure(b, func(off int64) error {
		body, err := get(context.Background(), "object", off, 4096, benchETag)
		if err != nil {
			return err
		}
		defer body.Close()
		_, err = io.ReadFull(body, buf)
		return err
	})
}

// BenchmarkGetRangeSigned is the data path: net/http signed with SigV4.
func BenchmarkGetRangeSigned(b *testing.B) {
	c := benchClient(b)
	benchGet(b, c.GetRange)
}

// BenchmarkGetRangeSDK is the SDK's GetObject, for reference.
func BenchmarkGetRangeSDK(b *testing.B) {
	c := benchClient(b)
	benchGet(b, c.getRangeSDK)
}

// BenchmarkGetRangeSource is a prefetch read through the whole Source
// (slots, retries; no hedge timer); BenchmarkGetRangeSourceDemand a fault
// (the demand lane, hedge timer armed).
func BenchmarkGetRangeSource(b *testing.B)       { benchSource(b, false) }
func BenchmarkGetRangeSourceDemand(b *testing.B) { benchSource(b, true) }

func benchSource(b *testing.B, demand bool) {
	addr := startBenchServer(b)
	benchEnv(b)
	cfg := DefaultConfig()
	cfg.Client = ClientConfig{Endpoint: "http://" + addr, PathStyle: true}
	src, err := New(context.Background(), "s3://bench", cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	sf, err := src.Open("object")
	if err != nil {
		b.Fatal(err)
	}
	defer sf.Close()
	done := make(chan error, 1)
	measure(b, func(off int64) error {
		sf.Submit(&backing.ShardRead{Off: off, Len: 4096, Demand: demand, Done: func(_ []byte, err error) { done <- err }})
		return <-done
	})
}

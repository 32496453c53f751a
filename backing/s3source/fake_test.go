package s3source

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// fault is what the fake does to one GET.
type fault int

const (
	faultNone       fault = iota
	fault503              // 503 Slow Down
	faultReset            // connection reset before the headers
	faultResetBody        // connection reset halfway through the body
	faultTruncated        // the body ends early
	faultWhole200         // a 200 with the whole object to a range request
	faultWrongRange       // a 206 for other bytes than asked
	faultStallBody        // half the body, then nothing until the GET is canceled
)

// fakeStore is an in-memory object store with injected faults and latency:
// objectClient for unit tests. The answers go through checkRange, as the
// SDK client's do.
type fakeStore struct {
	mu      sync.Mutex
	objects map[string]fakeObject // GUARDED_BY(mu)
	gets    []getReq              // GUARDED_BY(mu): every GET, in order
	// fault picks the fault of the i-th GET (0-based) of a range; nil: none.
	fault func(g getReq, nth int) fault
	// latency is the wait before a GET's headers; nil: none.
	latency func(g getReq, nth int) time.Duration
	// hold, when it returns a channel, holds a GET's headers until the
	// channel closes (or the GET is canceled); nil: no hold.
	hold func(g getReq, nth int) <-chan struct{}
	seen map[getReq]int // GUARDED_BY(mu): GETs per range so far
}

type fakeObject struct {
	data []byte
	etag string
}

type getReq struct {
	key    string
	off, n int64
}

func newFakeStore() *fakeStore {
	return &fakeStore{objects: map[string]fakeObject{}, seen: map[getReq]int{}}
}

func (f *fakeStore) put(key string, data []byte) {
	sum := md5.Sum(data)
	f.mu.Lock()
	f.objects[key] = fakeObject{data: slices.Clone(data), etag: `"` + hex.EncodeToString(sum[:]) + `"`}
	f.mu.Unlock()
}

// upload puts every regular file of dir under prefix.
func (f *fakeStore) upload(dir, prefix string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type().IsRegular() {
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				return err
			}
			f.put(prefix+e.Name(), b)
		}
	}
	return nil
}

func (f *fakeStore) getLog() []getReq {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.gets)
}

func (f *fakeStore) Head(ctx context.Context, key string) (int64, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	o, ok := f.objects[key]
	if !ok {
		return 0, "", fmt.Errorf("HEAD %s: %w", key, fs.ErrNotExist)
	}
	return int64(len(o.data)), o.etag, nil
}

func (f *fakeStore) List(ctx context.Context, prefix string) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var keys []string
	for k := range f.objects {
		if rest, ok := strings.CutPrefix(k, prefix); ok && !strings.Contains(rest, "/") {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

func (f *fakeStore) GetRange(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error) {
	g := getReq{key, off, n}
	f.mu.Lock()
	f.gets = append(f.gets, g)
	nth := f.seen[g]
	f.seen[g]++
	o, ok := f.objects[key]
	flt, lat := faultNone, time.Duration(0)
	if f.fault != nil {
		flt = f.fault(g, nth)
	}
	if f.latency != nil {
		lat = f.latency(g, nth)
	}
	var hold <-chan struct{}
	if f.hold != nil {
		hold = f.hold(g, nth)
	}
	f.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, fmt.Errorf("GET %s: %w", key, ctx.Err())
		}
	}
	if lat > 0 {
		select {
		case <-time.After(lat):
		case <-ctx.Done():
			return nil, fmt.Errorf("GET %s: %w", key, ctx.Err())
		}
	}
	switch {
	case !ok:
		return nil, fmt.Errorf("GET %s: %w", key, fs.ErrNotExist)
	case o.etag != etag:
		return nil, fmt.Errorf("GET %s: %w", key, errPrecondition)
	case off < 0 || n <= 0 || off+n > int64(len(o.data)):
		return nil, fmt.Errorf("GET %s: HTTP 416", key)
	}
	status, cr, body := http.StatusPartialContent, fmt.Sprintf("bytes %d-%d/%d", off, off+n-1, len(o.data)), o.data[off:off+n]
	switch flt {
	case fault503:
		return nil, retryablef("GET %s: HTTP 503 SlowDown", key)
	case faultReset:
		return nil, retryablef("GET %s: %w", key, syscall.ECONNRESET)
	case faultWhole200:
		status, cr, body = http.StatusOK, "", o.data
	case faultWrongRange:
		cr = fmt.Sprintf("bytes %d-%d/%d", off+1, off+n, len(o.data))
	}
	if err := checkRange(status, cr, int64(len(body)), off, n); err != nil {
		return nil, fmt.Errorf("GET %s: %w", key, err)
	}
	var r io.Reader = bytes.NewReader(body)
	switch flt {
	case faultTruncated:
		r = bytes.NewReader(body[:len(body)/2])
	case faultResetBody:
		r = io.MultiReader(bytes.NewReader(body[:len(body)/2]), errReader{syscall.ECONNRESET})
	case faultStallBody:
		r = io.MultiReader(bytes.NewReader(body[:len(body)/2]), stallReader{ctx})
	}
	return io.NopCloser(r), nil
}

// stallReader blocks until ctx ends, as a body whose sender went quiet.
type stallReader struct{ ctx context.Context }

func (s stallReader) Read([]byte) (int, error) {
	<-s.ctx.Done()
	return 0, s.ctx.Err()
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

var _ objectClient = (*fakeStore)(nil)

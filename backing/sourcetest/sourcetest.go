// Package sourcetest is the conformance suite of backing.Source: every
// implementation (the local directory, the object store) runs Run, so a
// model reads the same bytes, and fails the same way, wherever it lives.
package sourcetest

import (
	"bytes"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
)

// Spec is the synthetic model Run serves: two shards of a few MiB, the
// first with table data at an unaligned offset.
func Spec() backing.SynthSpec {
	s := backing.DefaultSynth()
	s.Rows = 512
	return s
}

// wait bounds every wait for a completion: other builds share the machine,
// so it is generous, and it is never a timing assertion.
const wait = 2 * time.Minute

// Run checks the Source that newSource makes to serve the files of dir (a
// directory written by backing.Synthesize).
func Run(t *testing.T, newSource func(t *testing.T, dir string) backing.Source) {
	dir := t.TempDir()
	if err := backing.Synthesize(dir, Spec()); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, dir)
	shards := localNames(t, dir, ".safetensors")
	if len(shards) < 2 {
		t.Fatalf("synthetic model has %d shards", len(shards))
	}

	t.Run("String", func(t *testing.T) {
		if src.String() == "" {
			t.Fatal("String is empty")
		}
	})
	t.Run("List", func(t *testing.T) {
		for _, suffix := range []string{".safetensors", ".json", ".nothing-has-this"} {
			got, err := src.List(suffix)
			if err != nil {
				t.Fatal(err)
			}
			if want := localNames(t, dir, suffix); !slices.Equal(got, want) {
				t.Errorf("List(%q) = %q, want %q", suffix, got, want)
			}
		}
	})
	t.Run("ReadFile", func(t *testing.T) {
		want := local(t, dir, backing.IndexFile)
		got, err := src.ReadFile(backing.IndexFile, int64(len(want)))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("ReadFile(index) = %d bytes, %v; want %d bytes", len(got), err, len(want))
		}
		if _, err := src.ReadFile(backing.IndexFile, int64(len(want))-1); err == nil {
			t.Error("ReadFile over the limit: no error")
		}
		if _, err := src.ReadFile("no-such-file.json", 1<<20); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("ReadFile(missing) = %v, want fs.ErrNotExist", err)
		}
	})
	t.Run("Open", func(t *testing.T) {
		if _, err := src.Open("no-such-shard.safetensors"); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("Open(missing) = %v, want fs.ErrNotExist", err)
		}
		for _, name := range shards {
			a, b := open(t, src, name), open(t, src, name)
			if size := int64(len(local(t, dir, name))); a.Identity().Size != size {
				t.Errorf("%s: Identity().Size = %d, want %d", name, a.Identity().Size, size)
			}
			if !a.Identity().Equal(b.Identity()) {
				t.Errorf("%s: two opens, two identities: %v and %v", name, a.Identity(), b.Identity())
			}
		}
	})
	t.Run("ReadAt", func(t *testing.T) {
		for _, name := range shards {
			want := local(t, dir, name)
			sf := open(t, src, name)
			size := int64(len(want))
			rng := rand.New(rand.NewPCG(1, 2))
			for i := 0; i < 20; i++ {
				off := rng.Int64N(size)
				n := 1 + rng.Int64N(min(size-off, 100_000))
				p := make([]byte, n)
				if got, err := sf.ReadAt(p, off); err != nil || int64(got) != n || !bytes.Equal(p, want[off:off+n]) {
					t.Fatalf("%s: ReadAt(%d bytes at %d) = %d, %v, or wrong bytes", name, n, off, got, err)
				}
			}
			// Across the end: the bytes there, and an error.
			p := make([]byte, 100)
			got, err := sf.ReadAt(p, size-10)
			if got != 10 || err == nil || !bytes.Equal(p[:got], want[size-10:]) {
				t.Errorf("%s: ReadAt across the end = %d, %v; want 10 bytes and an error", name, got, err)
			}
			if got, err := sf.ReadAt(p, size); got != 0 || err == nil {
				t.Errorf("%s: ReadAt at the end = %d, %v; want 0 and an error", name, got, err)
			}
		}
	})
	t.Run("Submit", func(t *testing.T) {
		for _, name := range shards {
			want := local(t, dir, name)
			sf := open(t, src, name)
			size := int64(len(want))
			rng := rand.New(rand.NewPCG(3, 4))
			var reads []read
			// Pages anywhere, runs up to 1 MiB, neighbours, duplicates, the
			// last byte.
			for i := 0; i < 64; i++ {
				off := rng.Int64N(size)
				n := 1 + rng.Int64N(min(size-off, 1<<20))
				if i%4 == 0 {
					off = off / 4096 * 4096
					n = min(4096, size-off)
				}
				reads = append(reads, read{off, int(n)})
			}
			reads = append(reads, read{0, 4096}, read{4096, 4096}, read{100, 5000}, read{100, 5000}, read{size - 1, 1})
			got := submit(t, sf, reads)
			for i, r := range reads {
				if got[i].err != nil || !bytes.Equal(got[i].data, want[r.off:r.off+int64(r.n)]) {
					t.Fatalf("%s: read [%d, +%d): %d bytes, %v, or wrong bytes", name, r.off, r.n, len(got[i].data), got[i].err)
				}
			}
			// Each read owns its bytes: writing one changes no other.
			for i := range got[len(got)-2].data {
				got[len(got)-2].data[i] ^= 0xFF
			}
			if r := reads[len(reads)-3]; !bytes.Equal(got[len(got)-3].data, want[r.off:r.off+int64(r.n)]) {
				t.Error("two reads of the same bytes share a buffer")
			}
		}
	})
	t.Run("SubmitOutOfRange", func(t *testing.T) {
		sf := open(t, src, shards[0])
		size := sf.Identity().Size
		for i, res := range submit(t, sf, []read{{size - 10, 20}, {size + 4096, 4096}}) {
			if res.err == nil {
				t.Errorf("read %d past the end: %d bytes and no error", i, len(res.data))
			}
		}
	})
	t.Run("Close", func(t *testing.T) {
		want := local(t, dir, shards[1])
		sf, err := src.Open(shards[1])
		if err != nil {
			t.Fatal(err)
		}
		// Reads racing Close: each answers once, with its bytes or ErrClosed.
		var reads []read
		for off := int64(0); off+4096 <= int64(len(want)) && len(reads) < 64; off += 8 * 4096 {
			reads = append(reads, read{off, 4096})
		}
		results := make(chan []result, 1)
		go func() { results <- submit(t, sf, reads) }()
		if err := sf.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		for i, res := range <-results {
			r := reads[i]
			if res.err == nil && !bytes.Equal(res.data, want[r.off:r.off+int64(r.n)]) {
				t.Fatalf("read [%d, +%d) racing Close: wrong bytes", r.off, r.n)
			}
			if res.err != nil && !errors.Is(res.err, backing.ErrClosed) {
				t.Errorf("read [%d, +%d) racing Close: %v, want ErrClosed", r.off, r.n, res.err)
			}
		}
		for _, res := range submit(t, sf, []read{{0, 4096}}) {
			if !errors.Is(res.err, backing.ErrClosed) {
				t.Errorf("read after Close: %v, want ErrClosed", res.err)
			}
		}
		if err := sf.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	})
}

type read struct {
	off int64
	n   int
}

type result struct {
	data []byte
	err  error
}

// submit submits reads in one call and waits for every answer, checking
// each Done is called once and with exactly Len bytes or an error.
func submit(t *testing.T, sf backing.ShardFile, reads []read) []result {
	out := make([]result, len(reads))
	calls := make([]atomic.Int32, len(reads))
	var wg sync.WaitGroup
	wg.Add(len(reads))
	srs := make([]*backing.ShardRead, len(reads))
	for i, r := range reads {
		srs[i] = &backing.ShardRead{Off: r.off, Len: r.n, Done: func(data []byte, err error) {
			if calls[i].Add(1) != 1 {
				t.Errorf("read [%d, +%d): Done called again", r.off, r.n)
				return
			}
			if err == nil && len(data) != r.n {
				err = errors.New("short result without an error")
				t.Errorf("read [%d, +%d): %d bytes and no error", r.off, r.n, len(data))
			}
			out[i] = result{data, err}
			wg.Done()
		}}
	}
	sf.Submit(srs...)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(wait):
		t.Fatalf("%d reads not answered within %v", len(reads), wait)
	}
	return out
}

func open(t *testing.T, src backing.Source, name string) backing.ShardFile {
	t.Helper()
	sf, err := src.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sf.Close() })
	return sf
}

func local(t *testing.T, dir, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func localNames(t *testing.T, dir, suffix string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if e.Type().IsRegular() && strings.HasSuffix(e.Name(), suffix) {
			names = append(names, e.Name())
		}
	}
	return names
}

package prefetch

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/stats"
)

// memReader serves table bytes from memory: the benchmark measures the
// scheduler (queues, dedup, claims, merges), not the disk.
type memReader struct{ buf []byte }

func (m memReader) Submit(reads ...*backing.TableRead) {
	for _, r := range reads {
		r.Done(m.buf[:r.Len:r.Len], nil)
	}
}

type countingPusher struct{ pages atomic.Uint64 }

func (c *countingPusher) Store(table uint32, off int64, data []byte) error {
	c.pages.Add(uint64((len(data) + cache.PageSize - 1) / cache.PageSize))
	return nil
}

// BenchmarkPrefillFrame pushes one prefill chunk (20,000 random rows of a
// 1M-row layer, two tables) through the prefetcher and waits for it.
func BenchmarkPrefillFrame(b *testing.B) {
	const rows = 20000
	pusher := benchFrames(b, hints.Prefill, rows)
	b.ReportMetric(float64(rows*b.N)/b.Elapsed().Seconds(), "rows/s")
	b.ReportMetric(float64(pusher.pages.Load())/b.Elapsed().Seconds(), "pages/s")
}

// BenchmarkDecodeFrame pushes one decode step's frame (72 random rows of a
// 1M-row layer, two tables, every page cold) through the prefetcher and
// waits for its barrier: the daemon's bookkeeping for a step (admission,
// claims, the loader's flights and holds, settlement, the pushers), with no
// disk, no FUSE and no hot tier (2026-12-06: 286-321 µs and ~1,057
// allocations for its 144 pages, two goroutine hand-offs included).
func BenchmarkDecodeFrame(b *testing.B) {
	b.ReportAllocs()
	pusher := benchFrames(b, hints.Decode, 72)
	b.ReportMetric(float64(pusher.pages.Load())/float64(b.N), "pages/op")
}

// benchFrames submits b.N frames of class, each of rows random rows of a
// 1M-row layer served from memory, waiting for each frame's barrier.
func benchFrames(b *testing.B, class hints.Class, rows int) *countingPusher {
	m, err := backing.Load(sparseModel(b, 1<<20), backing.DefaultTablePattern)
	if err != nil {
		b.Fatal(err)
	}
	st := &stats.Counters{}
	loader := cache.NewLoader(memReader{buf: make([]byte, cache.MaxRunPages*cache.PageSize)}, m.Tables, st)
	pusher := &countingPusher{}
	p := New(DefaultConfig(64), m, loader, pusher, nil, st, nil)
	defer p.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	frame := make([]uint64, rows)
	b.ResetTimer()
	for range b.N {
		for i := range frame {
			frame[i] = rng.Uint64N(1 << 20)
		}
		bar := NewBarrier()
		p.Submit(class, 0, frame, bar)
		if err := bar.Wait(b.Context()); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	return pusher
}

// sparseModel writes a one-layer model whose shard is a header and a hole:
// the scheduler never looks at the bytes.
func sparseModel(b *testing.B, rows int64) string {
	dir := b.TempDir()
	w := backing.TensorInfo{Name: "layers.0.engram.embed.weight", Dtype: "U8", Shape: []int64{rows, 4096}, End: rows * 4096}
	s := backing.TensorInfo{Name: "layers.0.engram.embed.scale", Dtype: "U8", Shape: []int64{rows, 128}, Begin: w.End, End: w.End + rows*128}
	hdr, err := backing.EncodeHeader([]backing.TensorInfo{w, s}, nil, 1)
	if err != nil {
		b.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(hdr); err != nil {
		b.Fatal(err)
	}
	if err := f.Truncate(int64(len(hdr)) + s.End); err != nil {
		b.Fatal(err)
	}
	return dir
}

// parkedReader never answers until released: the pages a benchmark queues stay
// queued or in flight, as under a flood the disk cannot keep up with.
type parkedReader struct {
	mu    sync.Mutex
	reads []*backing.TableRead
	buf   []byte
}

func (h *parkedReader) Submit(reads ...*backing.TableRead) {
	h.mu.Lock()
	h.reads = append(h.reads, reads...)
	h.mu.Unlock()
}

func (h *parkedReader) release() {
	h.mu.Lock()
	reads := h.reads
	h.reads = nil
	h.mu.Unlock()
	for _, r := range reads {
		r.Done(h.buf[:r.Len:r.Len], nil)
	}
}

// BenchmarkPrefillFloodPart is the daemon's side of four handles flooding
// 4M-row prefill frames over a 60,000-row layer, one 1 MiB write (131,072
// rows, most of them named by the frame's earlier writes) per op, while the
// disk keeps up with none of it. Beside it a goroutine takes the
// prefetcher's lock every 100 µs, as the fetch loop, the read engine's
// completions and the pushers do for a decode step: lock-wait-p99-µs is how
// long they wait behind the flood's admission.
func BenchmarkPrefillFloodPart(b *testing.B) {
	const tableRows = 60000
	m, err := backing.Load(sparseModel(b, tableRows), backing.DefaultTablePattern)
	if err != nil {
		b.Fatal(err)
	}
	st := &stats.Counters{}
	src := &parkedReader{buf: make([]byte, cache.MaxRunPages*cache.PageSize)}
	loader := cache.NewLoader(src, m.Tables, st)
	p := New(DefaultConfig(8), m, loader, &countingPusher{}, nil, st, nil)
	defer func() {
		src.release()
		p.Close()
	}()
	var bars [4]*Barrier
	for i := range bars {
		bars[i] = NewBarrier()
	}
	rng := rand.New(rand.NewPCG(3, 4))
	part := make([]uint64, 1<<20/8)
	stop := make(chan struct{})
	waits := make(chan []time.Duration)
	go func() {
		var w []time.Duration
		for {
			select {
			case <-stop:
				waits <- w
				return
			case <-time.After(100 * time.Microsecond):
			}
			start := time.Now()
			p.mu.Lock()
			w = append(w, time.Since(start))
			p.mu.Unlock()
		}
	}()
	b.ResetTimer()
	for i := range b.N {
		for j := range part {
			part[j] = rng.Uint64N(tableRows)
		}
		p.SubmitPart(bars[i%len(bars)], hints.Prefill, 0, part, false)
	}
	b.StopTimer()
	close(stop)
	w := <-waits
	slices.Sort(w)
	if len(w) > 0 {
		b.ReportMetric(float64(w[len(w)*99/100].Microseconds()), "lock-wait-p99-µs")
		b.ReportMetric(float64(w[len(w)-1].Microseconds()), "lock-wait-max-µs")
	}
	b.ReportMetric(float64(len(part)*b.N)/b.Elapsed().Seconds(), "rows/s")
}

// silentReader never answers: queued work stays queued.
type silentReader struct{}

func (silentReader) Submit(...*backing.TableRead) {}

// BenchmarkReleaseFullPrefillQueue is the cost of closing a handle whose
// prefill fills the whole default queue (262,144 pages), and the longest a
// fault would wait for the prefetcher's lock meanwhile.
func BenchmarkReleaseFullPrefillQueue(b *testing.B) {
	m, err := backing.Load(sparseModel(b, 1<<20), backing.DefaultTablePattern)
	if err != nil {
		b.Fatal(err)
	}
	st := &stats.Counters{}
	loader := cache.NewLoader(silentReader{}, m.Tables, st)
	p := New(DefaultConfig(64), m, loader, &countingPusher{}, nil, st, nil)
	rows := make([]uint64, 0, 1<<17)
	for r := range uint64(1 << 17) {
		rows = append(rows, r*7) // one weight page each, and their scale pages
	}
	var took, longest time.Duration
	for i := 0; b.Loop(); i++ {
		bar := NewBarrier()
		part := slices.Clone(rows)
		for j := range part {
			part[j] += uint64(i) % 7
		}
		p.Submit(hints.Prefill, 0, part, bar)
		// What a fault waits for p.mu meanwhile (Faulted takes it).
		stop, waited := make(chan struct{}), make(chan time.Duration)
		go func() {
			var most time.Duration
			for {
				select {
				case <-stop:
					waited <- most
					return
				default:
				}
				t0 := time.Now()
				p.mu.Lock()
				most = max(most, time.Since(t0))
				p.mu.Unlock()
				time.Sleep(100 * time.Microsecond)
			}
		}()
		start := time.Now()
		p.Release(bar)
		took += time.Since(start)
		close(stop)
		longest = max(longest, <-waited)
	}
	b.ReportMetric(float64(longest.Microseconds()), "µs-longest-lock-wait")
	b.ReportMetric(float64(took.Microseconds())/float64(b.N), "µs/release")
	b.ReportMetric(float64(st.PrefetchPagesReleased.Load())/float64(b.N), "pages/release")
}

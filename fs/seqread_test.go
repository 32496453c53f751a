package fs

import (
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakePushes records what a readAhead reads and stores.
type fakePushes struct {
	mu     sync.Mutex
	stored [][2]int64 // off, len
	fail   bool       // every store fails
}

func newFakeReadAhead(size int64) (*readAhead, *fakePushes) {
	f := &fakePushes{}
	r := &readAhead{size: size,
		fill: func(b []byte, off int64) (int, error) { return int(min(int64(len(b)), size-off)), nil },
		store: func(off int64, data []byte) syscall.Errno {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.stored = append(f.stored, [2]int64{off, int64(len(data))})
			if f.fail {
				return syscall.ENOENT
			}
			return 0
		}}
	return r, f
}

// settle waits (up to a deadline that fails the test) until r has pushed
// all it was asked to, then closes it.
func settle(t *testing.T, r *readAhead) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r.mu.Lock()
		idle := r.loaders == 0
		r.mu.Unlock()
		if idle {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("readahead still running after 10 s")
		}
		time.Sleep(time.Millisecond)
	}
	r.close()
}

// covered returns the stores sorted, and whether they tile the ranges
// [from, to) given as pairs, in order, and nothing else.
func (f *fakePushes) covered(ranges ...int64) ([][2]int64, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := slices.Clone(f.stored)
	slices.SortFunc(s, func(a, b [2]int64) int { return int(a[0] - b[0]) })
	i := 0
	for r := 0; r < len(ranges); r += 2 {
		at := ranges[r]
		for ; i < len(s) && at < ranges[r+1]; i++ {
			if s[i][0] != at {
				return s, false
			}
			at += s[i][1]
		}
		if at != ranges[r+1] {
			return s, false
		}
	}
	return s, i == len(s)
}

// Readahead starts once a handle has read seqTrigger bytes back to back,
// pushes a window (seqFirstWindow) after the last read in pushChunk stores,
// and goes on when the reader's next miss lands where the pushed pages end,
// with a window that grows with the run (four times its bytes) up to
// seqWindow.
func TestReadAheadFollowsASequentialReader(t *testing.T) {
	const size = 4 * seqWindow
	r, f := newFakeReadAhead(size)
	var off int64
	for ; off < seqTrigger-4096; off += 4096 {
		r.observe(off, off+4096)
	}
	settle(t, r)
	if len(f.stored) != 0 {
		t.Fatalf("pushed %v before %d bytes were read in a row", f.stored, seqTrigger)
	}

	r, f = newFakeReadAhead(size)
	for off = 0; off < seqTrigger; off += 4096 {
		r.observe(off, off+4096)
	}
	settle(t, r)
	want := []int64{seqTrigger, seqTrigger + seqFirstWindow} // the first window
	if s, ok := f.covered(want...); !ok {
		t.Fatalf("stores %v: want %v", s, want)
	}

	// The reader's next miss is where the pushed window ends: the run goes
	// on past the page it reads itself, the window four times the run.
	for end := want[len(want)-1]; end < size/2; end = want[len(want)-1] {
		r.closed = false
		r.observe(end, end+4096)
		settle(t, r)
		window := min(seqWindow, max(seqFirstWindow, 4*(end+4096)))
		want = append(want, end+4096, end+4096+window)
		if s, ok := f.covered(want...); !ok {
			t.Fatalf("miss at %d: stores %v: want %v", end, s, want)
		}
	}
	if last := want[len(want)-1] - want[len(want)-2]; last != seqWindow {
		t.Fatalf("the window grew to %d, want %d", last, seqWindow)
	}

	// A table's trigger: two rows and a page read back to back start
	// nothing when that is more than seqTrigger.
	r, f = newFakeReadAhead(size)
	r.trigger = 2*(100<<10) + 4096
	for off = 0; off < r.trigger-4096; off += 4096 {
		r.observe(off, off+4096)
	}
	settle(t, r)
	if len(f.stored) != 0 {
		t.Fatalf("pushed %v within two 100 KiB rows", f.stored)
	}

	// Near the end of the file, the window stops at its end.
	r, f = newFakeReadAhead(size)
	for off = size - seqTrigger - 8192; off < size-8192; off += 4096 {
		r.observe(off, off+4096)
	}
	settle(t, r)
	if s, ok := f.covered(size-8192, size); !ok {
		t.Fatalf("stores %v: want [%d, %d)", s, size-8192, size)
	}
}

// Every miss tops the window up to seqWindow past it, once that adds a
// piece or more: the reader's hits never reach the daemon, and a reader
// that missed early in a window and then not until its end found nothing
// pushed there (asking again only past half the window).
func TestSeqRunTopsUpOnEveryMiss(t *testing.T) {
	const size = 1 << 30
	var s seqRun
	if from, to := s.observe(0, 8<<20, size, 0); from != 8<<20 || to != 8<<20+seqWindow {
		t.Fatalf("an 8 MiB read back to back: window [%d, %d), want [%d, %d)", from, to, 8<<20, 8<<20+seqWindow)
	}
	// A miss a page on: less than a piece to add.
	if from, to := s.observe(8<<20, 8<<20+4096, size, 0); from < to {
		t.Fatalf("a miss a page past the run: window [%d, %d), want none", from, to)
	}
	// A miss 2 MiB into the window, far from half of it.
	miss := int64(10 << 20)
	if from, to := s.observe(miss, miss+4096, size, 0); from != 8<<20+seqWindow || to != miss+4096+seqWindow {
		t.Fatalf("a miss 2 MiB into the window: window [%d, %d), want [%d, %d)", from, to, 8<<20+seqWindow, miss+4096+seqWindow)
	}
}

// Random reads never push; a failing store stops the run; close waits for
// the pushes and no push starts after it.
func TestReadAheadIgnoresRandomReadsAndStopsOnFailure(t *testing.T) {
	r, f := newFakeReadAhead(64 << 20)
	for i := range int64(200) {
		off := (i * 7919 % 16000) * 4096
		r.observe(off, off+4096)
		r.observe(off+4096, off+8192) // a row over two pages
	}
	settle(t, r)
	if len(f.stored) != 0 {
		t.Fatalf("random reads pushed %v", f.stored)
	}

	// One large read: a window of seqWindow, 32 pieces, that stops at the
	// first failed store (the pieces in flight finish).
	r, f = newFakeReadAhead(64 << 20)
	f.fail = true
	r.observe(0, 8<<20)
	settle(t, r)
	if len(f.stored) == 0 || len(f.stored) > pushParallel {
		t.Fatalf("%d stores with every store failing, want 1 to the %d in flight", len(f.stored), pushParallel)
	}
	r.close()
	n := len(f.stored)
	for off := int64(seqTrigger); off < 4*seqTrigger; off += 4096 {
		r.observe(off, off+4096)
	}
	if len(f.stored) != n {
		t.Fatal("pushed after close")
	}
}

// Pieces in flight are bounded across handles (maxPushes), each holding a
// buffer: many sequential readers do not multiply the daemon's memory.
func TestReadAheadBoundsPiecesAcrossHandles(t *testing.T) {
	var mu sync.Mutex
	inflight, most := 0, 0
	release := make(chan struct{})
	var all []*readAhead
	for range 3 * maxPushes / pushParallel {
		r := &readAhead{size: 64 << 20,
			fill: func(b []byte, off int64) (int, error) { return len(b), nil },
			store: func(off int64, data []byte) syscall.Errno {
				mu.Lock()
				inflight++
				most = max(most, inflight)
				mu.Unlock()
				<-release
				mu.Lock()
				inflight--
				mu.Unlock()
				return 0
			}}
		r.observe(0, 8<<20) // a 32 MiB window
		all = append(all, r)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		n := inflight
		mu.Unlock()
		if n == maxPushes {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pieces in flight after 10 s, want %d", n, maxPushes)
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // room for one too many to show
	close(release)
	for _, r := range all {
		settle(t, r)
	}
	if most != maxPushes {
		t.Fatalf("%d pieces were in flight at once across handles, want at most %d", most, maxPushes)
	}
}

// A handle reads at most loadParallel pieces from backing at once while
// more are in flight: the pieces being stored do not add to the disk's
// queue.
func TestReadAheadReadsAtMostLoadParallelAtOnce(t *testing.T) {
	var mu sync.Mutex
	loading, most, stored := 0, 0, 0
	release := make(chan struct{})
	r := &readAhead{size: 64 << 20,
		fill: func(b []byte, off int64) (int, error) {
			mu.Lock()
			loading++
			most = max(most, loading)
			mu.Unlock()
			<-release
			mu.Lock()
			loading--
			mu.Unlock()
			return len(b), nil
		},
		store: func(off int64, data []byte) syscall.Errno {
			mu.Lock()
			stored++
			mu.Unlock()
			return 0
		}}
	r.observe(0, 8<<20) // a 32 MiB window: 32 pieces
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		n := loading
		mu.Unlock()
		if n == loadParallel {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pieces reading after 10 s, want %d", n, loadParallel)
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // room for one too many to show
	mu.Lock()
	if most != loadParallel {
		t.Errorf("%d pieces read at once, want %d", most, loadParallel)
	}
	mu.Unlock()
	close(release)
	settle(t, r)
	if stored != 32 {
		t.Fatalf("%d pieces stored, want the window's 32", stored)
	}
}

// A handle's pieces start reading in the order of their offsets, at most
// loadParallel at once: the reader waits on the first pages of a window,
// and a piece read out of order ahead of them keeps the disk from them.
func TestReadAheadReadsPiecesInOrder(t *testing.T) {
	for range 5 {
		var mu sync.Mutex
		var starts []int64
		r := &readAhead{size: 64 << 20,
			fill: func(b []byte, off int64) (int, error) {
				mu.Lock()
				starts = append(starts, off)
				mu.Unlock()
				time.Sleep(200 * time.Microsecond)
				return len(b), nil
			},
			store: func(off int64, data []byte) syscall.Errno { return 0 }}
		r.observe(0, 8<<20) // a 32 MiB window: 32 pieces
		settle(t, r)
		if len(starts) != 32 {
			t.Fatalf("%d pieces read, want the window's 32", len(starts))
		}
		for i, off := range starts {
			// The i-th read to start is one of the loadParallel oldest
			// pieces not read yet.
			if bound := int64(8<<20) + int64(i+loadParallel-1)*pushChunk; off > bound {
				t.Fatalf("read %d started at %d MiB, past the %d oldest pieces not read yet (order %v)", i, off>>20, loadParallel, mib(starts))
			}
		}
	}
}

func mib(offs []int64) []int64 {
	out := make([]int64, len(offs))
	for i, o := range offs {
		out[i] = o >> 20
	}
	return out
}

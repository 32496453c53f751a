package cache

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// fakeBacking serves synthetic table bytes from memory, one goroutine per
// read (as an engine completes reads on its own goroutine), and lets a test
// hold reads, fail pages and count what reached it.
type fakeBacking struct {
	mu       sync.Mutex
	submits  int                  // Submit calls
	reads    []*backing.TableRead // every read, in order
	failEIO  map[int64]int        // data page -> failures left (-1: forever)
	changed  bool                 // every read fails with ErrShardChanged
	short    bool                 // answers one byte short, without an error
	hold     func(r *backing.TableRead) bool
	released chan struct{} // held reads go on once this closes
}

func newFakeBacking() *fakeBacking {
	return &fakeBacking{failEIO: map[int64]int{}, released: make(chan struct{})}
}

func (f *fakeBacking) Submit(reads ...*backing.TableRead) {
	f.mu.Lock()
	f.submits++
	f.reads = append(f.reads, reads...)
	f.mu.Unlock()
	for _, r := range reads {
		go func() {
			if f.hold != nil && f.hold(r) {
				<-f.released
			}
			r.Done(f.answer(r))
		}()
	}
}

func (f *fakeBacking) answer(r *backing.TableRead) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.changed {
		return nil, fmt.Errorf("test: %w", backing.ErrShardChanged)
	}
	for p := r.Off / PageSize; p <= (r.Off+int64(r.Len)-1)/PageSize; p++ {
		if n := f.failEIO[p]; n != 0 {
			if n > 0 {
				f.failEIO[p] = n - 1
			}
			return nil, fmt.Errorf("test: data page %d: %w", p, syscall.EIO)
		}
	}
	b := make([]byte, r.Len)
	backing.FillSynth(b, backing.NameKey(1, r.Table.Name), r.Off)
	if f.short {
		return b[:len(b)-1], nil
	}
	return b, nil
}

func (f *fakeBacking) readCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.reads)
}

// testTable has a one-page header and dataPages pages of data, the last
// one short.
func testTable(dataPages int) *backing.Table {
	dataLen := int64(dataPages-1)*PageSize + 100
	return &backing.Table{Name: "t0", FileHeader: make([]byte, PageSize), DataLen: dataLen, FileSize: PageSize + dataLen}
}

// wantPage checks page p (a file page) of t against the synthetic bytes.
func wantPage(t *testing.T, tb *backing.Table, p uint64, got []byte) {
	t.Helper()
	off := int64(p-tb.DataPage()) * PageSize
	want := make([]byte, min(PageSize, tb.DataLen-off))
	backing.FillSynth(want, backing.NameKey(1, tb.Name), off)
	if !bytes.Equal(got, want) {
		t.Fatalf("page %d: %d bytes, not the table's %d", p, len(got), len(want))
	}
}

// N concurrent loads of one page read backing once, and all get its bytes.
func TestLoaderSingleflight(t *testing.T) {
	tb := testTable(8)
	fb := newFakeBacking()
	fb.hold = func(*backing.TableRead) bool { return true }
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	const n = 16
	var wg sync.WaitGroup
	var joined atomic.Int32
	results := make([][]byte, n)
	for i := range n {
		wg.Go(func() {
			joined.Add(1)
			pages, err := l.Load(0, 3, 1, OriginFault)
			if err != nil {
				t.Error(err)
				return
			}
			results[i] = pages[0]
		})
	}
	// Every loader has registered once its flight has n waiters.
	waitUntilLoader(t, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		fl := l.flights[PageKey{Page: 3}]
		return fl != nil && len(fl.waiters) == n
	})
	close(fb.released)
	within(t, "the loads", wg.Wait)
	if r := fb.readCount(); r != 1 {
		t.Fatalf("%d loads of one page made %d backing reads, want 1", n, r)
	}
	for _, got := range results {
		wantPage(t, tb, 3, got)
	}
}

// One Fetch of many runs hands backing every read in one batch, coalescing
// adjacent pages, and calls done once per page.
func TestLoaderFetchBatches(t *testing.T) {
	tb := testTable(600)
	fb := newFakeBacking()
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	runs := []Run{{First: 1, N: 3}, {First: 10, N: 1}, {First: 20, N: MaxRunPages + 5}, {First: 598, N: 2}}
	var mu sync.Mutex
	seen := map[uint64]int{}
	var wg sync.WaitGroup
	total := 0
	for _, r := range runs {
		total += int(r.N)
	}
	wg.Add(total)
	l.Fetch(runs, OriginPrefetch, func(r Run, pages [][]byte, err error) {
		if err != nil {
			t.Error(err)
		}
		mu.Lock()
		defer mu.Unlock()
		for i, p := range pages {
			seen[r.First+uint64(i)]++
			wantPage(t, tb, r.First+uint64(i), p)
			wg.Done()
		}
	})
	within(t, "the loads", wg.Wait)
	if fb.submits != 1 {
		t.Fatalf("%d Submit calls for one Fetch, want 1", fb.submits)
	}
	if got := fb.readCount(); got != 5 { // 3 + 1 + (256, 5) + 2 pages
		t.Fatalf("%d backing reads, want 5 (adjacent pages coalesced, at most %d a read)", got, MaxRunPages)
	}
	for p, n := range seen {
		if n != 1 {
			t.Fatalf("page %d reported %d times", p, n)
		}
	}
}

// A run with one bad page: the good pages land, only the bad one fails, and
// a fault that joined a good page of the failing run hears as soon as its
// own page is read, not after the whole retry.
func TestLoaderBadPageFailsOnlyItself(t *testing.T) {
	tb := testTable(64)
	fb := newFakeBacking()
	fb.failEIO[7] = -1 // data page 7 = file page 8
	// Hold the bad page's own retry read until the test is done with the
	// fault on page 20: the fault must not wait for it.
	fb.hold = func(r *backing.TableRead) bool { return r.Len == PageSize && r.Off == 7*PageSize }
	st := &stats.Counters{}
	l := NewLoader(fb, []*backing.Table{tb}, st)
	got := make(chan error, 64)
	var bad atomic.Int32
	l.Fetch([]Run{{First: 1, N: 63}}, OriginPrefetch, func(r Run, pages [][]byte, err error) {
		for i := range r.N {
			if err != nil {
				if r.First+i != 8 || !errors.Is(err, syscall.EIO) {
					t.Errorf("page %d: %v", r.First+i, err)
				}
				bad.Add(1)
			} else {
				wantPage(t, tb, r.First+i, pages[i])
			}
			got <- err
		}
	})
	pages, err := load(t, l, 0, 20, 1, OriginFault)
	if err != nil {
		t.Fatalf("a good page of a failing run: %v", err)
	}
	wantPage(t, tb, 20, pages[0])
	close(fb.released)
	within(t, "the fetch's 63 pages", func() {
		for range 63 {
			<-got
		}
	})
	if bad.Load() != 1 {
		t.Fatalf("%d pages failed, want 1", bad.Load())
	}
	// One failed run read, then a read per page. The fault on page 20 reads
	// again only when it came after the retry had delivered that page (a
	// busy machine can run the whole retry first): its own single read.
	fb.mu.Lock()
	own := 0
	for _, r := range fb.reads {
		if r.Off == 19*PageSize && r.Len == PageSize {
			own++
		}
	}
	total := len(fb.reads)
	fb.mu.Unlock()
	if own < 1 || own > 2 || total-(own-1) != 1+63 {
		t.Fatalf("%d backing reads (%d of page 20 alone), want 64 besides a late fault's own read", total, own)
	}
}

// A changed shard fails every page of the run at once: no page-by-page
// retry, and no negative cache (the next read checks again).
func TestLoaderShardChangedNotRetried(t *testing.T) {
	tb := testTable(64)
	fb := newFakeBacking()
	fb.changed = true
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	pages, err := load(t, l, 0, 1, 40, OriginFault)
	if !errors.Is(err, backing.ErrShardChanged) {
		t.Fatalf("got %v, want ErrShardChanged", err)
	}
	for i, p := range pages {
		if p != nil {
			t.Fatalf("page %d has data", i)
		}
	}
	if r := fb.readCount(); r != 1 {
		t.Fatalf("%d backing reads, want 1", r)
	}
	if _, err := load(t, l, 0, 1, 1, OriginFault); !errors.Is(err, backing.ErrShardChanged) || fb.readCount() != 2 {
		t.Fatalf("second load: %v after %d reads, want a new read", err, fb.readCount())
	}
}

// A page that failed fails again at once for NegativeTTL, then is read
// again: a failure once, then success, returns the data (no error sticks).
func TestLoaderNegativeCache(t *testing.T) {
	tb := testTable(16)
	fb := newFakeBacking()
	fb.failEIO[2] = 1 // fails once
	st := &stats.Counters{}
	l := NewLoader(fb, []*backing.Table{tb}, st)
	now := time.Unix(1000, 0)
	var clock sync.Mutex
	l.now = func() time.Time { clock.Lock(); defer clock.Unlock(); return now }
	if _, err := load(t, l, 0, 3, 1, OriginFault); !errors.Is(err, syscall.EIO) {
		t.Fatalf("first load: %v, want EIO", err)
	}
	for range 100 {
		if _, err := load(t, l, 0, 3, 1, OriginFault); !errors.Is(err, syscall.EIO) {
			t.Fatalf("load within the TTL: %v, want EIO", err)
		}
	}
	if r, ff := fb.readCount(), st.BackingFailFast.Load(); r != 1 || ff != 100 {
		t.Fatalf("%d backing reads and %d fail-fast pages, want 1 and 100", r, ff)
	}
	// Its neighbours are not affected.
	if _, err := load(t, l, 0, 4, 1, OriginFault); err != nil {
		t.Fatal(err)
	}
	clock.Lock()
	now = now.Add(NegativeTTL)
	clock.Unlock()
	pages, err := load(t, l, 0, 3, 1, OriginFault)
	if err != nil {
		t.Fatalf("after the TTL: %v, want the data (the fault was transient)", err)
	}
	wantPage(t, tb, 3, pages[0])
}

// A short answer without an error is never data.
func TestLoaderShortReadIsAnError(t *testing.T) {
	tb := testTable(16)
	fb := newFakeBacking()
	fb.short = true
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	pages, err := load(t, l, 0, 2, 4, OriginFault)
	if err == nil {
		t.Fatal("a short backing answer was accepted")
	}
	for i, p := range pages {
		if p != nil {
			t.Fatalf("page %d has data", i)
		}
	}
}

func TestLoaderRefusesHeaderAndOutOfRange(t *testing.T) {
	tb := testTable(16)
	fb := newFakeBacking()
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	for _, r := range []Run{{First: 0, N: 1}, {First: 16, N: 2}, {First: 1, N: 0}, {Table: 3, First: 1, N: 1}, {First: 1, N: ^uint64(0)}} {
		called := 0
		l.Fetch([]Run{r}, OriginFault, func(got Run, pages [][]byte, err error) {
			called++
			if err == nil || got != r {
				t.Errorf("run %+v: done(%+v, %v)", r, got, err)
			}
		})
		if called != 1 {
			t.Errorf("run %+v: done called %d times", r, called)
		}
	}
	if fb.readCount() != 0 {
		t.Fatalf("%d reads reached backing", fb.readCount())
	}
}

// Many overlapping fetches and loads at once: every page reported exactly
// once per asker, every byte right, and no page read twice while in flight.
func TestLoaderConcurrentOverlaps(t *testing.T) {
	tb := testTable(300)
	fb := newFakeBacking()
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 9))
			for range 200 {
				first := 1 + rng.Uint64N(290)
				n := 1 + rng.Uint64N(min(9, 300-first))
				if rng.IntN(2) == 0 {
					pages, err := l.Load(0, first, n, OriginFault)
					if err != nil {
						t.Error(err)
						return
					}
					for i, p := range pages {
						wantPage(t, tb, first+uint64(i), p)
					}
					continue
				}
				var left sync.WaitGroup
				left.Add(int(n))
				counts := make([]atomic.Int32, n)
				l.Fetch([]Run{{First: first, N: n}}, OriginPrefetch, func(r Run, pages [][]byte, err error) {
					if err != nil {
						t.Error(err)
					}
					for i := range r.N {
						counts[r.First+i-first].Add(1)
						wantPage(t, tb, r.First+i, pages[i])
						left.Done()
					}
				})
				left.Wait()
				for i := range counts {
					if c := counts[i].Load(); c != 1 {
						t.Errorf("page %d reported %d times", first+uint64(i), c)
					}
				}
			}
		})
	}
	within(t, "the loads", wg.Wait)
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.flights) != 0 {
		t.Fatalf("%d flights left over", len(l.flights))
	}
}

// waitFor polls cond until it holds (or fails after a long time: this
// machine may be busy, so the bound is generous and never the assertion).
func waitUntilLoader(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 30 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// syncFake is a fakeBacking that can also read on the caller's goroutine,
// holding every such read until released, and counts them.
type syncFake struct {
	*fakeBacking
	inline, most atomic.Int32
	syncs        atomic.Int32
}

func (s *syncFake) ReadSync(reads ...*backing.TableRead) {
	n := s.inline.Add(1)
	for m := s.most.Load(); n > m && !s.most.CompareAndSwap(m, n); m = s.most.Load() {
	}
	s.syncs.Add(1)
	<-s.released
	for _, r := range reads {
		r.Done(s.answer(r))
	}
	s.inline.Add(-1)
}

// Faults read on their own goroutine (no hand-off) only while few do: with
// many at once, the rest go to the engine together, and every fault still
// gets its bytes.
func TestLoaderInlineFaultsAreBounded(t *testing.T) {
	tb := testTable(64)
	fb := &syncFake{fakeBacking: newFakeBacking()}
	fb.hold = func(*backing.TableRead) bool { return true }
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	faults := 4*int(maxInline) + 4
	var wg sync.WaitGroup
	for i := range faults {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := tb.DataPage() + uint64(i)
			pages, err := l.Load(0, p, 1, OriginFault)
			if err != nil {
				t.Error(err)
				return
			}
			wantPage(t, tb, p, pages[0])
		}()
	}
	waitUntilLoader(t, func() bool { return int(fb.syncs.Load())+fb.readCount() == faults })
	close(fb.released)
	within(t, "the loads", wg.Wait)
	if most := fb.most.Load(); most > maxInline || most == 0 {
		t.Errorf("%d faults read inline at once, want 1 to %d", most, maxInline)
	}
	if fb.readCount() < faults-int(maxInline) {
		t.Errorf("%d faults went to the engine, want at least %d", fb.readCount(), faults-int(maxInline))
	}
}

// fetchHeldAll runs a FetchHeld of runs and waits for every page's answer.
func fetchHeldAll(t *testing.T, l *Loader, runs ...Run) {
	t.Helper()
	var want uint64
	for _, r := range runs {
		want += r.N
	}
	var mu sync.Mutex
	got := uint64(0)
	all := make(chan error, 1)
	l.FetchHeld(runs, OriginPrefetch, func(r Run, pages [][]byte, err error) {
		mu.Lock()
		defer mu.Unlock()
		if got += r.N; err != nil || got == want {
			select {
			case all <- err:
			default:
			}
		}
	})
	if err := <-all; err != nil {
		t.Fatal(err)
	}
}

// A fault on a page a prefetch has read but not yet stored gets that read's
// bytes without a backing read of its own, until the prefetch releases the
// page; after that it reads backing (the page cache no longer has it).
func TestLoaderHeldPagesServeFaultsUntilReleased(t *testing.T) {
	tb := testTable(16)
	fb := newFakeBacking()
	st := &stats.Counters{}
	l := NewLoader(fb, []*backing.Table{tb}, st)
	// load faults pages [first, first+n) in and checks their bytes.
	load := func(first, n uint64) {
		t.Helper()
		pages, err := load(t, l, 0, first, n, OriginFault)
		if err != nil {
			t.Fatal(err)
		}
		for i, p := range pages {
			wantPage(t, tb, first+uint64(i), p)
		}
	}
	fetchHeldAll(t, l, Run{First: 3, N: 4}) // pages 3-6, one read
	if r := fb.readCount(); r != 1 {
		t.Fatalf("%d backing reads for one run, want 1", r)
	}
	load(3, 1)
	load(6, 1)
	load(6, 2) // a held page and one nobody read: reads only the other
	if r, served := fb.readCount(), st.PrefetchLateServed.Load(); r != 2 || served != 3 {
		t.Fatalf("%d backing reads and %d pages served from the hold, want 2 (the run, page 7) and 3", r, served)
	}
	l.Release(Run{First: 3, N: 2}) // pages 3 and 4
	load(3, 1)
	load(5, 1)
	if r := fb.readCount(); r != 3 {
		t.Fatalf("%d backing reads, want 3: a released page is read again, a held one is not", r)
	}
	l.Release(Run{First: 5, N: 2})
	l.mu.Lock()
	left := len(l.held)
	l.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d pages still held after every run was released", left)
	}
	// A plain Fetch (a fault's) holds nothing.
	load(9, 1)
	load(9, 1)
	if r := fb.readCount(); r != 5 {
		t.Fatalf("%d backing reads, want 5: a fault's page is not held", r)
	}
}

// A prefetch whose read failed holds nothing: the fault that follows reads
// backing itself (and gets the data once the page reads again).
func TestLoaderFailedHeldReadHoldsNothing(t *testing.T) {
	tb := testTable(16)
	fb := newFakeBacking()
	fb.failEIO[2] = 1 // data page 2 = file page 3: fails once
	l := NewLoader(fb, []*backing.Table{tb}, &stats.Counters{})
	l.FetchHeld([]Run{{First: 3, N: 1}}, OriginPrefetch, func(r Run, pages [][]byte, err error) {})
	waitUntilLoader(t, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return len(l.flights) == 0
	})
	l.mu.Lock()
	held := len(l.held)
	delete(l.negative, PageKey{Page: 3}) // past the negative cache's TTL
	l.mu.Unlock()
	if held != 0 {
		t.Fatalf("%d pages held after a failed read, want 0", held)
	}
	pages, err := load(t, l, 0, 3, 1, OriginFault)
	if err != nil {
		t.Fatal(err)
	}
	wantPage(t, tb, 3, pages[0])
}

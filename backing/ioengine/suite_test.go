package ioengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Every engine kind runs the same suite, as stargz-snapshotter runs
// TestSuiteLayer against each of its readers: the contract is the engine's
// behaviour, not its implementation.
func TestSuitePread(t *testing.T) { testSuite(t, "pread") }
func TestSuiteUring(t *testing.T) { testSuite(t, "io_uring") }

func testSuite(t *testing.T, kind string) {
	for _, c := range []struct {
		name string
		fn   func(*testing.T, string)
	}{
		{"RandomReads", testRandomReads},
		{"PastEOF", testPastEOF},
		{"BadFdFailsOnlyItsReq", testBadFd},
		{"DoneSubmits", testDoneSubmits},
		{"ShortReadsContinue", testShortReadsContinue},
		{"FIFOBeyondDepth", testFIFOBeyondDepth},
		{"DemandFirst", testDemandFirst},
		{"ConcurrentSubmitters", testConcurrentSubmitters},
		{"CloseInFlightAndQueued", testCloseInFlightAndQueued},
		{"SubmitAfterClose", testSubmitAfterClose},
		{"ZeroLength", testZeroLength},
	} {
		t.Run(c.name, func(t *testing.T) { c.fn(t, kind) })
	}
}

// testFile is a file of random bytes with a size that is not a multiple of
// any alignment, so reads can straddle EOF.
type testFile struct {
	path string
	data []byte
}

func newTestFile(t testing.TB, size int) testFile {
	t.Helper()
	data := make([]byte, size+7)
	rng := rand.New(rand.NewPCG(uint64(size), 7))
	for i := 0; i < size; i += 8 {
		binary.LittleEndian.PutUint64(data[i:], rng.Uint64())
	}
	data = data[:size]
	path := filepath.Join(t.TempDir(), "shard")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return testFile{path, data}
}

// mode is how a test opens its file: buffered, or O_DIRECT with an
// alignment (the file system's STATX_DIOALIGN, or the 4096 callers use).
type mode struct {
	name   string
	direct bool
	align  int
}

func modes(t *testing.T, path string) []mode {
	ms := []mode{{name: "buffered", align: 1}}
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_DIOALIGN, &st); err != nil ||
		st.Mask&unix.STATX_DIOALIGN == 0 || st.Dio_mem_align == 0 {
		t.Logf("%s: no STATX_DIOALIGN (%v): O_DIRECT modes not run", path, err)
		return ms
	}
	a := int(max(st.Dio_mem_align, st.Dio_offset_align))
	ms = append(ms, mode{fmt.Sprintf("direct-dioalign%d", a), true, a})
	if a != 4096 {
		ms = append(ms, mode{"direct-4096", true, 4096})
	}
	return ms
}

func open(t testing.TB, path string, direct bool) int {
	t.Helper()
	flags := unix.O_RDONLY | unix.O_CLOEXEC
	if direct {
		flags |= unix.O_DIRECT
	}
	fd, err := unix.Open(path, flags, 0)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// alignedBuf returns n bytes starting at a multiple of align.
func alignedBuf(n, align int) []byte {
	b := make([]byte, n+align)
	skip := (align - int(uintptr(unsafe.Pointer(&b[0])))%align) % align
	return b[skip : skip+n : skip+n]
}

func newEngine(t testing.TB, kind string, depth int) Engine {
	t.Helper()
	e, reason, err := New(kind, depth)
	if err != nil {
		if kind == "io_uring" {
			t.Skipf("io_uring unavailable here: %v", err)
		}
		t.Fatal(err)
	}
	if reason != "" {
		t.Logf("fallback: %s", reason)
	}
	if e.Name() != kind && kind != "auto" {
		t.Fatalf("New(%q).Name() = %q", kind, e.Name())
	}
	return e
}

// result records one Done call; calls counts them so a second call is seen.
type result struct {
	n     int
	err   error
	calls atomic.Int32
}

// track makes reqs whose Done records into results and counts down wg.
func track(reqs []*Req, wg *sync.WaitGroup) []*result {
	res := make([]*result, len(reqs))
	wg.Add(len(reqs))
	for i, r := range reqs {
		res[i] = &result{}
		r.Done = func(n int, err error) {
			res[i].n, res[i].err = n, err
			if res[i].calls.Add(1) == 1 {
				wg.Done()
			}
		}
	}
	return res
}

// wait fails the test instead of hanging it when a Done never comes.
func wait(t testing.TB, wg *sync.WaitGroup) {
	t.Helper()
	ch := make(chan struct{})
	go func() { wg.Wait(); close(ch) }()
	select {
	case <-ch:
	case <-time.After(60 * time.Second):
		t.Fatal("timed out waiting for Done calls")
	}
}

// checkRead asserts a read returned exactly the file's bytes.
func checkRead(t testing.TB, f testFile, r *Req, res *result, wantN int) {
	t.Helper()
	if c := res.calls.Load(); c != 1 {
		t.Errorf("read %d+%d: Done called %d times", r.Off, len(r.Buf), c)
		return
	}
	if res.err != nil || res.n != wantN {
		t.Errorf("read %d+%d: n=%d err=%v, want n=%d err=nil", r.Off, len(r.Buf), res.n, res.err, wantN)
		return
	}
	if wantN > 0 && !bytes.Equal(r.Buf[:wantN], f.data[r.Off:r.Off+int64(wantN)]) {
		t.Errorf("read %d+%d: wrong bytes", r.Off, len(r.Buf))
	}
}

// randomReqs makes n aligned reads of 1-16 units (a few of 1 MiB) inside the
// file, in whole units of align.
func randomReqs(rng *rand.Rand, fd int, f testFile, m mode, n int) []*Req {
	unit := max(m.align, 512)
	if !m.direct {
		unit = 1 + rng.IntN(4096) // buffered reads need no alignment: use odd sizes
	}
	reqs := make([]*Req, n)
	for i := range reqs {
		size := unit * (1 + rng.IntN(16))
		if rng.IntN(200) == 0 {
			size = 1 << 20
		}
		off := int64(rng.IntN((len(f.data)-size)/unit)) * int64(unit)
		if !m.direct {
			off = int64(rng.IntN(len(f.data) - size))
		}
		reqs[i] = &Req{Fd: fd, Off: off, Buf: alignedBuf(size, m.align)}
	}
	return reqs
}

func testRandomReads(t *testing.T, kind string) {
	f := newTestFile(t, 16<<20+1234)
	for _, m := range modes(t, f.path) {
		t.Run(m.name, func(t *testing.T) {
			fd := open(t, f.path, m.direct)
			e := newEngine(t, kind, 32)
			defer e.Close()
			rng := rand.New(rand.NewPCG(1, 2))
			reqs := randomReqs(rng, fd, f, m, 3000)
			var wg sync.WaitGroup
			res := track(reqs, &wg)
			for i := 0; i < len(reqs); {
				n := min(1+rng.IntN(100), len(reqs)-i)
				e.Submit(reqs[i : i+n]...)
				i += n
			}
			wait(t, &wg)
			for i, r := range reqs {
				checkRead(t, f, r, res[i], len(r.Buf))
			}
		})
	}
}

func testPastEOF(t *testing.T, kind string) {
	f := newTestFile(t, 1<<20+1000) // EOF in the middle of a page
	for _, m := range modes(t, f.path) {
		t.Run(m.name, func(t *testing.T) {
			fd := open(t, f.path, m.direct)
			e := newEngine(t, kind, 4)
			defer e.Close()
			size := int64(len(f.data))
			page := int64(max(m.align, 4096))
			lastPage := size / page * page
			cases := []struct {
				off  int64
				len  int64
				want int64
			}{
				{lastPage, page, size - lastPage},                   // straddles EOF
				{lastPage - page, 3 * page, size - lastPage + page}, // starts before, ends past
				{lastPage + page, page, 0},                          // wholly past EOF
				{1 << 30, page, 0},                                  // far past EOF
			}
			reqs := make([]*Req, len(cases))
			for i, c := range cases {
				reqs[i] = &Req{Fd: fd, Off: c.off, Buf: alignedBuf(int(c.len), m.align)}
			}
			var wg sync.WaitGroup
			res := track(reqs, &wg)
			e.Submit(reqs...)
			wait(t, &wg)
			for i, c := range cases {
				checkRead(t, f, reqs[i], res[i], int(c.want))
			}
		})
	}
}

func testBadFd(t *testing.T, kind string) {
	f := newTestFile(t, 1<<20)
	fd := open(t, f.path, false)
	dir := open(t, t.TempDir(), false)
	e := newEngine(t, kind, 8)
	defer e.Close()
	var reqs []*Req
	bad := map[int]syscall.Errno{}
	for i := range 24 {
		r := &Req{Fd: fd, Off: int64(i) * 4096, Buf: make([]byte, 4096)}
		switch i {
		case 5:
			r.Fd, bad[i] = -1, unix.EBADF
		case 17:
			r.Fd, bad[i] = dir, unix.EISDIR
		}
		reqs = append(reqs, r)
	}
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	e.Submit(reqs...) // one batch: the bad ones sit between good ones
	wait(t, &wg)
	for i, r := range reqs {
		if want, ok := bad[i]; ok {
			if !errors.Is(res[i].err, want) || res[i].calls.Load() != 1 {
				t.Errorf("req %d: n=%d err=%v calls=%d, want %v once", i, res[i].n, res[i].err, res[i].calls.Load(), want)
			}
			continue
		}
		checkRead(t, f, r, res[i], len(r.Buf))
	}
}

// testDoneSubmits reads the file as chains in which each Done submits the
// next read: Submit from inside Done must neither deadlock nor lose reads,
// at a depth of 1 (the slot the Done frees is the only one) and more.
func testDoneSubmits(t *testing.T, kind string) {
	f := newTestFile(t, 1<<20)
	fd := open(t, f.path, false)
	for _, depth := range []int{1, 4} {
		t.Run(fmt.Sprint("depth", depth), func(t *testing.T) {
			e := newEngine(t, kind, depth)
			defer e.Close()
			const chains, steps = 8, 64
			got := make([][]byte, chains)
			var wg sync.WaitGroup
			wg.Add(chains)
			var failed atomic.Value
			for c := range chains {
				got[c] = make([]byte, 0, steps*4096)
				var next func(step int)
				next = func(step int) {
					if step == steps {
						wg.Done()
						return
					}
					buf := make([]byte, 4096)
					off := int64((c*steps + step) % 256 * 4096)
					e.Submit(&Req{Fd: fd, Off: off, Buf: buf, Done: func(n int, err error) {
						if err != nil || n != len(buf) {
							failed.Store(fmt.Sprintf("chain %d step %d: n=%d err=%v", c, step, n, err))
						}
						got[c] = append(got[c], buf[:n]...)
						next(step + 1)
					}})
				}
				next(0)
			}
			wait(t, &wg)
			if v := failed.Load(); v != nil {
				t.Fatal(v)
			}
			for c := range chains {
				for step := range steps {
					off := (c*steps + step) % 256 * 4096
					if !bytes.Equal(got[c][step*4096:(step+1)*4096], f.data[off:off+4096]) {
						t.Fatalf("chain %d step %d: wrong bytes", c, step)
					}
				}
			}
		})
	}
}

// testShortReadsContinue caps each kernel read at one page, so every longer
// read comes back short from the kernel and must be continued, not returned.
func testShortReadsContinue(t *testing.T, kind string) {
	defer func(old int) { maxOpLen = old }(maxOpLen)
	maxOpLen = 4096
	f := newTestFile(t, 1<<20+100)
	for _, m := range modes(t, f.path) {
		t.Run(m.name, func(t *testing.T) {
			fd := open(t, f.path, m.direct)
			e := newEngine(t, kind, 8)
			defer e.Close()
			page := max(m.align, 4096)
			reqs := []*Req{
				{Fd: fd, Off: 0, Buf: alignedBuf(16*page, m.align)},
				{Fd: fd, Off: int64(3 * page), Buf: alignedBuf(5*page, m.align)},
				{Fd: fd, Off: int64(len(f.data) / page * page), Buf: alignedBuf(2*page, m.align)}, // ends past EOF
			}
			want := []int{16 * page, 5 * page, len(f.data) % page}
			var wg sync.WaitGroup
			res := track(reqs, &wg)
			e.Submit(reqs...)
			wait(t, &wg)
			for i, r := range reqs {
				checkRead(t, f, r, res[i], want[i])
			}
			if s := e.(interface{ Stats() Stats }).Stats(); s.Ops < 16+5+2 {
				t.Errorf("stats %+v: want at least 23 kernel reads with one page per read", s)
			}
		})
	}
}

// testFIFOBeyondDepth submits far more reads than the depth in one call. At
// depth 1 the engine is a queue: completions must come in submission order.
func testFIFOBeyondDepth(t *testing.T, kind string) {
	f := newTestFile(t, 4<<20)
	fd := open(t, f.path, false)
	for _, depth := range []int{1, 3} {
		t.Run(fmt.Sprint("depth", depth), func(t *testing.T) {
			e := newEngine(t, kind, depth)
			defer e.Close()
			rng := rand.New(rand.NewPCG(3, uint64(depth)))
			reqs := randomReqs(rng, fd, f, mode{align: 1}, 500)
			var wg sync.WaitGroup
			res := track(reqs, &wg)
			order := recordOrder(reqs)
			e.Submit(reqs...)
			wait(t, &wg)
			for i, r := range reqs {
				checkRead(t, f, r, res[i], len(r.Buf))
			}
			if depth == 1 {
				for i, got := range order() {
					if got != i {
						t.Fatalf("depth 1: completion %d is req %d: not FIFO", i, got)
					}
				}
			}
		})
	}
}

// recordOrder wraps the Done of every req to record the order of
// completions (indexes into reqs); the returned func reads it.
func recordOrder(reqs []*Req) func() []int {
	var mu sync.Mutex
	var order []int
	for i, r := range reqs {
		inner := r.Done
		r.Done = func(n int, err error) {
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			inner(n, err)
		}
	}
	return func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(order)
	}
}

// testDemandFirst: at depth 1, of reads submitted together, the demand ones
// (faults, decode hints) are served first, each class in submission order;
// every read still gets its bytes.
func testDemandFirst(t *testing.T, kind string) {
	f := newTestFile(t, 4<<20)
	fd := open(t, f.path, false)
	e := newEngine(t, kind, 1)
	defer e.Close()
	rng := rand.New(rand.NewPCG(5, 5))
	reqs := randomReqs(rng, fd, f, mode{align: 1}, 300)
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	order := recordOrder(reqs)
	var want []int // demand reads, then the others, each in submission order
	for i, r := range reqs {
		r.Demand = i%7 == 3
		if r.Demand {
			want = append(want, i)
		}
	}
	for i, r := range reqs {
		if !r.Demand {
			want = append(want, i)
		}
	}
	e.Submit(reqs...)
	wait(t, &wg)
	for i, r := range reqs {
		checkRead(t, f, r, res[i], len(r.Buf))
	}
	got := order()
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("completion %d is req %d (demand %v), want req %d (demand %v)", i, got[i], reqs[got[i]].Demand, want[i], reqs[want[i]].Demand)
		}
	}
}

func testConcurrentSubmitters(t *testing.T, kind string) {
	f := newTestFile(t, 8<<20+77)
	for _, m := range modes(t, f.path) {
		t.Run(m.name, func(t *testing.T) {
			fd := open(t, f.path, m.direct)
			e := newEngine(t, kind, 16)
			defer e.Close()
			var wg sync.WaitGroup
			var all [][]*Req
			var allRes [][]*result
			for g := range 8 {
				rng := rand.New(rand.NewPCG(uint64(g), 9))
				reqs := randomReqs(rng, fd, f, m, 400)
				all = append(all, reqs)
				allRes = append(allRes, track(reqs, &wg))
			}
			var start sync.WaitGroup
			start.Add(len(all))
			for g, reqs := range all {
				go func() {
					defer start.Done()
					rng := rand.New(rand.NewPCG(uint64(g), 10))
					for i := 0; i < len(reqs); {
						n := min(1+rng.IntN(20), len(reqs)-i)
						e.Submit(reqs[i : i+n]...)
						i += n
					}
				}()
			}
			start.Wait()
			wait(t, &wg)
			for g, reqs := range all {
				for i, r := range reqs {
					checkRead(t, f, r, allRes[g][i], len(r.Buf))
				}
			}
		})
	}
}

// testCloseInFlightAndQueued closes an engine with a few reads in flight and
// many queued: every Done is called exactly once before Close returns, the
// queued ones with ErrClosed, and nothing completes with wrong bytes.
func testCloseInFlightAndQueued(t *testing.T, kind string) {
	f := newTestFile(t, 8<<20)
	m := modes(t, f.path)[len(modes(t, f.path))-1] // O_DIRECT where possible: slower reads, more in flight
	fd := open(t, f.path, m.direct)
	for round := range 5 {
		e := newEngine(t, kind, 4)
		rng := rand.New(rand.NewPCG(uint64(round), 11))
		reqs := randomReqs(rng, fd, f, m, 2000)
		// Close once the first (small) read is done: the next ones, 1 MiB
		// each and milliseconds long, are then in flight while Close fails
		// the queue.
		reqs[0].Buf = reqs[0].Buf[:m.align]
		for _, r := range reqs[1:9] {
			r.Off, r.Buf = int64(rng.IntN(7))<<20, alignedBuf(1<<20, m.align)
		}
		first := make(chan struct{})
		var calls atomic.Int64
		res := make([]*result, len(reqs))
		for i, r := range reqs {
			res[i] = &result{}
			r.Done = func(n int, err error) {
				res[i].n, res[i].err = n, err
				res[i].calls.Add(1)
				if calls.Add(1) == 1 {
					close(first)
				}
			}
		}
		e.Submit(reqs...)
		<-first
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		if got := calls.Load(); got != int64(len(reqs)) {
			t.Fatalf("round %d: %d of %d Done calls when Close returned", round, got, len(reqs))
		}
		closed := 0
		for i, r := range reqs {
			if errors.Is(res[i].err, ErrClosed) {
				closed++
				if res[i].calls.Load() != 1 || res[i].n != 0 {
					t.Errorf("req %d: ErrClosed with n=%d calls=%d", i, res[i].n, res[i].calls.Load())
				}
				continue
			}
			checkRead(t, f, r, res[i], len(r.Buf))
		}
		if closed == 0 {
			t.Errorf("round %d: no req got ErrClosed: Close did not cancel the queue", round)
		}
		time.Sleep(10 * time.Millisecond)
		for i := range reqs {
			if c := res[i].calls.Load(); c != 1 {
				t.Fatalf("round %d: req %d: Done called %d times after Close", round, i, c)
			}
		}
	}
}

func testSubmitAfterClose(t *testing.T, kind string) {
	e := newEngine(t, kind, 2)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	var gotErr error
	e.Submit(&Req{Fd: 0, Buf: make([]byte, 1), Done: func(n int, err error) { gotErr = err; calls.Add(1) }})
	if calls.Load() != 1 || !errors.Is(gotErr, ErrClosed) {
		t.Fatalf("Submit after Close: calls=%d err=%v, want ErrClosed once", calls.Load(), gotErr)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func testZeroLength(t *testing.T, kind string) {
	f := newTestFile(t, 4096)
	fd := open(t, f.path, false)
	e := newEngine(t, kind, 2)
	defer e.Close()
	reqs := []*Req{{Fd: fd, Off: 100, Buf: []byte{}}, {Fd: fd, Off: 0, Buf: make([]byte, 10)}}
	var wg sync.WaitGroup
	res := track(reqs, &wg)
	e.Submit(reqs...)
	wait(t, &wg)
	checkRead(t, f, reqs[0], res[0], 0)
	checkRead(t, f, reqs[1], res[1], 10)
}

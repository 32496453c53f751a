package backing

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/stats"
)

func TestParseFaultSpec(t *testing.T) {
	for _, c := range []struct {
		in   string
		want FaultSpec
	}{
		{"", FaultSpec{}},
		{"   ", FaultSpec{}},
		{"eio=0.01,short=0.01,latency=2ms,seed=7", FaultSpec{EIOFraction: 0.01, ShortFraction: 0.01, Latency: 2 * time.Millisecond, Seed: 7}},
		{" eio = 1 , seed=0x10 ", FaultSpec{EIOFraction: 1, Seed: 16}},
		{"short=1", FaultSpec{ShortFraction: 1}},
		{"eio=0,latency=0s", FaultSpec{}},
		{"latency=1.5s", FaultSpec{Latency: 1500 * time.Millisecond}},
		{"seed=18446744073709551615", FaultSpec{Seed: 1<<64 - 1}},
	} {
		got, err := ParseFaultSpec(c.in)
		if err != nil || got.String() != c.want.String() || got.FailPages != nil ||
			got.EIOFraction != c.want.EIOFraction || got.ShortFraction != c.want.ShortFraction ||
			got.Latency != c.want.Latency || got.Seed != c.want.Seed {
			t.Errorf("ParseFaultSpec(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
			continue
		}
		// String is the canonical form: it parses back to the same spec.
		again, err := ParseFaultSpec(got.String())
		if err != nil || again.String() != got.String() {
			t.Errorf("String() %q parses to %+v, %v", got.String(), again, err)
		}
	}
	for _, c := range []struct{ in, problem string }{
		{"eio", "not key=value"},
		{"eio=", "not key=value"},
		{"=0.1", "not key=value"},
		{"eio=0.1,", "not key=value"},
		{",eio=0.1", "not key=value"},
		{"eio=0.1;short=0.1", "eio=0.1;short=0.1: strconv.ParseFloat"},
		{"eio=abc", "eio=abc"},
		{"eio=1.5", "not a fraction from 0 to 1"},
		{"short=-0.1", "not a fraction from 0 to 1"},
		{"eio=NaN", "not a fraction from 0 to 1"},
		{"eio=Inf", "not a fraction from 0 to 1"},
		{"latency=fast", "latency=fast"},
		{"latency=5", "missing unit"},
		{"latency=-1ms", "negative duration"},
		{"seed=-1", "seed=-1"},
		{"seed=18446744073709551616", "out of range"},
		{"seed=7.5", "seed=7.5"},
		{"bogus=1", `unknown key "bogus"`},
		{"EIO=0.1", `unknown key "EIO"`},
		{"eio=0.1,eio=0.2", "eio given twice"},
	} {
		got, err := ParseFaultSpec(c.in)
		if err == nil {
			t.Errorf("ParseFaultSpec(%q) accepted: %+v", c.in, got)
			continue
		}
		if !strings.Contains(err.Error(), c.problem) || !strings.Contains(err.Error(), "fault spec") {
			t.Errorf("ParseFaultSpec(%q): error %q does not say %q", c.in, err, c.problem)
		}
	}
}

// memReader serves synthetic table bytes from memory and counts the reads
// that reach it.
type memReader struct{ calls atomic.Int64 }

func (r *memReader) Submit(reads ...*TableRead) { ReaderFunc(r.read).Submit(reads...) }

func (r *memReader) read(t *Table, off int64, n int) ([]byte, error) {
	r.calls.Add(1)
	if off < 0 || n < 0 || off > t.DataLen || int64(n) > t.DataLen-off {
		return nil, fmt.Errorf("table %s: read [%d, +%d) outside its %d data bytes", t.Name, off, n, t.DataLen)
	}
	b := make([]byte, n)
	FillSynth(b, NameKey(1, t.Name), off)
	return b, nil
}

func memTables() []*Table {
	return []*Table{
		{ID: 0, Name: "t0", DataLen: 1 << 24},
		{ID: 1, Name: "t1", DataLen: 1 << 24},
		{ID: 2, Name: "t2", DataLen: 10*PageSize + 100},
	}
}

func TestFaultReaderPassesThrough(t *testing.T) {
	inner := &memReader{}
	st := &stats.Counters{}
	r := NewFaultReader(inner, FaultSpec{Seed: 5}, st)
	for _, tb := range memTables() {
		for _, sp := range []span{{0, 0}, {0, 4096}, {12345, 999}, {tb.DataLen - 1, 1}} {
			got, err := ReadTable(r, tb, sp.off, int(sp.n))
			want, _ := ReadTable(inner, tb, sp.off, int(sp.n))
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("%s [%d, +%d): %v", tb.Name, sp.off, sp.n, err)
			}
		}
		// The inner reader's own errors come through unchanged.
		if _, err := ReadTable(r, tb, tb.DataLen, 1); err == nil || !strings.Contains(err.Error(), "outside its") {
			t.Fatalf("out-of-range read: %v", err)
		}
	}
	if e := st.BackingErrors.Load(); e != 0 {
		t.Fatalf("BackingErrors = %d with no faults", e)
	}
}

func TestFaultReaderEIO(t *testing.T) {
	inner := &memReader{}
	st := &stats.Counters{}
	r := NewFaultReader(inner, FaultSpec{EIOFraction: 1}, st)
	tb := memTables()[1]
	for i := range 100 {
		buf, err := ReadTable(r, tb, int64(i)*PageSize, PageSize)
		if !errors.Is(err, syscall.EIO) || buf != nil {
			t.Fatalf("read %d: %d bytes, %v; want EIO", i, len(buf), err)
		}
		if !strings.Contains(err.Error(), tb.Name) || !strings.Contains(err.Error(), "injected") {
			t.Fatalf("error %q does not name the table and say it is injected", err)
		}
	}
	if inner.calls.Load() != 0 || st.BackingErrors.Load() != 100 {
		t.Fatalf("%d inner reads, %d errors counted; want 0 and 100", inner.calls.Load(), st.BackingErrors.Load())
	}
	// No stats to count into is fine.
	if _, err := ReadTable(NewFaultReader(inner, FaultSpec{EIOFraction: 1}, nil), tb, 0, 1); !errors.Is(err, syscall.EIO) {
		t.Fatal(err)
	}
}

// failSet reads page-aligned pages [0, pages) of each table through r and
// returns which failed with EIO and which came back short.
func failSet(t *testing.T, r Reader, pages int) (eio, short map[[2]int64]bool) {
	t.Helper()
	eio, short = map[[2]int64]bool{}, map[[2]int64]bool{}
	for _, tb := range memTables()[:2] {
		for p := range int64(pages) {
			buf, err := ReadTable(r, tb, p*PageSize, PageSize)
			switch {
			case errors.Is(err, syscall.EIO):
				eio[[2]int64{int64(tb.ID), p}] = true
			case err != nil:
				t.Fatal(err)
			case len(buf) < PageSize:
				short[[2]int64{int64(tb.ID), p}] = true
				want := make([]byte, len(buf))
				FillSynth(want, NameKey(1, tb.Name), p*PageSize)
				if !bytes.Equal(buf, want) {
					t.Fatalf("short read of %s page %d: the bytes it has are wrong", tb.Name, p)
				}
			case len(buf) != PageSize:
				t.Fatalf("read of %d bytes gave %d", PageSize, len(buf))
			}
		}
	}
	return eio, short
}

// Fractions hold over many reads; the draw is a function of (seed, table,
// offset): the same reads fail every time, and another seed picks others.
func TestFaultReaderFractionsDeterministic(t *testing.T) {
	const pages = 4000 // per table, two tables
	spec := FaultSpec{EIOFraction: 0.2, ShortFraction: 0.3, Seed: 42}
	st := &stats.Counters{}
	eio, short := failSet(t, NewFaultReader(&memReader{}, spec, st), pages)
	total := 2 * pages
	if f := float64(len(eio)) / float64(total); f < 0.17 || f > 0.23 {
		t.Errorf("%.3f of reads failed with EIO, want about 0.2", f)
	}
	// A short draw is made only for reads that did not fail: 0.3 of 0.8.
	if f := float64(len(short)) / float64(total-len(eio)); f < 0.27 || f > 0.33 {
		t.Errorf("%.3f of surviving reads were short, want about 0.3", f)
	}
	if got := st.BackingErrors.Load(); got != uint64(len(eio)+len(short)) {
		t.Errorf("BackingErrors = %d, want %d injected", got, len(eio)+len(short))
	}

	// Again, through a new reader with the same seed.
	eio2, short2 := failSet(t, NewFaultReader(&memReader{}, spec, nil), pages)
	if !sameKeys(eio, eio2) || !sameKeys(short, short2) {
		t.Fatal("the same seed spoiled different reads")
	}
	spec.Seed = 43
	eio3, _ := failSet(t, NewFaultReader(&memReader{}, spec, nil), pages)
	common := 0
	for k := range eio3 {
		if eio[k] {
			common++
		}
	}
	// Independent draws share about 0.2 of the failures.
	if common > len(eio)/3 {
		t.Fatalf("seeds 42 and 43 share %d of %d failures", common, len(eio))
	}
}

func sameKeys(a, b map[[2]int64]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

func TestFaultReaderShort(t *testing.T) {
	inner := &memReader{}
	st := &stats.Counters{}
	r := NewFaultReader(inner, FaultSpec{ShortFraction: 1, Seed: 3}, st)
	tb := memTables()[0]
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 500 {
		off, n := rng.Int64N(tb.DataLen-70000), rng.IntN(70000)+1
		buf, err := ReadTable(r, tb, off, n)
		if err != nil || len(buf) >= n || cap(buf) != len(buf) {
			t.Fatalf("read %d [%d, +%d): %d bytes (cap %d), %v; want fewer, no error", i, off, n, len(buf), cap(buf), err)
		}
		want := make([]byte, len(buf))
		FillSynth(want, NameKey(1, tb.Name), off)
		if !bytes.Equal(buf, want) {
			t.Fatalf("read %d: the short read's bytes are wrong", i)
		}
	}
	// An empty read cannot be short.
	if buf, err := ReadTable(r, tb, 10, 0); err != nil || len(buf) != 0 {
		t.Fatalf("empty read: %d bytes, %v", len(buf), err)
	}
	if st.BackingErrors.Load() != 500 || inner.calls.Load() != 501 {
		t.Fatalf("%d errors counted, %d inner reads", st.BackingErrors.Load(), inner.calls.Load())
	}
}

func TestFaultReaderLatency(t *testing.T) {
	const latency = 20 * time.Millisecond
	r := NewFaultReader(&memReader{}, FaultSpec{Latency: latency, EIOFraction: 0.5}, nil)
	tb := memTables()[0]
	for i := range 4 {
		start := time.Now()
		ReadTable(r, tb, int64(i)*PageSize, PageSize)
		if took := time.Since(start); took < latency {
			t.Fatalf("read %d took %v, latency %v", i, took, latency)
		}
	}
}

func TestFaultReaderFailPages(t *testing.T) {
	tables := memTables()
	t1, t2 := tables[1], tables[2]
	spec := FaultSpec{FailPages: map[[2]uint64]bool{{1, 5}: true, {1, 9}: false, {2, 10}: true}}
	st := &stats.Counters{}
	r := NewFaultReader(&memReader{}, spec, st)
	p := int64(PageSize)
	for _, c := range []struct {
		tb   *Table
		off  int64
		n    int64
		fail bool
	}{
		{t1, 5 * p, p, true},
		{t1, 5*p + 100, 1, true},
		{t1, 6*p - 1, 1, true},
		{t1, 5*p - 1, 1, false}, // last byte of page 4
		{t1, 5*p - 1, 2, true},  // straddles into page 5
		{t1, 6 * p, p, false},
		{t1, 0, 5 * p, false}, // ends where page 5 begins
		{t1, 0, 5*p + 1, true},
		{t1, 0, t1.DataLen, true}, // the whole table: more pages than FailPages entries
		{t1, 5 * p, 0, false},     // no bytes, no overlap
		{t1, 9 * p, p, false},     // listed as false
		{tables[0], 5 * p, p, false},
		{t2, 10 * p, 100, true}, // the short last page
		{t2, 9 * p, p, false},
	} {
		buf, err := ReadTable(r, c.tb, c.off, int(c.n))
		if failed := errors.Is(err, syscall.EIO); failed != c.fail || (err != nil && !failed) {
			t.Errorf("%s [%d, +%d): %d bytes, %v; want failure %v", c.tb.Name, c.off, c.n, len(buf), err, c.fail)
		}
		if err != nil && buf != nil {
			t.Errorf("error came with bytes")
		}
	}
	// The same page fails every time.
	for range 3 {
		if _, err := ReadTable(r, t1, 5*p, int(p)); !errors.Is(err, syscall.EIO) {
			t.Fatal("page 5 healed")
		}
	}
}

// failsPage agrees with a page-by-page reading of its definition, by either
// of its two loops, for random maps and reads.
func TestFaultReaderFailPagesProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	tb := &Table{ID: 3, Name: "t3", DataLen: 1 << 22}
	for range 200 {
		fp := map[[2]uint64]bool{}
		for range rng.IntN(40) {
			fp[[2]uint64{uint64(rng.IntN(5)), uint64(rng.IntN(1024))}] = rng.IntN(4) != 0
		}
		f := &faultReader{spec: FaultSpec{FailPages: fp}}
		for range 50 {
			off := rng.Int64N(tb.DataLen)
			n := rng.IntN(int(min(tb.DataLen-off, 200*PageSize)) + 1)
			want := false
			for b := off; b < off+int64(n); b += PageSize - b%PageSize {
				want = want || fp[[2]uint64{3, uint64(b / PageSize)}]
			}
			if got := f.failsPage(tb, off, n); got != want {
				t.Fatalf("failsPage([%d, +%d)) = %v, want %v (map %v)", off, n, got, want, fp)
			}
		}
	}
}

// Over a real store: the fault reader is safe for concurrent use, spoiled
// reads never carry bytes, and the rest are the shard's bytes.
func TestFaultReaderOverStore(t *testing.T) {
	m := loadSynth(t, storeSynth())
	shards := shardBytes(t, m)
	s, st := openStore(t, m, IOBuffered, 4)
	r := NewFaultReader(s, FaultSpec{EIOFraction: 0.3, ShortFraction: 0.2, Seed: 9}, st)
	var wg sync.WaitGroup
	var spoiled, good atomic.Int64
	for w := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range 200 {
				tb := m.Tables[rng.IntN(len(m.Tables))]
				page := rng.Int64N(tb.DataLen / PageSize)
				buf, err := ReadTable(r, tb, page*PageSize, PageSize)
				if err != nil || len(buf) != PageSize {
					if err != nil && buf != nil {
						t.Error("error with bytes")
					}
					spoiled.Add(1)
					continue
				}
				if !bytes.Equal(buf, shards[tb.Shard][tb.DataStart+page*PageSize:][:PageSize]) {
					t.Error("wrong bytes")
				}
				good.Add(1)
			}
		})
	}
	wg.Wait()
	if spoiled.Load() == 0 || good.Load() == 0 || st.BackingErrors.Load() != uint64(spoiled.Load()) {
		t.Fatalf("%d spoiled, %d good, %d errors counted", spoiled.Load(), good.Load(), st.BackingErrors.Load())
	}
}

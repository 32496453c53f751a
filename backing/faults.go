package backing

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/engramfs/engramfs/internal/stats"
)

// FaultSpec says which backing reads a fault-injecting Reader spoils. The
// zero value spoils none.
//
// Whether a read fails is a pure function of (Seed, table ID, data offset):
// the same read fails every time it is retried, so a test can check that
// nothing wrong was cached and that a retry does not "heal" by luck.
type FaultSpec struct {
	EIOFraction   float64       // fraction of data pages that are bad: a read covering one fails with EIO (syscall.EIO wrapped with context)
	ShortFraction float64       // fraction of reads that return fewer bytes than asked (the loader must treat this as an error, never as data)
	Latency       time.Duration // added to every read
	Seed          uint64
	// FailPages: when non-nil, a read fails with EIO iff it covers a data byte range overlapping any listed (table ID, data page index) — deterministic failures for tests.
	FailPages map[[2]uint64]bool
}

// ParseFaultSpec parses a comma-separated list of key=value, e.g.
// "eio=0.01,short=0.01,latency=2ms,seed=7". Keys: eio and short (fractions
// from 0 to 1), latency (a Go duration, not negative), seed (an unsigned
// integer, decimal or 0x hex). "" is no faults. FailPages has no text form.
func ParseFaultSpec(s string) (FaultSpec, error) {
	var spec FaultSpec
	if strings.TrimSpace(s) == "" {
		return spec, nil
	}
	seen := map[string]bool{}
	for _, item := range strings.Split(s, ",") {
		key, value, ok := strings.Cut(item, "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || key == "" || value == "" {
			return FaultSpec{}, fmt.Errorf("fault spec %q: %q is not key=value", s, item)
		}
		if seen[key] {
			return FaultSpec{}, fmt.Errorf("fault spec %q: %s given twice", s, key)
		}
		seen[key] = true
		var err error
		switch key {
		case "eio":
			spec.EIOFraction, err = parseFraction(value)
		case "short":
			spec.ShortFraction, err = parseFraction(value)
		case "latency":
			spec.Latency, err = time.ParseDuration(value)
			if err == nil && spec.Latency < 0 {
				err = fmt.Errorf("negative duration")
			}
		case "seed":
			spec.Seed, err = strconv.ParseUint(value, 0, 64)
		default:
			return FaultSpec{}, fmt.Errorf("fault spec %q: unknown key %q (want eio, short, latency or seed)", s, key)
		}
		if err != nil {
			return FaultSpec{}, fmt.Errorf("fault spec %q: %s=%s: %w", s, key, value, err)
		}
	}
	return spec, nil
}

func parseFraction(v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return 0, err
	}
	if math.IsNaN(f) || f < 0 || f > 1 {
		return 0, fmt.Errorf("%v is not a fraction from 0 to 1", f)
	}
	return f, nil
}

// String is the spec in the form ParseFaultSpec reads, zero fields left
// out; FailPages is not shown.
func (s FaultSpec) String() string {
	var parts []string
	if s.EIOFraction != 0 {
		parts = append(parts, "eio="+strconv.FormatFloat(s.EIOFraction, 'g', -1, 64))
	}
	if s.ShortFraction != 0 {
		parts = append(parts, "short="+strconv.FormatFloat(s.ShortFraction, 'g', -1, 64))
	}
	if s.Latency != 0 {
		parts = append(parts, "latency="+s.Latency.String())
	}
	if s.Seed != 0 {
		parts = append(parts, "seed="+strconv.FormatUint(s.Seed, 10))
	}
	return strings.Join(parts, ",")
}

// faultReader spoils some reads of another Reader as its spec says.
type faultReader struct {
	r    Reader
	spec FaultSpec
	st   *stats.Counters
}

var _ Reader = (*faultReader)(nil)

// NewFaultReader wraps r: reads are delayed by spec.Latency, and those the
// spec picks fail with EIO (without reaching r) or come back short (from r,
// cut, with no error: the lie a broken lower layer would tell; the loader
// must catch it). Each spoiled
// read counts in st.BackingErrors; st may be nil.
func NewFaultReader(r Reader, spec FaultSpec, st *stats.Counters) Reader {
	return &faultReader{r: r, spec: spec, st: st}
}

// Salts keep the EIO and short-read draws of one read independent.
const (
	saltEIO uint64 = iota + 1
	saltShort
	saltShortLen
)

func (f *faultReader) Submit(reads ...*TableRead) {
	pass := make([]*TableRead, 0, len(reads))
	for _, r := range reads {
		t, off, n := r.Table, r.Off, r.Len
		if f.failsPage(t, off, n) || f.badPage(t, off, n) {
			f.count()
			f.later(func() {
				r.Done(nil, fmt.Errorf("table %s: data offset %d: injected fault: %w", t.Name, off, syscall.EIO))
			})
			continue
		}
		done := r.Done
		pass = append(pass, &TableRead{Table: t, Off: off, Len: n, Done: func(buf []byte, err error) {
			if err == nil && len(buf) > 0 && f.draw(saltShort, t, off) < f.spec.ShortFraction {
				f.count()
				k := int(f.hash(saltShortLen, t, off) % uint64(len(buf)))
				buf = buf[:k:k]
			}
			done(buf, err)
		}})
	}
	if len(pass) > 0 {
		f.later(func() { f.r.Submit(pass...) })
	}
}

// later runs fn after the injected latency, on its own goroutine: a slow
// backend delays reads without holding up their submitter.
func (f *faultReader) later(fn func()) {
	if f.spec.Latency <= 0 {
		fn()
		return
	}
	time.AfterFunc(f.spec.Latency, fn)
}

func (f *faultReader) count() {
	if f.st != nil {
		f.st.BackingErrors.Add(1)
	}
}

// failsPage reports whether data bytes [off, off+n) of t overlap a page of
// FailPages.
func (f *faultReader) failsPage(t *Table, off int64, n int) bool {
	if len(f.spec.FailPages) == 0 || n <= 0 || off < 0 {
		return false
	}
	first, last := uint64(off)/PageSize, uint64(off+int64(n)-1)/PageSize
	id := uint64(t.ID)
	if last-first < uint64(len(f.spec.FailPages)) {
		for p := first; p <= last; p++ {
			if f.spec.FailPages[[2]uint64{id, p}] {
				return true
			}
		}
		return false
	}
	for k, bad := range f.spec.FailPages {
		if bad && k[0] == id && k[1] >= first && k[1] <= last {
			return true
		}
	}
	return false
}

// badPage reports whether data bytes [off, off+n) of t cover a page drawn
// bad. The draw is per page, not per read, as with a bad sector: a page fails
// the same way whether a fault reads it alone or a prefetch run covers it.
func (f *faultReader) badPage(t *Table, off int64, n int) bool {
	if f.spec.EIOFraction <= 0 || n <= 0 || off < 0 {
		return false
	}
	for p := off / PageSize; p <= (off+int64(n)-1)/PageSize; p++ {
		if f.draw(saltEIO, t, p*PageSize) < f.spec.EIOFraction {
			return true
		}
	}
	return false
}

// draw is a number in [0, 1), a pure function of the seed, salt, table and
// offset.
func (f *faultReader) draw(salt uint64, t *Table, off int64) float64 {
	return float64(f.hash(salt, t, off)>>11) / (1 << 53)
}

func (f *faultReader) hash(salt uint64, t *Table, off int64) uint64 {
	h := mix64(f.spec.Seed ^ salt*0x9E3779B97F4A7C15)
	h = mix64(h ^ uint64(t.ID))
	return mix64(h ^ uint64(off))
}

// mix64 is the splitmix64 finalizer.
func mix64(z uint64) uint64 {
	z += 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

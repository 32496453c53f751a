package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestPercentile(t *testing.T) {
	var s []time.Duration
	for i := 100; i >= 1; i-- { // unsorted on purpose
		s = append(s, time.Duration(i))
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{
		{0, 1}, {100, 100}, {50, 51}, {99, 99}, {25, 26}, {-5, 1}, {150, 100},
	} {
		// numpy.percentile(range(1, 101), p): 50 -> 50.5, 99 -> 99.01, 25 -> 25.75 (rounded to ns)
		if got := Percentile(s, tc.p); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.p, got, tc.want)
		}
	}
	if s[0] != 100 {
		t.Error("Percentile sorted its argument")
	}
	if got := Percentile(nil, 50); got != 0 {
		t.Errorf("p50 of nothing = %v, want 0", got)
	}
	if got := Percentile([]time.Duration{7}, 99); got != 7 {
		t.Errorf("p99 of one sample = %v, want it", got)
	}
	ms := []time.Duration{10 * time.Millisecond, 20 * time.Millisecond}
	if got := Percentile(ms, 50); got != 15*time.Millisecond {
		t.Errorf("p50 of 10 and 20 ms = %v, want 15ms", got)
	}
}

func TestSummarize(t *testing.T) {
	s := Summarize([]time.Duration{4, 1, 3, 2})
	if s.N != 4 || s.Sum != 10 || s.Mean != 2 || s.Max != 4 || s.P50 != 3 { // p50 2.5 rounds to 3
		t.Errorf("got %+v", s)
	}
	if z := Summarize(nil); z != (Summary{}) {
		t.Errorf("summary of nothing = %+v", z)
	}
}

// TestGuardFaults: a read past the end of a mapped file that shrank is a
// SIGBUS, as a read of a dead mount is; it must come back as an error.
func TestGuardFaults(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(8192); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 8192, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	read := func() (b byte, err error) {
		defer guardFaults(&err)()
		return m[4096], nil
	}
	if _, err := read(); err == nil || !strings.Contains(err.Error(), "SIGBUS") {
		t.Errorf("read of a truncated mapping returned %v, want a SIGBUS error", err)
	}
}

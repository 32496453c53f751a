package cache

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/engramfs/engramfs/internal/pagecache"
	"golang.org/x/sys/unix"
)

// ResidentRun answers the same whether cachestat (windows of up to
// statPages pages) or mincore asks, page for page, against mincore on a
// mapping of the test's own: every window of 1-6 pages over a file whose
// pages are cached in a pattern, and the last page short; and, with pinning
// unavailable (cachestat alone, halving), every window of every size.
func TestResidentRunLookupsAgree(t *testing.T) {
	const pages = 40
	f := coldFile(t, pages*PageSize-100)
	p := newTestPinner(t, f)
	fd, err := os.Open(f.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	if err := unix.Fadvise(int(fd.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(fd.Fd()), 0, int(f.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	cached := func(pg uint64) bool { return pg%3 == 0 || pg%7 == 1 || pg == pages-1 }
	// held reports whether the page cache holds exactly the pattern: the
	// tests package and engramfs bench drop it beside this test at times.
	held := func() bool {
		truth := make([]byte, pages)
		if err := pagecache.Mincore(m, truth); err != nil {
			t.Fatal(err)
		}
		for pg := range uint64(pages) {
			if truth[pg]&1 != 0 != cached(pg) {
				return false
			}
		}
		return true
	}
	maxN := uint64(6)
	check := func() error {
		vec := make([]byte, pages+1)
		for n := uint64(1); n <= maxN; n++ {
			for first := uint64(0); first+n <= pages; first++ {
				clear(vec)
				if !p.ResidentRun(0, first, n, vec) {
					return fmt.Errorf("pages [%d, +%d): cannot tell", first, n)
				}
				for i := range n {
					if vec[i]&1 != 0 != cached(first+i) {
						return fmt.Errorf("page %d: resident %v, want %v", first+i, vec[i]&1, cached(first+i))
					}
				}
			}
		}
		if p.ResidentRun(0, pages-1, 2, vec) {
			return fmt.Errorf("a window past the end of the file answered")
		}
		return nil
	}
	run := func(how string) {
		t.Helper()
		for attempt := 0; ; attempt++ {
			dropCache(t, f.Path)
			for pg := range uint64(pages) {
				if cached(pg) {
					if _, err := fd.ReadAt(make([]byte, 1), int64(pg)*PageSize); err != nil {
						t.Fatal(err)
					}
				}
			}
			if !held() {
				if attempt == 10 {
					t.Skip("the page cache did not keep the pattern in 10 attempts")
				}
				continue
			}
			err := check()
			if err == nil {
				return
			}
			if held() {
				t.Fatalf("%s: %v", how, err)
			}
		}
	}
	run("cachestat")
	if p.readers == nil || p.readers[0] == nil {
		t.Fatal("windows of up to statPages pages did not go through cachestat (no read-through descriptor opened)")
	}
	p.noStat.Store(true)
	run("mincore")
	// Pinning unavailable: no mapping to ask mincore of; cachestat
	// answers every window, halving those partly cached.
	p.noStat.Store(false)
	p.disable(errors.New("test: mlock refused"))
	maxN = pages
	run("cachestat, unpinned")
	p.noStat.Store(true)
	if p.ResidentRun(0, 0, 8, make([]byte, 8)) {
		t.Fatal("unpinned, without cachestat: a window answered")
	}
}

// The cost model chooses a lookup a run for runs spread thin, one window
// for runs packed close, and, without cachestat (a run at a time is then a
// mincore call each), a window sooner.
func TestPerRun(t *testing.T) {
	p := &Pinner{}
	for _, c := range []struct {
		runs, span uint64
		want       bool
	}{
		{72, 2000, true},    // a decode step's scale pages
		{2, 40, true},       // two rows 38 pages apart
		{1000, 3000, false}, // a prefill chunk's runs, 3 pages apart
		{100, 100, false},   // adjacent runs
	} {
		if got := p.PerRun(c.runs, c.span); got != c.want {
			t.Errorf("%d runs over %d pages: per run %v, want %v", c.runs, c.span, got, c.want)
		}
	}
	p.noStat.Store(true)
	if !p.PerRun(72, 2000) || p.PerRun(10, 11) || p.PerRun(30, 40) {
		t.Error("without cachestat: 72 runs over 2,000 pages should still go a run at a time (a mincore each), 10 over 11 pages and 30 over 40 in one window")
	}
}

package warm

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

func synthModel(t *testing.T, rows uint64) *backing.Model {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	spec := backing.DefaultSynth()
	spec.Rows = rows
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// someKeys returns n distinct data pages of m, the tables' in turn (fewer
// if m has fewer).
func someKeys(m *backing.Model, n int) []cache.PageKey {
	var keys []cache.PageKey
	for i, left := 0, true; len(keys) < n && left; {
		left = false
		for _, t := range m.Tables {
			if pg := t.DataPage() + uint64(i); pg < t.Pages() && len(keys) < n {
				keys = append(keys, cache.PageKey{Table: t.ID, Page: pg})
				left = true
			}
		}
		i++
	}
	return keys
}

func TestSaveLoadRoundTrip(t *testing.T) {
	m := synthModel(t, 1000)
	path := filepath.Join(t.TempDir(), "state")
	keys := someKeys(m, 500)
	if err := Save(path, m, keys); err != nil {
		t.Fatal(err)
	}
	got, hdr, err := Load(path, m, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, keys) || hdr.Pages != len(keys) {
		t.Fatalf("loaded %d keys (header %d), want the %d saved, in order", len(got), hdr.Pages, len(keys))
	}
	// At most maxPages, the first ones.
	got, _, err = Load(path, m, 10)
	if err != nil || !slices.Equal(got, keys[:10]) {
		t.Fatalf("Load with maxPages 10: %v, %v", got, err)
	}
	// Saving again replaces the file, leaving no temporary file behind.
	if err := Save(path, m, keys[:3]); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Fatalf("directory holds %d files after two saves, want 1", len(entries))
	}
}

func TestStateOfAnotherModelIsRefused(t *testing.T) {
	m := synthModel(t, 1000)
	other := synthModel(t, 1001) // same names, other row count
	path := filepath.Join(t.TempDir(), "state")
	if err := Save(path, m, someKeys(m, 10)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Load(path, other, 100); !errors.Is(err, ErrOtherModel) {
		t.Fatalf("loading another model's state: %v, want ErrOtherModel", err)
	}
	if _, _, err := Load(filepath.Join(t.TempDir(), "absent"), m, 100); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a missing state file: %v, want os.ErrNotExist", err)
	}
}

func TestDamagedStateIsRefused(t *testing.T) {
	m := synthModel(t, 1000)
	path := filepath.Join(t.TempDir(), "state")
	if err := Save(path, m, someKeys(m, 100)); err != nil {
		t.Fatal(err)
	}
	good, _ := os.ReadFile(path)
	cases := map[string][]byte{
		"truncated":   good[:len(good)-7],
		"bit flipped": append(append([]byte{}, good[:len(good)-20]...), append([]byte{good[len(good)-20] ^ 1}, good[len(good)-19:]...)...),
		"empty":       nil,
		"not a state": []byte("hello, world, this is not a state file at all"),
	}
	for name, b := range cases {
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		if _, _, err := Load(path, m, 1000); err == nil || errors.Is(err, ErrOtherModel) {
			t.Errorf("%s: Load returned %v, want a damage error", name, err)
		}
	}
}

// fakePrefetch settles every page at once, as resident, and tells the tier.
type fakePrefetch struct {
	hot *fakeTier
}

func (f fakePrefetch) SubmitPages(keys []cache.PageKey, sig cache.Signal, b *prefetch.Barrier) {
	f.hot.mu.Lock()
	defer f.hot.mu.Unlock()
	for _, k := range keys {
		if sig == cache.SignalDecode {
			f.hot.pinned[k] = true
		}
	}
	f.hot.batches = append(f.hot.batches, len(keys))
}

type fakeTier struct {
	mu      sync.Mutex
	pinned  map[cache.PageKey]bool
	batches []int
	flushes int
}

func (f *fakeTier) Pinned(k cache.PageKey) bool { f.mu.Lock(); defer f.mu.Unlock(); return f.pinned[k] }
func (f *fakeTier) Flush()                      { f.mu.Lock(); f.flushes++; f.mu.Unlock() }

func TestWarmUpSubmitsInBatchesAsDecode(t *testing.T) {
	m := synthModel(t, 1000)
	keys := someKeys(m, 1000)
	hot := &fakeTier{pinned: map[cache.PageKey]bool{}}
	st := &stats.Counters{}
	var res Result
	w := Start(Config{Keys: keys, BatchPages: 300, Prefetch: fakePrefetch{hot: hot}, Hot: hot, Stats: st,
		Done: func(r Result) { res = r }})
	w.Wait()
	if !slices.Equal(hot.batches, []int{300, 300, 300, 100}) || hot.flushes != 4 {
		t.Fatalf("batches %v, flushes %d; want 300,300,300,100 and a flush after each", hot.batches, hot.flushes)
	}
	if st.WarmPagesTotal.Load() != 1000 || st.WarmPagesDone.Load() != 1000 || len(w.Pending()) != 0 {
		t.Fatalf("progress %d of %d, %d pending; want 1000 of 1000, none", st.WarmPagesDone.Load(), st.WarmPagesTotal.Load(), len(w.Pending()))
	}
	if res.Pages != 1000 || res.Pinned != 1000 {
		t.Fatalf("result %+v, want 1000 pages, all pinned", res)
	}
}

// A state file that names a page many times yields it once: 300,000 copies
// of one key were warmed 16,384 times over (the tier's capacity in pages)
// and reported 16,384 pages pinned, where one was.
func TestLoadSkipsRepeatedPages(t *testing.T) {
	m := synthModel(t, 1000)
	path := filepath.Join(t.TempDir(), "state")
	two := someKeys(m, 2)
	keys := make([]cache.PageKey, 0, 300_001)
	for range 300_000 {
		keys = append(keys, two[0])
	}
	keys = append(keys, two[1])
	if err := Save(path, m, keys); err != nil {
		t.Fatal(err)
	}
	got, _, err := Load(path, m, 300_001)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, two) {
		t.Fatalf("loaded %d keys, want the 2 distinct ones in order", len(got))
	}
	st := &stats.Counters{}
	tier := &fakeTier{pinned: map[cache.PageKey]bool{}}
	res := make(chan Result, 1)
	Start(Config{Keys: got, Prefetch: fakePrefetch{hot: tier}, Hot: tier, Stats: st, Done: func(r Result) { res <- r }})
	if r := <-res; r.Pages != 2 || r.Pinned != 2 || st.WarmPagesTotal.Load() != 2 {
		t.Fatalf("warm-up of a state with one page repeated: %d pages, %d pinned, warm_pages_total %d; want 2, 2, 2",
			r.Pages, r.Pinned, st.WarmPagesTotal.Load())
	}
}

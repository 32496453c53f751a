package backing

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/internal/pagecache"
	"github.com/engramfs/engramfs/internal/stats"
)

var _ Reader = (*Store)(nil)

// storeSynth has tables whose rows straddle pages and whose data starts at
// unaligned shard offsets (Synthesize puts an unrelated tensor first).
func storeSynth() SynthSpec {
	s := DefaultSynth()
	s.Rows, s.WeightRow, s.ScaleRow = 3000, 384, 12
	return s
}

func loadSynth(t testing.TB, spec SynthSpec) *Model {
	t.Helper()
	m, err := Load(synthDir(t, spec), DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// openStore opens m; a direct store is skipped (not failed) only where the
// filesystem refuses O_DIRECT with EINVAL.
func openStore(t testing.TB, m *Model, mode IOMode, queueDepth int) (*Store, *stats.Counters) {
	t.Helper()
	st := &stats.Counters{}
	s, err := openWith(t, m, mode, queueDepth, st)
	if mode == IODirect && errors.Is(err, unix.EINVAL) {
		t.Skipf("O_DIRECT refused here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, st
}

// shardBytes is the whole content of every shard of m, by shard.
func shardBytes(t testing.TB, m *Model) map[*Shard][]byte {
	t.Helper()
	out := map[*Shard][]byte{}
	for _, sh := range m.Shards {
		b, err := os.ReadFile(sh.Path)
		if err != nil {
			t.Fatal(err)
		}
		out[sh] = b
	}
	return out
}

// openWith opens m's shards in mode through a read engine of queueDepth
// (io_uring where it works), closed with the test.
func openWith(t testing.TB, m *Model, mode IOMode, queueDepth int, st *stats.Counters) (*Store, error) {
	t.Helper()
	eng, _, err := ioengine.New("auto", queueDepth)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	return Open(m, NewLocalSource(m.Dir, mode, eng, st), st)
}

// directWorks reports whether m's shards open with O_DIRECT here.
func directWorks(t *testing.T, m *Model) bool {
	s, err := openWith(t, m, IODirect, 1, &stats.Counters{})
	if err != nil {
		return false
	}
	s.Close()
	return true
}

type span struct{ off, n int64 }

// readSpans are the reads each mode is checked with: the edges, the
// loader's whole data pages, and random ranges.
func readSpans(tb *Table, rng *rand.Rand) []span {
	l := tb.DataLen
	spans := []span{{0, 0}, {0, 1}, {0, l}, {l - 1, 1}, {l, 0}, {l / 2, 0}, {1, l - 2},
		{0, min(l, PageSize)}, {PageSize - 1, 2}}
	for p := int64(0); p*PageSize < l; p += 7 {
		spans = append(spans, span{p * PageSize, min(PageSize, l-p*PageSize)})
	}
	for range 150 {
		off := rng.Int64N(l + 1)
		n := rng.Int64N(min(l-off, 3*PageSize) + 1)
		spans = append(spans, span{off, n})
	}
	return spans
}

func TestReadTableBytes(t *testing.T) {
	m := loadSynth(t, storeSynth())
	shards := shardBytes(t, m)
	canDirect := directWorks(t, m)
	for _, mode := range []IOMode{IODirect, IOBuffered, IOAuto} {
		t.Run(string(mode), func(t *testing.T) {
			s, st := openStore(t, m, mode, 4)
			for _, sh := range m.Shards {
				if want := mode == IODirect || (mode == IOAuto && canDirect); s.Direct(sh) != want {
					t.Fatalf("Direct(%s) = %v in mode %s", sh.Name, s.Direct(sh), mode)
				}
			}
			checkTableBytes(t, m, s, st, shards, rand.New(rand.NewPCG(1, uint64(len(mode)))))
		})
	}
}

// Every read engine, and O_DIRECT at 4096-byte alignment whatever the host
// disk says (4K-sector NVMe is the common case in production; this VM's
// disk reports 512), read the same bytes.
func TestReadTableBytesEnginesAndAlignments(t *testing.T) {
	m := loadSynth(t, storeSynth())
	shards := shardBytes(t, m)
	if !directWorks(t, m) {
		t.Skip("O_DIRECT refused here")
	}
	for _, kind := range []string{"io_uring", "pread"} {
		for _, align := range []int64{0, 4096} {
			t.Run(fmt.Sprintf("%s/align%d", kind, align), func(t *testing.T) {
				eng, _, err := ioengine.New(kind, 8)
				if err != nil {
					t.Fatal(err)
				}
				defer eng.Close()
				st := &stats.Counters{}
				src := NewLocalSource(m.Dir, IODirect, eng, st)
				src.forceAlign = align
				s, err := Open(m, src, st)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if got := s.files[m.Shards[0]].(*localShard).align; align != 0 && got != align {
					t.Fatalf("alignment %d, want %d", got, align)
				}
				checkTableBytes(t, m, s, st, shards, rand.New(rand.NewPCG(2, uint64(align))))
			})
		}
	}
}

// checkTableBytes reads spans of every table of m through s and compares
// them with the shard files and the synthetic content.
func checkTableBytes(t *testing.T, m *Model, s *Store, st *stats.Counters, shards map[*Shard][]byte, rng *rand.Rand) {
	t.Helper()
	for _, tb := range m.Tables {
		key := NameKey(1, tb.Name)
		for _, sp := range readSpans(tb, rng) {
			before := st.Snapshot()
			got, err := ReadTable(s, tb, sp.off, int(sp.n))
			if err != nil {
				t.Fatalf("%s [%d, +%d): %v", tb.Name, sp.off, sp.n, err)
			}
			want := shards[tb.Shard][tb.DataStart+sp.off : tb.DataStart+sp.off+sp.n]
			if !bytes.Equal(got, want) {
				t.Fatalf("%s [%d, +%d): bytes differ from the shard's", tb.Name, sp.off, sp.n)
			}
			synth := make([]byte, sp.n)
			FillSynth(synth, key, sp.off)
			if !bytes.Equal(got, synth) {
				t.Fatalf("%s [%d, +%d): bytes are not the table's", tb.Name, sp.off, sp.n)
			}
			checkReadStats(t, s, tb, sp, before, st.Snapshot())
		}
	}
}

// checkReadStats: one backing read per ReadTable; its bytes are exactly the
// range when buffered, the aligned superset under O_DIRECT.
func checkReadStats(t *testing.T, s *Store, tb *Table, sp span, before, after stats.Snapshot) {
	t.Helper()
	reads, got := after.BackingReads-before.BackingReads, int64(after.BackingBytes-before.BackingBytes)
	if reads != 1 || after.BackingErrors != before.BackingErrors {
		t.Fatalf("%s [%d, +%d): %d backing reads, %d errors", tb.Name, sp.off, sp.n, reads, after.BackingErrors-before.BackingErrors)
	}
	if !s.Direct(tb.Shard) {
		if got != sp.n {
			t.Fatalf("%s [%d, +%d): buffered read counted %d bytes", tb.Name, sp.off, sp.n, got)
		}
		return
	}
	align := s.files[tb.Shard].(*localShard).align
	if got < sp.n || got > sp.n+2*align || got%align != 0 {
		t.Fatalf("%s [%d, +%d): direct read counted %d bytes, want a multiple of %d in [n, n+2*%d]", tb.Name, sp.off, sp.n, got, align, align)
	}
}

func TestReadTableConcurrent(t *testing.T) {
	m := loadSynth(t, storeSynth())
	shards := shardBytes(t, m)
	for _, mode := range []IOMode{IODirect, IOBuffered} {
		t.Run(string(mode), func(t *testing.T) {
			s, st := openStore(t, m, mode, 3)
			var wg sync.WaitGroup
			const workers, each = 8, 100
			errs := make(chan error, workers)
			for w := range workers {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(w), 9))
					for range each {
						tb := m.Tables[rng.IntN(len(m.Tables))]
						off := rng.Int64N(tb.DataLen)
						n := rng.Int64N(min(tb.DataLen-off, 2*PageSize)) + 1
						got, err := ReadTable(s, tb, off, int(n))
						if err != nil {
							errs <- err
							return
						}
						if !bytes.Equal(got, shards[tb.Shard][tb.DataStart+off:tb.DataStart+off+n]) {
							errs <- fmt.Errorf("%s [%d, +%d): wrong bytes", tb.Name, off, n)
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			if r := st.BackingReads.Load(); r != workers*each {
				t.Fatalf("%d backing reads, want %d", r, workers*each)
			}
		})
	}
}

func TestReadTableShardChanged(t *testing.T) {
	cases := []struct {
		name   string
		change func(t *testing.T, tb *Table)
		off, n func(tb *Table) int64
	}{
		{"truncated-inside-read", func(t *testing.T, tb *Table) {
			truncate(t, tb.Shard.Path, tb.DataStart+tb.DataLen/2)
		}, func(tb *Table) int64 { return tb.DataLen/2 - 100 }, func(*Table) int64 { return 4096 }},
		{"truncated-after-read", func(t *testing.T, tb *Table) {
			truncate(t, tb.Shard.Path, tb.DataStart+tb.DataLen/2)
		}, func(*Table) int64 { return 0 }, func(*Table) int64 { return 4096 }},
		{"truncated-to-zero", func(t *testing.T, tb *Table) { truncate(t, tb.Shard.Path, 0) },
			func(*Table) int64 { return 0 }, func(*Table) int64 { return 10 }},
		{"truncated-by-one", func(t *testing.T, tb *Table) { truncate(t, tb.Shard.Path, tb.Shard.Size-1) },
			func(tb *Table) int64 { return tb.DataLen - 4096 }, func(*Table) int64 { return 4096 }},
		{"grown", func(t *testing.T, tb *Table) { truncate(t, tb.Shard.Path, tb.Shard.Size+1) },
			func(*Table) int64 { return 0 }, func(*Table) int64 { return 4096 }},
		{"rewritten-same-size", func(t *testing.T, tb *Table) {
			f, err := os.OpenFile(tb.Shard.Path, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.WriteAt(bytes.Repeat([]byte{0xEE}, 8192), tb.DataStart)
			f.Close()
			future := time.Now().Add(time.Hour)
			if err := os.Chtimes(tb.Shard.Path, future, future); err != nil {
				t.Fatal(err)
			}
		}, func(*Table) int64 { return 0 }, func(*Table) int64 { return 4096 }},
		// cp --preserve=timestamps, rsync -t --inplace: new bytes, the old
		// size and mtime. Only ctime tells.
		{"rewritten-mtime-restored", func(t *testing.T, tb *Table) {
			fi, err := os.Stat(tb.Shard.Path)
			if err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(tb.Shard.Path, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.WriteAt(bytes.Repeat([]byte{0xEE}, 8192), tb.DataStart)
			f.Close()
			if err := os.Chtimes(tb.Shard.Path, fi.ModTime(), fi.ModTime()); err != nil {
				t.Fatal(err)
			}
		}, func(*Table) int64 { return 0 }, func(*Table) int64 { return 4096 }},
		{"touched", func(t *testing.T, tb *Table) {
			past := time.Unix(1_000_000_000, 0)
			if err := os.Chtimes(tb.Shard.Path, past, past); err != nil {
				t.Fatal(err)
			}
		}, func(*Table) int64 { return 100 }, func(*Table) int64 { return 1 }},
	}
	for _, c := range cases {
		for _, mode := range []IOMode{IODirect, IOBuffered} {
			t.Run(fmt.Sprintf("%s/%s", c.name, mode), func(t *testing.T) {
				m := loadSynth(t, storeSynth())
				tb := m.Tables[1] // layer 0 weight: the unrelated tensor precedes it, then scale follows
				s, st := openStore(t, m, mode, 2)
				if _, err := ReadTable(s, tb, 0, 4096); err != nil {
					t.Fatalf("before the change: %v", err)
				}
				c.change(t, tb)
				for try := range 2 { // and again: nothing is remembered
					buf, err := ReadTable(s, tb, c.off(tb), int(c.n(tb)))
					if !errors.Is(err, ErrShardChanged) {
						t.Fatalf("try %d: got %d bytes, error %v; want ErrShardChanged", try, len(buf), err)
					}
					if buf != nil {
						t.Fatalf("try %d: error came with %d bytes", try, len(buf))
					}
					for _, want := range []string{tb.Name, tb.Shard.Path} {
						if !strings.Contains(err.Error(), want) {
							t.Errorf("error %q does not name %s", err, want)
						}
					}
					if e := st.BackingErrors.Load(); e != uint64(try+1) {
						t.Fatalf("BackingErrors = %d after %d failed reads", e, try+1)
					}
				}
			})
		}
	}
}

func TestReadTableOutOfRange(t *testing.T) {
	m := loadSynth(t, storeSynth())
	s, st := openStore(t, m, IOBuffered, 1)
	tb := m.Tables[0]
	l := tb.DataLen
	for _, sp := range []span{{-1, 1}, {0, -1}, {l, 1}, {l - 1, 2}, {l + 1, 0}, {0, l + 1},
		{math.MaxInt64, 10}, {math.MaxInt64 - 5, 10}, {10, math.MaxInt}, {math.MinInt64, 1}} {
		buf, err := ReadTable(s, tb, sp.off, int(sp.n))
		if err == nil || buf != nil {
			t.Fatalf("[%d, +%d) of a %d-byte table: got %d bytes, %v", sp.off, sp.n, l, len(buf), err)
		}
		if !strings.Contains(err.Error(), "outside its") || !strings.Contains(err.Error(), tb.Name) {
			t.Fatalf("[%d, +%d): error %q does not say the range is outside the table", sp.off, sp.n, err)
		}
	}
	if snap := st.Snapshot(); snap.BackingReads != 0 || snap.BackingErrors != 0 {
		t.Fatalf("refused requests reached the shard: %+v", snap)
	}
}

func TestOpenRefuses(t *testing.T) {
	for _, mode := range []IOMode{IODirect, IOBuffered, IOAuto} {
		t.Run("changed-since-load/"+string(mode), func(t *testing.T) {
			m := loadSynth(t, smallSynth())
			sh := m.Shards[1]
			truncate(t, sh.Path, sh.Size-1)
			s, err := openWith(t, m, mode, 1, &stats.Counters{})
			if mode == IODirect && errors.Is(err, unix.EINVAL) {
				t.Skip(err)
			}
			if !errors.Is(err, ErrShardChanged) || !strings.Contains(err.Error(), sh.Path) {
				t.Fatalf("got %v, %v; want ErrShardChanged naming %s", s, err, sh.Path)
			}
		})
		t.Run("gone-since-load/"+string(mode), func(t *testing.T) {
			m := loadSynth(t, smallSynth())
			sh := m.Shards[0]
			os.Remove(sh.Path)
			s, err := openWith(t, m, mode, 1, &stats.Counters{})
			if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), sh.Path) {
				t.Fatalf("got %v, %v; want not-exist naming %s", s, err, sh.Path)
			}
		})
	}
}

func TestParseIOMode(t *testing.T) {
	for _, s := range []string{"auto", "direct", "buffered"} {
		if m, err := ParseIOMode(s); err != nil || string(m) != s {
			t.Errorf("ParseIOMode(%q) = %q, %v", s, m, err)
		}
	}
	for _, s := range []string{"", "Direct", "mmap", "o_direct"} {
		if _, err := ParseIOMode(s); err == nil || !strings.Contains(err.Error(), "want auto, direct or buffered") {
			t.Errorf("ParseIOMode(%q): %v", s, err)
		}
	}
}

func TestStoreClose(t *testing.T) {
	m := loadSynth(t, smallSynth())
	s, err := openWith(t, m, IOAuto, 2, &stats.Counters{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	buf, err := ReadTable(s, m.Tables[0], 0, 8)
	if !errors.Is(err, ErrClosed) || buf != nil {
		t.Fatalf("read after Close: %d bytes, %v", len(buf), err)
	}
}

// Reads leave nothing of the shard in the backing page cache: a row is
// cached once, by the mount, not twice. Table data starts at unaligned shard
// offsets, so a 4 KiB data page spans two shard pages, neither wholly read.
func TestReadTableLeavesNoShardPages(t *testing.T) {
	for _, mode := range []IOMode{IODirect, IOBuffered} {
		t.Run(string(mode), func(t *testing.T) {
			m := loadSynth(t, storeSynth())
			s, _ := openStore(t, m, mode, 2)
			for _, tb := range m.Tables {
				if tb.DataStart%PageSize == 0 {
					t.Fatalf("%s starts at an aligned offset: the test proves nothing", tb.Name)
				}
			}
			res := mapShards(t, m)
			for _, tb := range m.Tables {
				for _, sp := range []span{{3 * PageSize, PageSize}, {5 * PageSize, 3 * PageSize}, {100, 12}, {tb.DataLen - 12, 12}} {
					if _, err := ReadTable(s, tb, sp.off, int(sp.n)); err != nil {
						t.Fatal(err)
					}
					if n := res.resident(t, tb.Shard); n != 0 {
						t.Fatalf("%s: after reading [%d, +%d), %d pages of shard %s are in the page cache", tb.Name, sp.off, sp.n, n, tb.Shard.Name)
					}
				}
			}
		})
	}
}

// shardMaps are read-only mappings of the shards of m, whose page cache
// residency mincore reports; each shard starts with none resident.
type shardMaps map[*Shard][]byte

func mapShards(t *testing.T, m *Model) shardMaps {
	t.Helper()
	maps := shardMaps{}
	for _, sh := range m.Shards {
		f, err := os.Open(sh.Path)
		if err != nil {
			t.Fatal(err)
		}
		// Synthesize leaves dirty pages, which FADV_DONTNEED keeps.
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		b, err := unix.Mmap(int(f.Fd()), 0, int(sh.Size), unix.PROT_READ, unix.MAP_SHARED)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Munmap(b) })
		maps[sh] = b
		if n := maps.resident(t, sh); n != 0 {
			t.Skipf("%d pages of %s stay in the page cache after FADV_DONTNEED", n, sh.Path)
		}
	}
	return maps
}

func (maps shardMaps) resident(t *testing.T, sh *Shard) int {
	t.Helper()
	n, err := pagecache.Count(maps[sh])
	if err != nil {
		t.Fatalf("mincore: %v", err)
	}
	return n
}

// Closing the store while reads are in flight and queued: every read is
// answered exactly once, with the right bytes or ErrClosed, never with
// another file's bytes (the fd is closed only after the reads in flight).
func TestStoreCloseWithReadsInFlight(t *testing.T) {
	m := loadSynth(t, storeSynth())
	shards := shardBytes(t, m)
	for _, kind := range []string{"io_uring", "pread"} {
		t.Run(kind, func(t *testing.T) {
			eng, _, err := ioengine.New(kind, 4)
			if err != nil {
				t.Fatal(err)
			}
			defer eng.Close()
			st := &stats.Counters{}
			s, err := Open(m, NewLocalSource(m.Dir, IOAuto, eng, st), st)
			if err != nil {
				t.Fatal(err)
			}
			const n = 2000
			var answered [n]atomic.Int32
			var wg sync.WaitGroup
			wg.Add(n)
			rng := rand.New(rand.NewPCG(3, 4))
			reads := make([]*TableRead, n)
			for i := range reads {
				tb := m.Tables[rng.IntN(len(m.Tables))]
				off := rng.Int64N(tb.DataLen - 64)
				reads[i] = &TableRead{Table: tb, Off: off, Len: 64, Done: func(data []byte, err error) {
					defer wg.Done()
					answered[i].Add(1)
					if err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Errorf("read %d: %v", i, err)
						}
						return
					}
					if want := shards[tb.Shard][tb.DataStart+off : tb.DataStart+off+64]; !bytes.Equal(data, want) {
						t.Errorf("read %d: wrong bytes", i)
					}
				}}
			}
			go s.Submit(reads[:n/2]...)
			go s.Submit(reads[n/2:]...)
			time.Sleep(time.Millisecond)
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			for i := range answered {
				if c := answered[i].Load(); c != 1 {
					t.Fatalf("read %d answered %d times", i, c)
				}
			}
		})
	}
}

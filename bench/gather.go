package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	mfs "github.com/engramfs/engramfs/fs"
)

// rowSource is where one table's rows are gathered from: a shard file or a
// table file of the mount, mapped (data) and/or open (fd).
type rowSource struct {
	t    *backing.Table
	fd   int
	data []byte // the file mapped read-only; nil for pread
	base int64  // offset of row 0 in the file
	key  uint64 // backing.NameKey of the table: what its bytes are
}

func (s *rowSource) rowOff(r uint64) int64 { return s.base + int64(r)*s.t.RowBytes }

// gatherSet is the row sources of every table, by layer index (the order of
// Model.Layers), and what must be released after the phase.
type gatherSet struct {
	layers [][]*rowSource
	maps   [][]byte
	files  []*os.File
}

// close unmaps and closes everything: a phase maps its files afresh, so
// that dropping caches between phases can drop their pages (mapped pages
// are never dropped).
func (g *gatherSet) close() error {
	var errs []error
	for _, m := range g.maps {
		if err := unix.Munmap(m); err != nil {
			errs = append(errs, err)
		}
	}
	for _, f := range g.files {
		if err := f.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	g.maps, g.files = nil, nil
	return errors.Join(errs...)
}

// openShards opens the shard files of m for the paths that read them
// directly: for pread with FADV_RANDOM (advice < 0), or mapped with that
// madvise advice.
func openShards(m *backing.Model, seed uint64, advice int) (*gatherSet, error) {
	g := &gatherSet{}
	type opened struct {
		fd   int
		data []byte
	}
	shards := map[*backing.Shard]opened{}
	for _, sh := range m.Shards {
		f, err := os.Open(sh.Path)
		if err != nil {
			g.close()
			return nil, err
		}
		g.files = append(g.files, f)
		fd := int(f.Fd())
		o := opened{fd: fd}
		if advice < 0 {
			// Engines that pread open shards with FADV_RANDOM: no readahead.
			// Only them: the flag is on the open file, so a mapping of the
			// same file would lose its readahead too (path 2' needs it).
			if err := unix.Fadvise(fd, 0, 0, unix.FADV_RANDOM); err != nil {
				g.close()
				return nil, fmt.Errorf("shard %s: fadvise random: %w", sh.Path, err)
			}
		} else {
			o.data, err = mapFile(f, sh.Size, advice)
			if err != nil {
				g.close()
				return nil, fmt.Errorf("shard %s: %w", sh.Path, err)
			}
			g.maps = append(g.maps, o.data)
		}
		shards[sh] = o
	}
	for _, l := range m.Layers {
		var srcs []*rowSource
		for _, t := range m.LayerTables(l) {
			o := shards[t.Shard]
			srcs = append(srcs, &rowSource{t: t, fd: o.fd, data: o.data, base: t.DataStart, key: backing.NameKey(seed, t.Name)})
		}
		g.layers = append(g.layers, srcs)
	}
	return g, nil
}

// openMount maps the table files of the mount at mp with MADV_RANDOM, as a
// loader pointed at the mount does. Row 0 of each is at the data_offset of
// manifest.json, checked against the model.
func openMount(m *backing.Model, mp string, seed uint64) (*gatherSet, error) {
	b, err := os.ReadFile(filepath.Join(mp, mfs.ManifestFile))
	if err != nil {
		return nil, err
	}
	var man mfs.Manifest
	if err := json.NewDecoder(bytes.NewReader(b)).Decode(&man); err != nil {
		return nil, fmt.Errorf("%s/%s: %w", mp, mfs.ManifestFile, err)
	}
	offsets := map[string]int64{}
	for _, l := range man.Layers {
		for _, t := range l.Tables {
			offsets[t.File] = t.DataOffset
		}
	}
	g := &gatherSet{}
	for _, l := range m.Layers {
		var srcs []*rowSource
		for _, t := range m.LayerTables(l) {
			off, ok := offsets[t.Path()]
			if !ok || off != int64(len(t.FileHeader)) {
				g.close()
				return nil, fmt.Errorf("mount %s: manifest says %s starts its data at %d (listed: %v), the model says %d", mp, t.Path(), off, ok, len(t.FileHeader))
			}
			f, err := os.Open(filepath.Join(mp, t.Path()))
			if err != nil {
				g.close()
				return nil, err
			}
			g.files = append(g.files, f)
			data, err := mapFile(f, t.FileSize, unix.MADV_RANDOM)
			if err != nil {
				g.close()
				return nil, fmt.Errorf("%s: %w", f.Name(), err)
			}
			g.maps = append(g.maps, data)
			srcs = append(srcs, &rowSource{t: t, fd: int(f.Fd()), data: data, base: off, key: backing.NameKey(seed, t.Name)})
		}
		g.layers = append(g.layers, srcs)
	}
	return g, nil
}

func mapFile(f *os.File, size int64, advice int) ([]byte, error) {
	data, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	if err := unix.Madvise(data, advice); err != nil {
		unix.Munmap(data)
		return nil, fmt.Errorf("madvise: %w", err)
	}
	return data, nil
}

// files lists the files of g (for dropping their page cache).
func (g *gatherSet) fileNames() []string {
	var out []string
	for _, f := range g.files {
		out = append(out, f.Name())
	}
	return out
}

// rowsOut is where a gather puts its rows, as an engine's gather fills a
// tensor: per layer index and table, the rows back to back in the order
// asked, so that every byte gathered can be checked. A nil *rowsOut is
// one scratch row each copy overwrites (the paths whose bytes only a few
// rows are checked of).
type rowsOut struct {
	bufs [][][]byte // layer index -> table -> len(rows) × RowBytes
}

// newRowsOut has room for up to rows rows of every table of g.
func newRowsOut(g *gatherSet, rows int) *rowsOut {
	o := &rowsOut{bufs: make([][][]byte, len(g.layers))}
	for j, srcs := range g.layers {
		for _, src := range srcs {
			o.bufs[j] = append(o.bufs[j], make([]byte, int64(rows)*src.t.RowBytes))
		}
	}
	return o
}

// row is where row i of table ti of layer j goes.
func (o *rowsOut) row(j, ti, i int, rb int64, scratch []byte) []byte {
	if o == nil {
		return scratch[:rb]
	}
	return o.bufs[j][ti][int64(i)*rb : int64(i+1)*rb]
}

// gatherSerial copies every row of every table of each layer out of the
// mappings, on the calling goroutine: a decode step of one thread, whose
// cold page faults are served one after another. Rows go to out (nil:
// into buf, one row).
func (g *gatherSet) gatherSerial(rows [][]uint64, buf []byte, out *rowsOut) error {
	for j, rs := range rows {
		if err := g.gatherLayer(j, rs, buf, out); err != nil {
			return err
		}
	}
	return nil
}

// gatherLayer is gatherSerial of layer index j's rows alone.
func (g *gatherSet) gatherLayer(j int, rs []uint64, buf []byte, out *rowsOut) (err error) {
	defer guardFaults(&err)()
	for ti, src := range g.layers[j] {
		rb := src.t.RowBytes
		for i, r := range rs {
			off := src.rowOff(r)
			copy(out.row(j, ti, i, rb, buf), src.data[off:off+rb])
		}
	}
	return nil
}

// guardFaults turns a fault on a mapping into an error in *err. A page of a
// mapped FUSE file that cannot be read (the daemon died, or failed the read)
// is a SIGBUS, which would otherwise kill the bench with the daemon's log
// unread and the mount left behind. Use as `defer guardFaults(&err)()` first
// thing in a goroutine that touches mappings.
func guardFaults(err *error) func() {
	old := debug.SetPanicOnFault(true)
	return func() {
		if r := recover(); r != nil {
			*err = fmt.Errorf("a read of a mapped file faulted (SIGBUS: the daemon died or failed the read): %v", r)
		}
		debug.SetPanicOnFault(old)
	}
}

// willneed calls fadvise(WILLNEED) on the range of every row of every
// table: the kernel starts reading them all, and returns.
func (g *gatherSet) willneed(rows [][]uint64) error {
	for j, rs := range rows {
		for _, src := range g.layers[j] {
			for _, r := range rs {
				if err := unix.Fadvise(src.fd, src.rowOff(r), src.t.RowBytes, unix.FADV_WILLNEED); err != nil {
					return fmt.Errorf("fadvise willneed %s: %w", src.t.Name, err)
				}
			}
		}
	}
	return nil
}

// gatherV3 is the engines' "v3" decode path (DSV41_ENGRAM_MMAP_INLINE_ROWS):
// fadvise(WILLNEED) on every row's range of every table, so that all the
// reads are in flight together, then one gather on the calling goroutine.
// Paths 3 (the shards) and 4' (the mount's table files) both run it. It
// returns how long the fadvise calls took (the serving loop reports the
// step in its two parts).
func (g *gatherSet) gatherV3(rows [][]uint64, buf []byte, out *rowsOut) (fadvise time.Duration, err error) {
	start := time.Now()
	if err := g.willneed(rows); err != nil {
		return time.Since(start), err
	}
	fadvise = time.Since(start)
	return fadvise, g.gatherSerial(rows, buf, out)
}

// rowTask is a run of rows of one layer, the unit a pool worker takes:
// rows[first:first+len(rows)] of the layer's.
type rowTask struct {
	layer int
	first int
	rows  []uint64
}

func splitTasks(rows [][]uint64, per int) []rowTask {
	var out []rowTask
	for j, rs := range rows {
		for i := 0; i < len(rs); i += per {
			out = append(out, rowTask{layer: j, first: i, rows: rs[i:min(i+per, len(rs))]})
		}
	}
	return out
}

// gatherPool gathers rows with workers goroutines taking tasks of per rows:
// by pread from the files (pread) or by copying out of the mappings, into
// out (nil: a scratch row per worker).
//
// Go runs at most GOMAXPROCS goroutines at once, and a goroutine blocked in
// a page fault keeps its P (the scheduler cannot see a fault), so 96
// faulting goroutines on a 2-CPU machine would be 2 threads of faults. The
// engines this path stands for use real threads: the caller raises
// GOMAXPROCS to the pool size for the phase (withProcs).
func (g *gatherSet) gatherPool(rows [][]uint64, workers, per int, pread bool, out *rowsOut) error {
	tasks := splitTasks(rows, per)
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Pointer[error]
	for range min(workers, len(tasks)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			defer func() {
				if err != nil {
					firstErr.CompareAndSwap(nil, &err)
				}
			}()
			defer guardFaults(&err)()
			buf := make([]byte, maxRowBytes(g))
			for {
				i := int(next.Add(1)) - 1
				if i >= len(tasks) {
					return
				}
				tk := tasks[i]
				for ti, src := range g.layers[tk.layer] {
					rb := src.t.RowBytes
					for x, r := range tk.rows {
						off := src.rowOff(r)
						dst := out.row(tk.layer, ti, tk.first+x, rb, buf)
						if !pread {
							copy(dst, src.data[off:off+rb])
							continue
						}
						if perr := preadFull(src.fd, dst, off); perr != nil {
							err = fmt.Errorf("pread %s row %d: %w", src.t.Name, r, perr)
							return
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	if e := firstErr.Load(); e != nil {
		return *e
	}
	return nil
}

func preadFull(fd int, buf []byte, off int64) error {
	for done := 0; done < len(buf); {
		n, err := unix.Pread(fd, buf[done:], off+int64(done))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return errors.New("short read")
		}
		done += n
	}
	return nil
}

func maxRowBytes(g *gatherSet) int64 {
	var n int64
	for _, l := range g.layers {
		for _, s := range l {
			n = max(n, s.t.RowBytes)
		}
	}
	return n
}

// verify checks the bytes of a few rows (the first and last of each layer)
// against what the synthetic model holds there: a path that gathers fast
// but wrong must not look good. It reads the way the path does (mapping or
// pread), outside the timed part.
func (g *gatherSet) verify(rows [][]uint64) (err error) {
	defer guardFaults(&err)()
	for j, rs := range rows {
		if len(rs) == 0 {
			continue
		}
		for _, r := range []uint64{rs[0], rs[len(rs)-1]} {
			for _, src := range g.layers[j] {
				rb := src.t.RowBytes
				got := make([]byte, rb)
				if src.data != nil {
					copy(got, src.data[src.rowOff(r):src.rowOff(r)+rb])
				} else if err := preadFull(src.fd, got, src.rowOff(r)); err != nil {
					return fmt.Errorf("verify %s row %d: %w", src.t.Name, r, err)
				}
				want := make([]byte, rb)
				backing.FillSynth(want, src.key, int64(r)*rb)
				if !bytes.Equal(got, want) {
					return fmt.Errorf("%s row %d: gathered bytes differ from the model's", src.t.Name, r)
				}
			}
		}
	}
	return nil
}

// verifyOut checks the rows a gather put in out against what the
// synthetic model holds there: every row, or with sample > 0 about sample
// rows of each layer's, evenly spread (the first and the last always). It
// returns the rows checked (every table of a row counts once).
func (g *gatherSet) verifyOut(rows [][]uint64, out *rowsOut, sample int) (int, error) {
	checked := 0
	var want []byte
	for j, rs := range rows {
		step := 1
		if sample > 0 && len(rs) > sample {
			step = len(rs) / sample
		}
		for i := 0; i < len(rs); i += step {
			if i+step >= len(rs) {
				i = len(rs) - 1
			}
			r := rs[i]
			for ti, src := range g.layers[j] {
				rb := src.t.RowBytes
				want = slices.Grow(want[:0], int(rb))[:rb]
				backing.FillSynth(want, src.key, int64(r)*rb)
				if !bytes.Equal(out.row(j, ti, i, rb, nil), want) {
					return checked, fmt.Errorf("%s row %d: gathered bytes differ from the model's", src.t.Name, r)
				}
			}
			checked++
		}
	}
	return checked, nil
}

// withProcs runs f with GOMAXPROCS raised to at least n (see gatherPool).
func withProcs(n int, f func() error) error {
	prev := runtime.GOMAXPROCS(0)
	if n > prev {
		runtime.GOMAXPROCS(n)
		defer runtime.GOMAXPROCS(prev)
	}
	return f()
}

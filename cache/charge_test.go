package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/memcg"
	"github.com/engramfs/engramfs/internal/pagecache"
)

// fileRecharger is the Recharger of a plain file: it drops pages with
// FADV_DONTNEED (which drops clean pages no process maps: the pinner has
// unmapped them and the reader that read them is gone) and stores with
// pwrite, which allocates the new pages in this process's memory cgroup,
// as NOTIFY_STORE does in the daemon's.
type fileRecharger struct {
	f      *os.File
	stores int
	fail   bool // Store fails: the pinner reads the pages in itself
}

func (r *fileRecharger) Invalidate(_ uint32, off, n int64) error {
	return unix.Fadvise(int(r.f.Fd()), off, n, unix.FADV_DONTNEED)
}

func (r *fileRecharger) Store(_ uint32, off int64, data []byte) error {
	r.stores++
	if r.fail {
		return errors.New("store refused")
	}
	_, err := r.f.WriteAt(data, off)
	return err
}

// readerGroup makes a memory cgroup below this process's and reads path in
// it, so that its pages are charged there; it skips where there are no
// memory cgroups or no kpagecgroup.
func readerGroup(t testing.TB, path string) *memcg.Group {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("memory cgroups and /proc/kpagecgroup need root")
	}
	g, err := memcg.New("engramfs-cache-test", 256<<20)
	if err != nil {
		t.Skipf("%v", err)
	}
	t.Cleanup(func() { _ = g.Remove() })
	evict(t, path)
	// Page by page under FADV_RANDOM, as faults through the mount read:
	// readahead would bring in large folios, and dropping one page of a
	// large folio drops nothing.
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	script := `import os,sys
fd=os.open(sys.argv[1],os.O_RDONLY)
os.posix_fadvise(fd,0,0,os.POSIX_FADV_RANDOM)
n=os.fstat(fd).st_size
for off in range(0,n,4096): os.pread(fd,4096,off)`
	cat := append(g.Wrapper(), py, "-c", script, path)
	if out, err := exec.Command(cat[0], cat[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("reading %s in %s: %v\n%s", path, g.Dir, err, out)
	}
	return g
}

// evict drops path's pages from the page cache, and waits until none is
// left: a page just written back may still be held for a moment, and a
// page the reader then finds cached stays charged to whoever wrote it.
func evict(t testing.TB, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	for try := 0; ; try++ {
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		n, err := pagecache.Count(m)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if try == 100 {
			t.Fatalf("%s: %d pages still cached after 100 drops", path, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// chargedTo returns the memory cgroup inode of each page of the pinner's
// mapping of table 0, from pages first to first+n (0: not mapped).
func chargedTo(t testing.TB, p *Pinner, first, n uint64) []uint64 {
	t.Helper()
	p.mu.RLock()
	b := p.maps[0]
	p.mu.RUnlock()
	va := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) + first*PageSize
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	kpc, err := os.Open("/proc/kpagecgroup")
	if err != nil {
		t.Fatal(err)
	}
	defer kpc.Close()
	ent := make([]byte, 8*n)
	if _, err := pm.ReadAt(ent, int64(va/PageSize*8)); err != nil {
		t.Fatal(err)
	}
	out := make([]uint64, n)
	for i := range out {
		e := binary.LittleEndian.Uint64(ent[8*i:])
		if e&(1<<63) == 0 {
			continue
		}
		var ino [8]byte
		if _, err := kpc.ReadAt(ino[:], int64(e&(1<<55-1))*8); err != nil {
			t.Fatal(err)
		}
		out[i] = binary.LittleEndian.Uint64(ino[:])
	}
	return out
}

// TestPinnerChargesPinsToItsOwnGroup: pages a process in another memory
// cgroup read are charged to that group; the pinner stores them again
// before pinning them, so every pinned page is charged to the pinner's own
// group, the other group holds none of them, and the bytes are the file's.
// A store that fails leaves the pinner to read the pages in itself.
func TestPinnerChargesPinsToItsOwnGroup(t *testing.T) {
	const pages = 64
	f := coldFile(t, pages*PageSize)
	want, err := os.ReadFile(f.Path)
	if err != nil {
		t.Fatal(err)
	}
	dropCache(t, f.Path)
	g := readerGroup(t, f.Path)
	before, err := g.Usage()
	if err != nil || before.File < pages*PageSize {
		t.Fatalf("the reader's group holds %+v (%v), want the file's %d pages", before, err, pages)
	}
	self, err := memcg.Own()
	if err != nil {
		t.Skipf("%v", err)
	}
	own, err := self.Inodes()
	if err != nil {
		t.Fatal(err)
	}
	wf, err := os.OpenFile(f.Path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer wf.Close()
	rc := &fileRecharger{f: wf}
	p := newTestPinner(t, f)
	p.SetRecharger(rc)
	if err := p.PinRun(0, 0, pages/2); err != nil {
		t.Fatal(err)
	}
	// Pinned one by one: runs of one page, as random faults admit them.
	for q := uint64(pages / 2); q < pages; q += 2 {
		if err := p.Pin(PageKey{Page: q}); err != nil {
			t.Fatal(err)
		}
	}
	if !p.chargeCheck() {
		t.Skip("the kernel does not say whose a page is here (no /proc/kpagecgroup)")
	}
	for i, ino := range chargedTo(t, p, 0, pages) {
		pinned := i < pages/2 || i%2 == 0
		if pinned && (ino == 0 || !slices.Contains(own, ino)) {
			t.Errorf("page %d: pinned, charged to cgroup inode %d, want this process's group or an ancestor %v", i, ino, own)
		}
	}
	if got := p.Recharged(); got != pages/2+pages/4 {
		t.Errorf("Recharged() = %d, want %d", got, pages/2+pages/4)
	}
	// The group also holds the reader's own pages (python, libc).
	if u, err := g.Usage(); err != nil || u.File > before.File-(pages/2+pages/4)*PageSize || u.Unevictable != 0 {
		t.Errorf("the reader's group after the pins: %+v (%v), before %+v: want the %d pinned pages gone from it, none locked",
			u, err, before, pages/2+pages/4)
	}
	got := make([]byte, len(want))
	if _, err := wf.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Errorf("the file's bytes changed under the recharge (%v)", err)
	}

	// A failed store (page 33 is still the reader's group's): the pinner
	// reads the page in itself.
	rc.fail = true
	if err := p.Pin(PageKey{Page: 33}); err != nil {
		t.Fatal(err)
	}
	if ino := chargedTo(t, p, 33, 1)[0]; !slices.Contains(own, ino) {
		t.Errorf("page 33 after a failed store: charged to %d, want %v", ino, own)
	}
}

// TestPinnerRefusesPagesStillChargedElsewhere: when the page stays charged
// to the other group after every recharge (here: the Recharger drops
// nothing), the pin fails with ErrChargedElsewhere and the page is left
// unlocked; the other pages of the run are pinned.
func TestPinnerRefusesPagesStillChargedElsewhere(t *testing.T) {
	f := coldFile(t, 8*PageSize)
	g := readerGroup(t, f.Path)
	p := newTestPinner(t, f)
	wf, err := os.OpenFile(f.Path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer wf.Close()
	p.SetRecharger(noDrop{})
	if !p.chargeCheck() {
		t.Skip("the kernel does not say whose a page is here (no /proc/kpagecgroup)")
	}
	// Page 0 is this process's (read in again after a drop); 1-3 the group's.
	if err := unix.Fadvise(int(wf.Fd()), 0, PageSize, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	err = p.PinRun(0, 0, 4)
	if !errors.Is(err, ErrChargedElsewhere) {
		u, _ := g.Usage()
		t.Fatalf("PinRun of pages charged elsewhere: %v, want ErrChargedElsewhere (pages charged to %v; the group %s: %+v)",
			err, chargedTo(t, p, 0, 4), g.Dir, u)
	}
	if !p.Pinned(PageKey{Page: 0}) || p.Pinned(PageKey{Page: 1}) || p.PinnedPages() != 1 {
		t.Errorf("pinned: page 0 %v, page 1 %v, %d in all; want only page 0", p.Pinned(PageKey{Page: 0}), p.Pinned(PageKey{Page: 1}), p.PinnedPages())
	}
	if u, err := g.Usage(); err != nil || u.Unevictable != 0 {
		t.Errorf("the other group holds locked pages: %+v (%v)", u, err)
	}
}

// noDrop is a Recharger that drops nothing and stores nothing: the pages
// stay where they are charged.
type noDrop struct{}

func (noDrop) Invalidate(uint32, int64, int64) error { return nil }
func (noDrop) Store(uint32, int64, []byte) error     { return nil }

// BenchmarkPinCharge is the pinner's cost per page pinned in runs of one
// page: without a Recharger (no check: the pinner before charges were
// checked), with the check finding the pages its own, and with every page
// charged to another group and stored again.
//
//	go test -run '^$' -bench PinCharge ./cache
func BenchmarkPinCharge(b *testing.B) {
	const pages = 4096
	// The machine is shared: CPU time of this thread (the system calls'
	// kernel work included) says more than the wall clock.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu := func() time.Duration {
		var ts unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
		return time.Duration(ts.Nano())
	}
	for _, c := range []string{"unchecked", "own", "foreign"} {
		b.Run(c, func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var used time.Duration
			var recharged uint64
			tf := coldFileB(b, pages*PageSize)
			wf, err := os.OpenFile(tf.Path, os.O_RDWR, 0)
			if err != nil {
				b.Fatal(err)
			}
			defer wf.Close()
			for i := 0; i < b.N; {
				b.StopTimer()
				evict(b, tf.Path)
				if c == "foreign" {
					readerGroup(b, tf.Path)
				} else if _, err := wf.ReadAt(make([]byte, pages*PageSize), 0); err != nil {
					b.Fatal(err)
				}
				p := NewPinner([]TableFile{tf}, nil)
				if c != "unchecked" {
					p.SetRecharger(&fileRecharger{f: wf})
				}
				b.StartTimer()
				t0 := cpu()
				for q := uint64(0); q < pages && i < b.N; q, i = q+2, i+1 {
					if err := p.Pin(PageKey{Page: q}); err != nil {
						b.Fatal(err)
					}
				}
				used += cpu() - t0
				b.StopTimer()
				recharged += p.Recharged()
				_ = p.Close()
			}
			if c == "foreign" && b.N >= 64 && recharged < uint64(b.N)/2 {
				b.Fatalf("%d of %d pages recharged", recharged, b.N)
			}
			b.ReportMetric(float64(used.Nanoseconds())/float64(b.N), "cpu-ns/page")
		})
	}
}

// coldFileB is coldFile for a benchmark.
func coldFileB(b *testing.B, size int64) TableFile {
	b.Helper()
	path := b.TempDir() + "/table"
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, int(size)), 0o644); err != nil {
		b.Fatal(err)
	}
	return TableFile{Path: path, Size: size}
}

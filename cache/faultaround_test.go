package cache

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// warmFile writes a file of pages pages and leaves it in the page cache:
// every neighbour of a pinned page is there for fault-around to map.
func warmFile(t *testing.T, pages int) TableFile {
	t.Helper()
	path := filepath.Join(t.TempDir(), "warm.safetensors")
	data := make([]byte, pages*PageSize)
	for i := range data {
		data[i] = byte(i/PageSize + 1)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Read(make([]byte, len(data))); err != nil { // all cached
		t.Fatal(err)
	}
	return TableFile{Path: path, Size: int64(len(data))}
}

// mmapAt is mmap(2) with addresses as integers (the test places mappings).
func mmapAt(addr, length uintptr, prot, flags, fd int) (uintptr, error) {
	r, _, errno := unix.Syscall6(unix.SYS_MMAP, addr, length, uintptr(prot), uintptr(flags), uintptr(fd), 0)
	if errno != 0 {
		return 0, errno
	}
	return r, nil
}

func munmapAt(addr, length uintptr) {
	_, _, _ = unix.Syscall(unix.SYS_MUNMAP, addr, length, 0)
}

// mapSkewed maps f at skew pages past a 64 KiB boundary of virtual memory,
// as the kernel may place the daemon's own mappings.
func mapSkewed(skew int) func(TableFile) ([]byte, error) {
	return func(f TableFile) ([]byte, error) {
		const align = 64 << 10
		size := uintptr(f.Size)
		span := size + 2*align
		lo, err := mmapAt(0, span, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, -1)
		if err != nil {
			return nil, err
		}
		at := (lo+align-1)&^(align-1) + uintptr(skew)*PageSize
		fd, err := unix.Open(f.Path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		defer unix.Close(fd)
		// MAP_FIXED over our own reservation; then give back the rest of it.
		if _, err := mmapAt(at, size, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_FIXED, fd); err != nil {
			return nil, err
		}
		if at > lo {
			munmapAt(lo, at-lo)
		}
		end := (at + size + PageSize - 1) &^ (PageSize - 1)
		munmapAt(end, lo+span-end)
		b := unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&at))), size)
		if err := unix.Madvise(b, unix.MADV_RANDOM); err != nil {
			return nil, err
		}
		return b, nil
	}
}

// TestPinnerFaultAroundByVirtualAddress pins and unpins pages and runs of a
// file whose every page is cached, mapped 6, 10 and 2 pages past a 64 KiB
// boundary: after every call the memory locked (smaps Locked) is exactly
// the pages pinned. Fault-around maps the cached neighbours of a populated
// page in a window aligned by virtual address; a trim aligned by file offset
// left 6, 10 and 2 of them locked.
func TestPinnerFaultAroundByVirtualAddress(t *testing.T) {
	for _, skew := range []int{6, 10, 2} {
		t.Run("skew="+string(rune('0'+skew/10))+string(rune('0'+skew%10)), func(t *testing.T) {
			f := warmFile(t, 256)
			p := newTestPinner(t, f)
			p.mmap = mapSkewed(skew)
			base := vmLck(t)
			check := func(what string) {
				t.Helper()
				wantLocked(t, base, int(p.PinnedPages()), what)
			}
			for _, pg := range []uint64{40, 0, 15, 16, 100, 255, 47, 48} {
				if err := p.Pin(PageKey{Page: pg}); err != nil {
					t.Fatal(err)
				}
				check("pin of one page")
			}
			if got := p.PinnedPages(); got != 8 {
				t.Fatalf("%d pages pinned, want 8", got)
			}
			for _, r := range [][2]uint64{{60, 9}, {120, 40}, {200, 1}} {
				if err := p.PinRun(0, r[0], r[1]); err != nil {
					t.Fatal(err)
				}
				check("pin of a run")
			}
			for _, pg := range []uint64{40, 15, 255, 130, 61} {
				if err := p.Unpin(PageKey{Page: pg}); err != nil {
					t.Fatal(err)
				}
				check("unpin")
			}
			if err := p.UnpinRun(0, 120, 40); err != nil {
				t.Fatal(err)
			}
			check("unpin of a run")
		})
	}
}

// TestPinnerFailedPinTrimsNeighbours: a run that fails half way (past the
// real end of the file) leaves neither its populated pages nor their cached
// fault-around neighbours locked, and keeps what was pinned before.
func TestPinnerFailedPinTrimsNeighbours(t *testing.T) {
	f := warmFile(t, 40)
	f.Size = 48 * PageSize // the pinner believes the file is longer than it is
	p := newTestPinner(t, f)
	p.mmap = func(tf TableFile) ([]byte, error) { return mapSkewed(6)(tf) }
	base := vmLck(t)
	if err := p.Pin(PageKey{Page: 33}); err != nil {
		t.Fatal(err)
	}
	if err := p.PinRun(0, 36, 8); err == nil {
		t.Fatal("a run past the real end of the file was pinned")
	}
	wantLocked(t, base, 1, "after a failed run")
	if !p.Pinned(PageKey{Page: 33}) || p.Pinned(PageKey{Page: 36}) || p.PinnedPages() != 1 {
		t.Fatalf("pinned after a failed run: 33 %v, 36 %v, %d pages", p.Pinned(PageKey{Page: 33}), p.Pinned(PageKey{Page: 36}), p.PinnedPages())
	}
}

func TestFaultWindow(t *testing.T) {
	const span = 64 << 10
	for _, tc := range []struct {
		base, first, n, pages uint64
		lo, hi                uint64
	}{
		{base: 0x100000, first: 20, n: 1, pages: 100, lo: 16, hi: 32},              // aligned base: file-aligned window
		{base: 0x100000 + 6*PageSize, first: 0, n: 1, pages: 100, lo: 0, hi: 10},   // clipped at the start
		{base: 0x100000 + 6*PageSize, first: 10, n: 1, pages: 100, lo: 10, hi: 26}, // window starts at page 10
		{base: 0x100000 + 6*PageSize, first: 9, n: 2, pages: 100, lo: 0, hi: 26},   // run across two windows
		{base: 0x100000 + 6*PageSize, first: 95, n: 1, pages: 100, lo: 90, hi: 100},
	} {
		lo, hi := faultWindow(tc.base, tc.first, tc.n, span, tc.pages)
		if lo != tc.lo || hi != tc.hi {
			t.Errorf("faultWindow(%#x, %d, %d): [%d, %d), want [%d, %d)", tc.base, tc.first, tc.n, lo, hi, tc.lo, tc.hi)
		}
	}
}

// TestPinnerAuditWidensTheTrim: where faults map beyond the window the
// pinner trims (here narrowed to 2 pages, against the kernel's 16), and
// the cached neighbours have gaps, so that the probes either side of the
// window see nothing, trims leave neighbours locked until an audit (the
// first trim, then one in auditEvery) notices; it then unmaps what earlier
// trims missed and trims whole page tables from then on. Locked is exact
// after the audit, and neighbours were left locked before it (the audit
// had something to find).
func TestPinnerAuditWidensTheTrim(t *testing.T) {
	const pages = 4 * tablePages
	f := coldFile(t, pages*PageSize)
	// Cache every fourth page: fault-around maps them, the probes (next to
	// a 2-page window at an even page) see uncached pages.
	fd, err := unix.Open(f.Path, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, PageSize)
	for q := 0; q < pages; q += 4 {
		if _, err := unix.Pread(fd, buf, int64(q)*PageSize); err != nil {
			t.Fatal(err)
		}
	}
	p := newTestPinner(t, f)
	p.around = 2
	p.mmap = func(tf TableFile) ([]byte, error) { return mapSkewed(0)(tf) }
	base := vmLck(t)
	// The first trim is an audit: pin a page with no cached neighbour
	// first, so that it finds nothing.
	if err := p.Pin(PageKey{Page: 2}); err != nil {
		t.Fatal(err)
	}
	if p.wideTrim.Load() {
		t.Fatal("the first audit found faults mapping wide around a page with no cached neighbour")
	}
	leaked := false
	for i := 1; i < auditEvery+1 && !p.wideTrim.Load(); i++ {
		pg := uint64(16*i + 8) // a cached page; its 16-page fault-around window holds 3 more
		if err := p.Pin(PageKey{Page: pg % pages}); err != nil {
			t.Fatal(err)
		}
		if vmLck(t)-base > p.PinnedPages()*PageSize {
			leaked = true
		}
	}
	if !leaked {
		t.Fatal("no neighbour was left locked before the audit: the test does not exercise the narrow trim")
	}
	if !p.wideTrim.Load() {
		t.Fatalf("no audit found the wide faults in %d trims", auditEvery+1)
	}
	wantLocked(t, base, int(p.PinnedPages()), "after the audit's sweep")
	if err := p.Pin(PageKey{Page: 16*70 + 8}); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, int(p.PinnedPages()), "a pin after the audit")
}

// requireExact fails the test where table 0 of p should have exact faults
// and has not (a 6.12+ kernel), and skips it before 6.12.
func requireExact(t *testing.T, p *Pinner) {
	t.Helper()
	p.mu.RLock()
	exact := p.exact[0]
	p.mu.RUnlock()
	if !exact {
		if kernelAtLeast(6, 12) {
			t.Fatal("exact faults unavailable on a 6.12+ kernel (userfaultfd write-protect, UFFD_FEATURE_WP_ASYNC): see the log")
		}
		t.Skip("exact faults unavailable before 6.12; the trim is tested by the other pinner tests")
	}
}

// TestReachesPast: the probe for a folio reaching past the fault-around
// windows steps over pages we pinned (mapped anyway) to the first one we
// did not, and needs none at a page table's end.
func TestReachesPast(t *testing.T) {
	// Windows [16, 32) in page table [0, 512); probes [8, 40).
	const plo, nlo, nhi, phi, lo, hi = 8, 16, 32, 40, 0, 512
	for _, tc := range []struct {
		name    string
		mapped  []uint64 // pages mapped outside the windows
		pinned  []uint64
		reaches bool
	}{
		{"nothing mapped around", nil, nil, false},
		{"the page below mapped", []uint64{15}, nil, true},
		{"the page above mapped", []uint64{32}, nil, true},
		{"pinned neighbours, then unmapped", []uint64{15, 14, 32}, []uint64{15, 14, 32}, false},
		{"pinned neighbours, then mapped", []uint64{15, 14, 13}, []uint64{15, 14}, true},
		{"pinned up to the slack", []uint64{32, 33, 34, 35, 36, 37, 38, 39}, []uint64{32, 33, 34, 35, 36, 37, 38, 39}, true},
		{"mapped beyond the probe only", []uint64{12}, nil, false},
	} {
		m := make([]bool, phi-plo)
		for _, q := range tc.mapped {
			m[q-plo] = true
		}
		pinned := func(q uint64) bool { return slices.Contains(tc.pinned, q) }
		if got := reachesPast(m, plo, nlo, nhi, phi, lo, hi, pinned); got != tc.reaches {
			t.Errorf("%s: reachesPast = %v, want %v", tc.name, got, tc.reaches)
		}
	}
	// At a page table's ends there is nothing to probe.
	m := make([]bool, 16)
	if reachesPast(m, 0, 0, 16, 16, 0, 16, func(uint64) bool { return false }) {
		t.Error("a window filling its page table reaches past it")
	}
	allPinned := func(uint64) bool { return true }
	m = make([]bool, 24)
	for i := range m {
		m[i] = true
	}
	if reachesPast(m, 0, 8, 24, 24, 0, 24, allPinned) {
		t.Error("pinned pages down to the page table's start: reported reaching past")
	}
}

// TestPinnerExactFaults: where the kernel allows it (exact.go), the
// pinner's own mapping faults single pages: pinning pages and runs of a
// warm file (large folios, every neighbour cached) locks exactly them with
// no trim at all; with exact faults off (the fallback) the same pins need
// the trim. The test says which it measured.
func TestPinnerExactFaults(t *testing.T) {
	f := warmFile(t, 1024)
	p := newTestPinner(t, f)
	base := vmLck(t)
	if err := p.Pin(PageKey{Page: 300}); err != nil {
		t.Fatal(err)
	}
	requireExact(t, p)
	wantLocked(t, base, 1, "one page pinned")
	for _, r := range [][2]uint64{{40, 1}, {41, 7}, {511, 2}, {700, 100}} {
		if err := p.PinRun(0, r[0], r[1]); err != nil {
			t.Fatal(err)
		}
		wantLocked(t, base, int(p.PinnedPages()), "a run pinned")
	}
	if err := p.UnpinRun(0, 700, 50); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, int(p.PinnedPages()), "half a run unpinned")
	if got := p.pagemaps.Load(); got != 1 {
		t.Errorf("%d pagemap reads for %d pins of an exact mapping, want 1 (the first pin's audit)", got, p.trims.Load())
	}

	// The same pins without exact faults map (so lock) neighbours, which
	// only the trim takes back: the exact path is what kept them out.
	q := newTestPinner(t, warmFile(t, 1024))
	q.noExact = true
	q.trimOff = true
	base = vmLck(t)
	if err := q.Pin(PageKey{Page: 300}); err != nil {
		t.Fatal(err)
	}
	if got := vmLck(t) - base; got <= PageSize {
		t.Fatalf("without exact faults or trim, pinning a page of a warm file locked %d bytes: the check above proves nothing here", got)
	}
}

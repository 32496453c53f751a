package cache

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/engramfs/engramfs/internal/procfs"
	"golang.org/x/sys/unix"
)

// coldFile writes a file of size bytes (every byte set) and drops it from the
// page cache, so that residency starts false.
func coldFile(t *testing.T, size int64) TableFile {
	t.Helper()
	path := filepath.Join(t.TempDir(), "table.safetensors")
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i/PageSize + 1)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	dropCache(t, path)
	return TableFile{Path: path, Size: size}
}

func dropCache(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}

// vmLck is this process's locked memory, from /proc/self/status.
func vmLck(t *testing.T) int64 {
	t.Helper()
	n, ok := lockedBytes()
	if !ok {
		t.Fatal("no VmLck in /proc/self/status")
	}
	return int64(n)
}

func wantLocked(t *testing.T, base int64, pages int, what string) {
	t.Helper()
	if got := vmLck(t) - base; got != int64(pages)*PageSize {
		t.Fatalf("%s: VmLck grew by %d bytes, want %d pages (%d)", what, got, pages, pages*PageSize)
	}
}

func newTestPinner(t *testing.T, files ...TableFile) *Pinner {
	t.Helper()
	p := NewPinner(files, zap.NewNop())
	if !p.Available() {
		t.Skip("mlock unavailable here (tests need CAP_IPC_LOCK: run as root)")
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func TestPinnerLocksAndUnlocks(t *testing.T) {
	f := coldFile(t, 16*PageSize)
	p := newTestPinner(t, f)
	base := vmLck(t)
	for _, pg := range []uint64{0, 3, 5} {
		if err := p.Pin(PageKey{Page: pg}); err != nil {
			t.Fatal(err)
		}
	}
	wantLocked(t, base, 3, "3 pins")
	if err := p.PinRun(0, 8, 4); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 7, "3 pins and a run of 4")
	if err := p.Pin(PageKey{Page: 3}); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 7, "pinning a pinned page again")
	if err := p.Unpin(PageKey{Page: 3}); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 6, "unpin of 1 page")
	if err := p.UnpinRun(0, 8, 4); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 2, "unpin of the run")
	for _, pg := range []uint64{0, 5, 7} { // 7 was never pinned: harmless
		if err := p.Unpin(PageKey{Page: pg}); err != nil {
			t.Fatal(err)
		}
	}
	wantLocked(t, base, 0, "all unpinned")
}

// dropCount is how many times anyone wrote /proc/sys/vm/drop_caches since
// boot (/proc/vmstat's drop_pagecache).
func dropCount(t *testing.T) uint64 {
	t.Helper()
	vm, err := procfs.VMStat()
	if err != nil {
		t.Fatalf("vmstat: %v", err)
	}
	return vm["drop_pagecache"]
}

func TestPinnerResident(t *testing.T) {
	f := coldFile(t, 64*PageSize)
	p := newTestPinner(t, f)
	for pg := range uint64(64) {
		if p.Resident(PageKey{Page: pg}) {
			t.Fatalf("page %d resident in a dropped file", pg)
		}
	}
	if err := p.Pin(PageKey{Page: 20}); err != nil {
		t.Fatal(err)
	}
	if !p.Resident(PageKey{Page: 20}) {
		t.Fatal("pinned page not resident")
	}
	// One page of I/O per pin: no readahead around the fault (MADV_RANDOM).
	for pg := range uint64(64) {
		if pg != 20 && p.Resident(PageKey{Page: pg}) {
			t.Fatalf("page %d became resident when page 20 was pinned", pg)
		}
	}
	// Unpin drops the pinner's mapping of the page, not the page cache
	// (unless something on the machine dropped the page cache meanwhile:
	// the tests package and engramfs bench do, beside this one).
	drops := dropCount(t)
	if err := p.Unpin(PageKey{Page: 20}); err != nil {
		t.Fatal(err)
	}
	if !p.Resident(PageKey{Page: 20}) && dropCount(t) == drops {
		t.Fatal("unpinned page left the page cache at once")
	}
	dropCache(t, f.Path)
	if p.Resident(PageKey{Page: 20}) {
		t.Fatal("unpinned page survived a cache drop")
	}
	if err := p.Pin(PageKey{Page: 21}); err != nil {
		t.Fatal(err)
	}
	dropCache(t, f.Path)
	if !p.Resident(PageKey{Page: 21}) {
		t.Fatal("pinned page dropped by FADV_DONTNEED")
	}
}

func TestPinnerClipsAtEOF(t *testing.T) {
	f := coldFile(t, 2*PageSize+100)
	p := newTestPinner(t, f)
	base := vmLck(t)
	if err := p.PinRun(0, 0, 3); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 3, "the whole file, last page partial")
	for _, r := range [][2]uint64{{3, 1}, {2, 2}, {1 << 62, 1}, {0, 1 << 63}} {
		err := p.PinRun(0, r[0], r[1])
		if err == nil || !strings.Contains(err.Error(), "past the end") {
			t.Fatalf("PinRun(0, %d, %d) = %v, want past the end", r[0], r[1], err)
		}
	}
	if err := p.Pin(PageKey{Table: 1}); err == nil || !strings.Contains(err.Error(), "pin table 1 page 0: no table 1") {
		t.Fatalf("pin of an unknown table: %v", err)
	}
}

// TestPinnerFailedPinLeavesNothingLocked: a page that cannot be read (here:
// past the file's real end) fails the pin with context before anything is
// populated; a populate that fails halfway (injected, after mapping the
// run's first page) leaves VmLck where it was (the kernel had already marked
// the range locked). Neither turns pinning off.
func TestPinnerFailedPinLeavesNothingLocked(t *testing.T) {
	f := coldFile(t, 2*PageSize)
	f.Size = 4 * PageSize // the pinner believes the file is longer than it is
	p := newTestPinner(t, f)
	base := vmLck(t)
	err := p.PinRun(0, 1, 2)
	if err == nil || !strings.Contains(err.Error(), "pin table 0 pages 1-2: read through ") {
		t.Fatalf("pin past the real EOF: %v", err)
	}
	wantLocked(t, base, 0, "a failed read")
	populate := p.mlock
	p.mlock = func(b []byte) error {
		if err := populate(b[:PageSize]); err != nil {
			return err
		}
		return unix.EIO
	}
	err = p.PinRun(0, 0, 2)
	if err == nil || !strings.Contains(err.Error(), "pin table 0 pages 0-1: populate: ") {
		t.Fatalf("a failing populate: %v", err)
	}
	wantLocked(t, base, 0, "a failed populate")
	if !p.Available() {
		t.Fatal("a failed page turned pinning off")
	}
	p.mlock = populate
	if err := p.Pin(PageKey{Page: 0}); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 1, "pin after a failed pin")
}

func TestPinnerUnavailable(t *testing.T) {
	f := coldFile(t, 4*PageSize)
	core, logs := observer.New(zapcore.WarnLevel)
	p := NewPinner([]TableFile{f}, zap.New(core))
	defer p.Close()
	p.mlock = func([]byte) error { return unix.EPERM } // as without CAP_IPC_LOCK
	base := vmLck(t)
	for pg := range uint64(4) {
		if err := p.Pin(PageKey{Page: pg}); !errors.Is(err, ErrPinUnavailable) {
			t.Fatalf("pin %d: %v, want ErrPinUnavailable", pg, err)
		}
	}
	if p.Available() {
		t.Fatal("Available after a refusal")
	}
	if n := logs.Len(); n != 1 {
		t.Fatalf("%d warnings, want exactly 1", n)
	}
	wantLocked(t, base, 0, "refused pins")
	if err := p.Unpin(PageKey{Page: 1}); err != nil {
		t.Fatalf("unpin while unavailable: %v", err)
	}
}

func mapsMention(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), path)
}

func TestPinnerClose(t *testing.T) {
	f0, f1, f2 := coldFile(t, 8*PageSize), coldFile(t, 8*PageSize), coldFile(t, 8*PageSize)
	p := NewPinner([]TableFile{f0, f1, f2}, zap.NewNop())
	if !p.Available() {
		t.Skip("mlock unavailable")
	}
	base := vmLck(t)
	if err := p.PinRun(0, 0, 8); err != nil {
		t.Fatal(err)
	}
	if err := p.Pin(PageKey{Table: 1, Page: 7}); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 9, "before Close")
	if !mapsMention(t, f0.Path) || !mapsMention(t, f1.Path) || mapsMention(t, f2.Path) {
		t.Fatal("want tables 0 and 1 mapped, table 2 (never used) not")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	wantLocked(t, base, 0, "after Close")
	if mapsMention(t, f0.Path) || mapsMention(t, f1.Path) {
		t.Fatal("a table is still mapped after Close")
	}
	if err := p.Pin(PageKey{Page: 1}); err == nil || !errors.Is(err, errPinnerClosed) {
		t.Fatalf("pin after Close: %v", err)
	}
	if p.Resident(PageKey{Page: 1}) {
		t.Fatal("Resident after Close")
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestPinnerConcurrentClose races pins, unpins and residency checks on several
// tables against Close: no call may touch an unmapped range, and nothing stays
// locked.
func TestPinnerConcurrentClose(t *testing.T) {
	files := []TableFile{coldFile(t, 32*PageSize), coldFile(t, 32*PageSize)}
	p := NewPinner(files, zap.NewNop())
	if !p.Available() {
		t.Skip("mlock unavailable")
	}
	base := vmLck(t)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 400 {
				k := PageKey{Table: uint32(i % 2), Page: uint64(i*7+g) % 32}
				_ = p.Pin(k)
				p.Resident(k)
				_ = p.Unpin(k)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = p.Pin(PageKey{Page: 1})
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	}()
	wg.Wait()
	wantLocked(t, base, 0, "after concurrent Close")
}

package pagecache

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// A file whose pages are cached but for the ones dropped: Resident and Count
// say exactly which, through a mapping that never faulted a page in.
func TestResident(t *testing.T) {
	ps := os.Getpagesize()
	path := filepath.Join(t.TempDir(), "f")
	const pages = 16
	if err := os.WriteFile(path, make([]byte, pages*ps), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	fd := int(f.Fd())
	// Drop everything, then read back the odd pages only.
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(fd, 0, pages*ps, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	buf := make([]byte, ps)
	// Another process's drop_caches may take the odd pages back between
	// the reads and the check: read them again, a few times at most.
	for attempt := 0; ; attempt++ {
		for p := 1; p < pages; p += 2 {
			if _, err := unix.Pread(fd, buf, int64(p*ps)); err != nil {
				t.Fatal(err)
			}
		}
		res, err := Resident(b)
		if err != nil {
			t.Fatal(err)
		}
		if len(res) != pages {
			t.Fatalf("%d pages reported, want %d", len(res), pages)
		}
		odd := true
		for p, r := range res {
			switch {
			case p%2 == 0 && r:
				t.Fatalf("page %d reported resident; it was dropped and never read", p)
			case p%2 == 1 && !r:
				odd = false
			}
		}
		if odd {
			break
		}
		if attempt == 4 {
			t.Fatalf("pages just read reported not resident: %v", res)
		}
	}
	if n, err := Count(b); err != nil || n > pages/2 {
		t.Fatalf("Count = %d, %v; want at most %d, the pages read", n, err, pages/2)
	}
	if err := Mincore(b, make([]byte, pages-1)); err == nil {
		t.Fatal("Mincore took a vector shorter than the mapping's pages")
	}
}

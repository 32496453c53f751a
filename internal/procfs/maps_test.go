package procfs

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMapsUnder(t *testing.T) {
	maps := []byte(`55d0c0a00000-55d0c0a21000 r--p 00000000 00:1f 12 /usr/bin/cat
7f3c00000000-7f3c00400000 r--s 00001000 00:3a 7  /mnt/engram/layers/0/table.safetensors
7f3c00400000-7f3c00401000 rw-p 00000000 00:00 0
7ffd1a2e0000-7ffd1a301000 rw-p 00000000 00:00 0                          [stack]
`)
	for _, c := range []struct {
		dir  string
		want bool
	}{
		{"/mnt/engram", true},
		{"/mnt/engram/", true},
		{"/mnt/engram/layers/0/table.safetensors", true},
		{"/mnt/engra", false},
		{"/mnt/engram2", false},
		{"/usr", true},
		{"/srv", false},
	} {
		if got := MapsUnder(maps, c.dir); got != c.want {
			t.Errorf("MapsUnder(%q) = %v, want %v", c.dir, got, c.want)
		}
	}
}

// TestMappersFindsThisProcess maps a file and finds itself among its
// mappers; unmapped, it is gone.
func TestMappersFindsThisProcess(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := Mappers(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(pids, os.Getpid()) {
		t.Errorf("Mappers(%s) = %v: this process (%d) maps a file there", dir, pids, os.Getpid())
	}
	if err := unix.Munmap(m); err != nil {
		t.Fatal(err)
	}
	pids, err = Mappers(dir)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(pids, os.Getpid()) {
		t.Errorf("Mappers(%s) = %v after munmap: still lists this process", dir, pids)
	}
}

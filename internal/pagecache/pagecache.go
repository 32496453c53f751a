// Package pagecache tells which pages of a mapping are in the page cache:
// mincore(2), which golang.org/x/sys/unix does not wrap on Linux. It never
// faults a page in, so it is safe on a mapping of the daemon's own mount.
package pagecache

import (
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Pages is the number of pages that n bytes of a mapping span.
func Pages(n int) int {
	ps := os.Getpagesize()
	return (n + ps - 1) / ps
}

// Mincore sets bit 0 of vec[i] when page i of the mapping b is resident.
// vec must hold at least Pages(len(b)) bytes.
func Mincore(b, vec []byte) error {
	if len(b) == 0 {
		return nil
	}
	if len(vec) < Pages(len(b)) {
		return unix.EINVAL
	}
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// Resident reports, for each page of the mapping b, whether it is resident.
func Resident(b []byte) ([]bool, error) {
	vec := make([]byte, Pages(len(b)))
	if err := Mincore(b, vec); err != nil {
		return nil, err
	}
	out := make([]bool, len(vec))
	for i, v := range vec {
		out[i] = v&1 != 0
	}
	return out, nil
}

// Count returns how many pages of the mapping b are resident.
func Count(b []byte) (int, error) {
	res, err := Resident(b)
	n := 0
	for _, r := range res {
		if r {
			n++
		}
	}
	return n, err
}

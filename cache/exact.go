package cache

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Exact faults: a populate that maps only the pages asked for.
//
// A read fault on a file mapping maps more than its page: fault-around maps
// the cached pages of a 64 KiB window, and a large folio in the page cache
// is mapped whole (measured on 6.18: populating one page of a warm 4 MiB
// ext4 file mapped 256). In the pinner's locked mapping every page mapped is
// locked, so trimFaultAround has to find and unmap them again: a pagemap read
// and an madvise (with its TLB shootdown) for every pinned run.
//
// The kernel maps single pages, with no fault-around, in a VMA registered
// with a userfaultfd (uffd_disable_fault_around, and finish_fault's per-page
// path for userfaultfd_armed VMAs). Write-protect mode with
// UFFD_FEATURE_WP_ASYNC (6.7) may be registered on any memory type and
// delivers no events: a read-only mapping never write-faults, so nothing is
// ever asked of us. Registration needs VM_MAYWRITE, hence MAP_PRIVATE (a
// private read-only mapping maps the page cache's own pages until written,
// which it never is). The userfaultfd asks for user-mode faults only, which
// any process may (whatever vm.unprivileged_userfaultfd says). Where any of
// it is refused (an older kernel, a seccomp filter), the pinner trims
// instead.
//
// A 2 MiB folio would still be mapped whole by one PMD, which MADV_NOHUGEPAGE
// prevents only since 6.12 (do_set_pmd checks vma_thp_disabled); trimming
// part of a file PMD unmaps all of it, pinned pages included. So exact
// faults are used on 6.12 and later only.

// Constants of <linux/userfaultfd.h>, which x/sys/unix does not carry.
const (
	uffdAPI             = 0xAA
	uffdUserModeOnly    = 1          // UFFD_USER_MODE_ONLY (5.11)
	uffdioAPI           = 0xC018AA3F // _IOWR(0xAA, 0x3F, struct uffdio_api)
	uffdioRegister      = 0xC020AA00 // _IOWR(0xAA, 0x00, struct uffdio_register)
	uffdFeatureWPAsync  = 1 << 15
	uffdRegisterModeWP  = 1 << 1
	uffdioWriteProtectB = 6 // _UFFDIO_WRITEPROTECT: the ioctl bit a WP registration grants
)

// newExactFaults opens a userfaultfd for write-protect registrations with
// asynchronous resolution; -1 and why not if the kernel refuses.
func newExactFaults() (int, error) {
	if !kernelAtLeast(6, 12) {
		return -1, fmt.Errorf("kernel older than 6.12 (a 2 MiB folio may be mapped whole despite MADV_NOHUGEPAGE)")
	}
	// User-mode faults only: that is all an unprivileged process may ask
	// for (vm.unprivileged_userfaultfd=0), and the registration turns
	// fault-around off for every fault in the VMA all the same.
	fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK|uffdUserModeOnly, 0, 0)
	if errno != 0 {
		return -1, fmt.Errorf("userfaultfd: %w", errno)
	}
	api := struct{ api, features, ioctls uint64 }{api: uffdAPI, features: uffdFeatureWPAsync}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, uffdioAPI, uintptr(unsafe.Pointer(&api))); errno != 0 {
		_ = unix.Close(int(fd))
		return -1, fmt.Errorf("UFFDIO_API with UFFD_FEATURE_WP_ASYNC: %w", errno)
	}
	return int(fd), nil
}

// registerExact registers mapping b with userfaultfd fd in write-protect
// mode, so that faults in it map single pages.
func registerExact(fd int, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	reg := struct {
		start, len, mode, ioctls uint64
	}{start: uint64(uintptr(unsafe.Pointer(&b[0]))), len: uint64(len(b)+PageSize-1) &^ (PageSize - 1), mode: uffdRegisterModeWP}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uffdioRegister, uintptr(unsafe.Pointer(&reg))); errno != 0 {
		return fmt.Errorf("UFFDIO_REGISTER (write-protect): %w", errno)
	}
	if reg.ioctls&(1<<uffdioWriteProtectB) == 0 {
		return fmt.Errorf("UFFDIO_REGISTER (write-protect): no write-protect ioctl granted (%#x)", reg.ioctls)
	}
	return nil
}

// kernelAtLeast reports whether the running kernel's release is at least
// major.minor (false if it cannot tell).
func kernelAtLeast(major, minor int) bool {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return false
	}
	var ma, mi int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &ma, &mi); err != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

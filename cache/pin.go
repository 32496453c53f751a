package cache

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// ErrPinUnavailable is returned by Pin once mlock has been refused (no
// CAP_IPC_LOCK and RLIMIT_MEMLOCK too low): the hot tier then runs unpinned.
var ErrPinUnavailable = errors.New("mlock unavailable: hot tier runs unpinned")

var errPinnerClosed = errors.New("pinner closed")

// TableFile tells the pinner where table t lives in the daemon's own view:
// the path of the table file (inside the mount) and its size.
type TableFile struct {
	Path string
	Size int64
}

// Pinner keeps pages of the table files in the kernel page cache by locking
// them in the daemon's own read-only shared mapping of each file. Locked pages
// are never reclaimed, so readers in other processes hit them with a minor
// fault; there is one copy of the data, the page cache's.
//
// Kernel rules it follows (measured on 6.18):
//   - Each table is mapped once and locked whole with mlock2(MLOCK_ONFAULT):
//     nothing is faulted in, but every page that gets mapped is locked. Pin
//     maps a page (MADV_POPULATE_READ: an error, not SIGBUS, if the read
//     fails); Unpin unmaps it (MADV_DONTNEED_LOCKED), which unlocks it. The
//     first design, mlock and munlock of single pages, split the mapping's
//     VMA at every pinned page: 2 VMAs a page, and the split VMAs did not
//     all merge back on munlock, so a 1 GiB tier under churn passed 575,000
//     VMAs, mlock failed with ENOMEM and then the Go runtime's own mmap did
//     (the daemon aborted). Locking whole mappings keeps one VMA per table.
//   - Populating a page also maps its cached neighbours in the same 64 KiB
//     window (fault-around, even under MADV_RANDOM), and they would be locked
//     too: the pinner unmaps every page of the window it has not pinned.
//   - Populating a page that is not in the page cache faults it through our
//     own FUSE Read handler when the file is on the mount (~36 µs). Call Pin
//     only from a goroutine that no Read handler waits for.
//   - VmLck counts the whole locked mapping; what is really pinned is
//     "Locked" in /proc/self/smaps_rollup (lockedBytes).
//   - A mapping of a file on the mount keeps the mount busy: Close before
//     unmounting.
//
// All methods are safe for concurrent use.
type Pinner struct {
	files   []TableFile
	log     *zap.Logger
	capLock bool               // CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply
	mlock   func([]byte) error // populates (so locks) a run; tests inject failures

	mu       sync.Mutex
	maps     [][]byte       // GUARDED_BY(mu); per table, nil until first used
	pinned   [][]uint64     // GUARDED_BY(mu); per table, a bit per page pinned
	closed   bool           // GUARDED_BY(mu)
	inflight sync.WaitGroup // calls using a mapping; Close waits for them before munmap

	unavailable atomic.Bool
	warnOnce    sync.Once
}

// NewPinner pins pages of files; PageKey.Table indexes files. It maps
// nothing yet. It probes mlock on one anonymous page: a process that may not
// lock at all (EPERM) logs one warning and runs unpinned from the start.
func NewPinner(files []TableFile, log *zap.Logger) *Pinner {
	if log == nil {
		log = zap.NewNop()
	}
	p := &Pinner{files: files, log: log, capLock: hasCapIPCLock(), mlock: populate,
		maps: make([][]byte, len(files)), pinned: make([][]uint64, len(files))}
	if b, err := unix.Mmap(-1, 0, PageSize, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err == nil {
		if err := unix.Mlock(b); err != nil && p.refused(err, 0) {
			p.disable(err)
		}
		_ = unix.Munmap(b) // also unlocks
	}
	return p
}

// Available reports whether pages can be pinned (false once mlock was refused).
func (p *Pinner) Available() bool { return !p.unavailable.Load() }

// Pin locks page k in the page cache.
func (p *Pinner) Pin(k PageKey) error { return p.PinRun(k.Table, k.Page, 1) }

// Unpin releases page k.
func (p *Pinner) Unpin(k PageKey) error { return p.UnpinRun(k.Table, k.Page, 1) }

// PinRun locks n adjacent pages of table from page first on. The last page
// of a file is clipped to its size. On error no page of the run is left
// locked by this call. Once locking has been refused it returns
// ErrPinUnavailable without a system call.
func (p *Pinner) PinRun(table uint32, first, n uint64) error {
	if p.unavailable.Load() {
		return ErrPinUnavailable
	}
	r, err := p.run(table, first, n, true)
	if err != nil || r == nil {
		return wrapRun("pin", table, first, n, err)
	}
	defer p.inflight.Done()
	if p.unavailable.Load() { // the mapping could not be locked
		return ErrPinUnavailable
	}
	if err := p.mlock(r); err != nil {
		_ = unix.Madvise(r, unix.MADV_DONTNEED_LOCKED) // whatever did get mapped
		if p.refused(err, len(r)) {
			p.disable(err)
			return ErrPinUnavailable
		}
		return wrapRun("pin", table, first, n, fmt.Errorf("mlock: %w", err))
	}
	p.setPinned(table, first, n, true)
	p.trimFaultAround(table, first, n)
	return nil
}

// faultAroundPages is the kernel's default fault-around window (64 KiB).
const faultAroundPages = 16

// MaxTransientPages bounds the pages locked beyond the pinned set: while a run
// is being pinned, the cached neighbours that fault-around mapped at its two
// ends are locked until trimFaultAround unmaps them.
const MaxTransientPages = 2 * (faultAroundPages - 1)

// trimFaultAround unmaps (so unlocks) the pages that populating
// [first, first+n) mapped around it and that are not pinned.
func (p *Pinner) trimFaultAround(table uint32, first, n uint64) {
	lo := first &^ (faultAroundPages - 1)
	hi := (first + n + faultAroundPages - 1) &^ (faultAroundPages - 1)
	p.mu.Lock()
	b, bits := p.maps[table], p.pinned[table]
	var runs [][2]uint64
	pages := uint64(len(b)+PageSize-1) / PageSize
	for q := lo; q < min(hi, pages); q++ {
		if bits[q/64]&(1<<(q%64)) != 0 {
			continue
		}
		if k := len(runs); k > 0 && runs[k-1][1] == q {
			runs[k-1][1] = q + 1
		} else {
			runs = append(runs, [2]uint64{q, q + 1})
		}
	}
	p.mu.Unlock()
	for _, r := range runs {
		end := min(r[1]*PageSize, uint64(len(b)))
		_ = unix.Madvise(b[r[0]*PageSize:end], unix.MADV_DONTNEED_LOCKED)
	}
}

func (p *Pinner) setPinned(table uint32, first, n uint64, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	bits := p.pinned[table]
	for q := first; q < first+n && q/64 < uint64(len(bits)); q++ {
		if on {
			bits[q/64] |= 1 << (q % 64)
		} else {
			bits[q/64] &^= 1 << (q % 64)
		}
	}
}

// populate maps the pages of r (so, in a locked mapping, locks them); a
// failed read is an error, not a SIGBUS.
func populate(r []byte) error {
	return unix.Madvise(r, unix.MADV_POPULATE_READ)
}

// UnpinRun releases n adjacent pages: MADV_DONTNEED_LOCKED unmaps them from
// the pinner's locked mapping, so they are reclaimable again (the page cache
// keeps them until memory is needed).
func (p *Pinner) UnpinRun(table uint32, first, n uint64) error {
	r, err := p.run(table, first, n, false)
	if err != nil || r == nil {
		return wrapRun("unpin", table, first, n, err)
	}
	defer p.inflight.Done()
	p.setPinned(table, first, n, false)
	if err := unix.Madvise(r, unix.MADV_DONTNEED_LOCKED); err != nil {
		return wrapRun("unpin", table, first, n, fmt.Errorf("madvise(MADV_DONTNEED_LOCKED): %w", err))
	}
	return nil
}

// Resident reports whether page k is in the page cache (mincore on the
// pinner's mapping, which it creates if needed; it never faults the page in).
func (p *Pinner) Resident(k PageKey) bool {
	r, err := p.run(k.Table, k.Page, 1, true)
	if err != nil || r == nil {
		return false
	}
	defer p.inflight.Done()
	var vec [1]byte
	// x/sys/unix has no mincore wrapper on Linux.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&r[0])), uintptr(len(r)), uintptr(unsafe.Pointer(&vec[0])))
	return errno == 0 && vec[0]&1 != 0
}

// Close munlocks and munmaps every mapping, after waiting for calls in
// progress. Later calls fail. Call it before unmounting: a mapping of a file
// on the mount keeps the mount busy.
func (p *Pinner) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for t, b := range p.maps {
		if b == nil {
			continue
		}
		if err := unix.Munmap(b); err != nil { // unlocks too
			errs = append(errs, fmt.Errorf("close table %d: munmap: %w", t, err))
		}
		p.maps[t], p.pinned[t] = nil, nil
	}
	return errors.Join(errs...)
}

// run returns the bytes of pages [first, first+n) of table in the pinner's
// mapping, clipped to the file size, mapping the file if create is set. A nil
// slice with a nil error means there is nothing to do (n == 0, or no mapping
// to unpin from). On a non-nil slice the caller must call p.inflight.Done.
// LOCKS_EXCLUDED(p.mu)
func (p *Pinner) run(table uint32, first, n uint64, create bool) ([]byte, error) {
	if n == 0 {
		return nil, nil
	}
	if int(table) >= len(p.files) {
		return nil, fmt.Errorf("no table %d (%d tables)", table, len(p.files))
	}
	f := p.files[table]
	size := uint64(max(f.Size, 0))
	if pages := (size + PageSize - 1) / PageSize; first >= pages || n > pages-first {
		return nil, fmt.Errorf("past the end of %s (%d bytes)", f.Path, f.Size)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errPinnerClosed
	}
	b := p.maps[table]
	if b == nil && !create {
		p.mu.Unlock()
		return nil, nil
	}
	p.inflight.Add(1) // from here on Close waits for this call
	p.mu.Unlock()
	if b == nil {
		// Map outside the lock: open and mmap go through our own FUSE
		// handlers when the file is on the mount.
		m, err := mapFile(f)
		if err != nil {
			p.inflight.Done()
			return nil, err
		}
		// Lock the whole mapping, on fault: one VMA, nothing read yet.
		if err := mlockOnFault(m); err != nil && p.refused(err, 0) {
			p.disable(err)
		}
		p.mu.Lock()
		if b = p.maps[table]; b == nil {
			p.maps[table], b = m, m
			p.pinned[table] = make([]uint64, (uint64(len(m))/PageSize+64)/64)
		} else {
			_ = unix.Munmap(m) // another call mapped it first
		}
		p.mu.Unlock()
	}
	end := min((first+n)*PageSize, size)
	return b[first*PageSize : end : end], nil
}

func mapFile(f TableFile) ([]byte, error) {
	fd, err := unix.Open(f.Path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", f.Path, err)
	}
	defer unix.Close(fd) // the mapping keeps its own reference to the file
	b, err := unix.Mmap(fd, 0, int(f.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s (%d bytes): %w", f.Path, f.Size, err)
	}
	// Without MADV_RANDOM, the fault that mlock takes on a cold page reads
	// ahead around it (up to 128 KiB): pinning one page would read 32.
	if err := unix.Madvise(b, unix.MADV_RANDOM); err != nil {
		_ = unix.Munmap(b)
		return nil, fmt.Errorf("madvise %s (MADV_RANDOM): %w", f.Path, err)
	}
	return b, nil
}

// mlockOnFault is mlock2(MLOCK_ONFAULT): pages of b are locked as they get
// mapped, none is faulted in now.
func mlockOnFault(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, _, errno := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MLOCK_ONFAULT)
	if errno != 0 {
		return errno
	}
	return nil
}

func wrapRun(op string, table uint32, first, n uint64, err error) error {
	if err == nil || errors.Is(err, ErrPinUnavailable) {
		return err
	}
	if n == 1 {
		return fmt.Errorf("%s table %d page %d: %w", op, table, first, err)
	}
	return fmt.Errorf("%s table %d pages %d-%d: %w", op, table, first, first+n-1, err)
}

// refused tells a refusal to lock (run unpinned from now on) from a failure
// of these pages. mlock returns EPERM without CAP_IPC_LOCK and a zero
// RLIMIT_MEMLOCK, and EAGAIN when memory is short; ENOMEM means either the
// RLIMIT_MEMLOCK budget is spent, or a page could not be faulted in (EIO from
// the mount, past EOF) or the VMA limit was hit. Only the first is a
// refusal, and it cannot happen with CAP_IPC_LOCK.
func (p *Pinner) refused(err error, n int) bool {
	switch {
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EAGAIN):
		return true
	case errors.Is(err, unix.ENOMEM):
		if p.capLock {
			return false
		}
		var lim unix.Rlimit
		if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) != nil || lim.Cur == unix.RLIM_INFINITY {
			return false
		}
		locked, ok := lockedBytes()
		return !ok || locked+uint64(n) > lim.Cur
	}
	return false
}

func (p *Pinner) disable(err error) {
	p.unavailable.Store(true)
	p.warnOnce.Do(func() {
		var lim unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim)
		p.log.Warn("mlock refused: the hot tier runs unpinned; grant CAP_IPC_LOCK or raise RLIMIT_MEMLOCK (ulimit -l)",
			zap.Error(err), zap.Bool("cap_ipc_lock", p.capLock), zap.Uint64("rlimit_memlock", lim.Cur))
	})
}

func hasCapIPCLock() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[unix.CAP_IPC_LOCK/32].Effective&(1<<(unix.CAP_IPC_LOCK%32)) != 0
}

// lockedBytes is the memory this process has locked and resident: "Locked"
// of /proc/self/smaps_rollup (VmLck counts whole MLOCK_ONFAULT mappings).
func lockedBytes() (uint64, bool) {
	return procKB("/proc/self/smaps_rollup", "Locked:")
}

func procKB(path, field string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	s := bufio.NewScanner(bytes.NewReader(b))
	for s.Scan() {
		if rest, ok := bytes.CutPrefix(s.Bytes(), []byte(field)); ok {
			kb, err := strconv.ParseUint(string(bytes.TrimSuffix(bytes.TrimSpace(rest), []byte(" kB"))), 10, 64)
			return kb * 1024, err == nil
		}
	}
	return 0, false
}

// memlockPages is how many more pages RLIMIT_MEMLOCK lets this process
// lock; -1 if it does not apply (CAP_IPC_LOCK, or no limit).
func (p *Pinner) memlockPages() int64 {
	var lim unix.Rlimit
	if p.capLock || unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) != nil || lim.Cur == unix.RLIM_INFINITY {
		return -1
	}
	locked, _ := lockedBytes()
	return int64(max(lim.Cur, locked)-locked) / PageSize
}

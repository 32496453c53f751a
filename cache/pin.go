package cache

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/pagecache"
)

// ErrPinUnavailable is returned by Pin once mlock has been refused (no
// CAP_IPC_LOCK and RLIMIT_MEMLOCK below the table files' size, or EPERM): the
// hot tier then runs unpinned.
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
//   - Populating a page also maps cached neighbours (fault-around, even
//     under MADV_RANDOM, aligned by virtual address; and whole large
//     folios), and they would be locked too: the pinner unmaps every page
//     of the page tables around the run that it has not pinned, on success
//     and on error (trimFaultAround).
//   - Without CAP_IPC_LOCK, mlock2(MLOCK_ONFAULT) charges the whole mapping
//     to RLIMIT_MEMLOCK and fails with ENOMEM above it; the pinner then runs
//     unpinned (one warning) and reports nothing pinned.
//   - Populating a page that is not in the page cache would fault it
//     through our own FUSE Read handler, with this process's mmap lock held
//     for the whole round trip. That deadlocked the daemon beside a
//     benchmark: the Go runtime's heap mmap queued as a writer behind the
//     populate, and the handler's O_DIRECT read pins its buffer (GUP), which
//     takes the mmap lock as a reader and waited behind the writer. So the
//     pinner first reads the run with pread(2) through the page cache (no
//     mmap lock held; readThrough), and the populate then only maps cached
//     pages. A page evicted between the two calls is still read under the
//     lock: rare (it was cached a moment ago), not excluded. Call Pin only
//     from a goroutine that no Read handler waits for.
//   - VmLck counts the whole locked mapping, and smaps "Locked" is the
//     locked pages' proportional share (divided among the processes that
//     map them: 40 MiB shown while 356 MiB were pinned). The pinner's own
//     count (PinnedPages, the bitmap) is what is pinned; lockedBytes is only
//     a lower bound of what this process already holds against
//     RLIMIT_MEMLOCK.
//   - A page is charged to the memory cgroup of the process whose access
//     brought it into the page cache, and locking it does not move the
//     charge: a reader's fault pinned as it is would be memory the
//     reader's cgroup cannot reclaim. With a Recharger the pinner stores
//     such a page again from the daemon before recording it pinned
//     (charge.go).
//   - A mapping of a file on the mount keeps the mount busy: Close before
//     unmounting.
//
// All methods are safe for concurrent use.
type Pinner struct {
	files       []TableFile
	log         *zap.Logger
	capLock     bool                            // CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply
	mlock       func([]byte) error              // populates (so locks) a run; tests inject failures
	mmap        func(TableFile) ([]byte, error) // maps a table file; tests place the mapping
	lockMapping func([]byte) error              // mlock2(MLOCK_ONFAULT) of a whole mapping; tests inject refusals

	mu       sync.RWMutex
	maps     [][]byte       // GUARDED_BY(mu); per table, nil until first used
	pinned   [][]uint64     // GUARDED_BY(mu); per table, a bit per page locked: the one record of "pinned"
	closed   bool           // GUARDED_BY(mu)
	inflight sync.WaitGroup // calls using a mapping; Close waits for them before munmap

	// mapping is, per table, non-nil while the table's first map is under
	// way (run), and closed when it is done. GUARDED_BY(mu)
	mapping []chan struct{}

	seen *Seen // nil: every page may be cached (SetSeen)

	pagemapOnce sync.Once
	pagemap     *os.File      // /proc/self/pagemap; nil if it cannot be read
	trims       atomic.Uint64 // trimFaultAround calls, for its audits
	pagemaps    atomic.Uint64 // pagemap reads (tests)
	wideTrim    atomic.Bool   // an audit found faults mapping beyond around
	around      uint64        // aroundPages; tests narrow it

	exact     []bool // GUARDED_BY(mu); per table: its mapping faults single pages (exact.go), no trim needed
	noExact   bool   // tests: always trim
	trimOff   bool   // tests: never trim
	exactOnce sync.Once
	exactFD   int // the userfaultfd of the exact mappings; -1 if none

	readers   []*os.File  // GUARDED_BY(mu); per table, nil until first used: readThrough's descriptor
	readerFDs []int       // GUARDED_BY(mu); their numbers (File.Fd costs two fcntl calls each time)
	readBuf   sync.Pool   // *[]byte scratch for readThrough
	noStat    atomic.Bool // cachestat(2) is missing: ResidentRun asks mincore always

	count       atomic.Int64 // pages with their bit set in pinned
	unavailable atomic.Bool
	warnOnce    sync.Once

	popMu  sync.Mutex
	popRun [3]uint64   // GUARDED_BY(popMu); table, first, end of the run being populated
	popOn  atomic.Bool // a run is being populated

	charge charges // whose memory cgroup pays for a pin (charge.go)
}

// NewPinner pins pages of files; PageKey.Table indexes files. It maps
// nothing yet. It probes mlock on one anonymous page: a process that may not
// lock at all (EPERM) logs one warning and runs unpinned from the start.
func NewPinner(files []TableFile, log *zap.Logger) *Pinner {
	if log == nil {
		log = zap.NewNop()
	}
	p := &Pinner{files: files, log: log, capLock: hasCapIPCLock(), mlock: populate, mmap: mapFile, lockMapping: mlockOnFault, around: aroundPages, maps: make([][]byte, len(files)), pinned: make([][]uint64, len(files)), exact: make([]bool, len(files)), exactFD: -1}
	if b, err := unix.Mmap(-1, 0, PageSize, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err == nil {
		if err := unix.Mlock(b); err != nil {
			p.disable(err)
		}
		_ = unix.Munmap(b) // also unlocks
	}
	// mlock2(MLOCK_ONFAULT) charges every table's whole mapping to
	// RLIMIT_MEMLOCK at once (measured on 6.18: ENOMEM without CAP_IPC_LOCK
	// as soon as the mapping is larger than the limit, however little is
	// resident). Say so now, once, rather than on the first pin.
	if !p.capLock && p.Available() {
		var lim unix.Rlimit
		if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) == nil && lim.Cur != unix.RLIM_INFINITY {
			need := uint64(0)
			for _, f := range files {
				need += (uint64(max(f.Size, 0)) + PageSize - 1) &^ (PageSize - 1)
			}
			if locked, _ := lockedBytes(); need+locked > lim.Cur {
				p.disable(fmt.Errorf("the table files (%d bytes) exceed RLIMIT_MEMLOCK (%d bytes) without CAP_IPC_LOCK", need, lim.Cur))
			}
		}
	}
	return p
}

// Available reports whether pages can be pinned (false once mlock was refused).
func (p *Pinner) Available() bool { return !p.unavailable.Load() }

// Pin locks page k in the page cache.
func (p *Pinner) Pin(k PageKey) error { return p.PinRun(k.Table, k.Page, 1) }

// Unpin releases page k.
func (p *Pinner) Unpin(k PageKey) error { return p.UnpinRun(k.Table, k.Page, 1) }

// Pinned reports whether page k is locked now: its populate into a locked
// mapping succeeded and it has not been unpinned since. LOCKS_EXCLUDED(p.mu)
func (p *Pinner) Pinned(k PageKey) bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if int(k.Table) >= len(p.pinned) {
		return false
	}
	bits := p.pinned[k.Table]
	return k.Page/64 < uint64(len(bits)) && bitSet(bits, k.Page)
}

// PinnedPages is how many pages are locked now.
func (p *Pinner) PinnedPages() int64 { return p.count.Load() }

// Populating reports whether page k belongs to the run the pinner is
// populating right now: a FUSE read of it is the pinner's own fault, not a
// reader's demand. LOCKS_EXCLUDED(p.popMu)
func (p *Pinner) Populating(k PageKey) bool {
	if !p.popOn.Load() {
		return false
	}
	p.popMu.Lock()
	defer p.popMu.Unlock()
	return p.popOn.Load() && uint64(k.Table) == p.popRun[0] && k.Page >= p.popRun[1] && k.Page < p.popRun[2]
}

// PinRun locks n adjacent pages of table from page first on. The last page
// of a file is clipped to its size. On error no page of the run that was not
// pinned before is left locked, nor any neighbour. Once locking has been
// refused it returns ErrPinUnavailable without a system call.
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
	p.popMu.Lock()
	p.popRun = [3]uint64{uint64(table), first, first + n}
	p.popOn.Store(true)
	p.popMu.Unlock()
	if err := p.readThrough(table, int64(first*PageSize), len(r)); err != nil {
		p.popOn.Store(false)
		return wrapRun("pin", table, first, n, err)
	}
	for try := 0; ; try++ {
		// EINTR: a signal reached the populate; the pages done so far stay
		// mapped and are skipped on the retry.
		if err = p.mlock(r); err == nil || try == 3 || !errors.Is(err, unix.EINTR) && !errors.Is(err, unix.EAGAIN) {
			break
		}
	}
	var foreign []uint64 // pages left charged to a reader's cgroup (charge.go)
	if err == nil {
		foreign, err = p.ownCharge(table, first, r)
	}
	p.popOn.Store(false)
	if err != nil {
		// Whatever did get mapped (the run's pages up to the failure and
		// their fault-around neighbours) is locked: unmap all that is not
		// pinned. The run itself first: with exact faults the trim reads
		// nothing (it trusts that only pinned pages are mapped), so the
		// pages populated before the failure stayed locked, unrecorded,
		// until an audit found them and turned exact faults off for good.
		p.unmapUnpinned(table, first, n)
		p.trimFaultAround(table, first, n)
		if errors.Is(err, unix.EPERM) {
			p.disable(err)
			return ErrPinUnavailable
		}
		return wrapRun("pin", table, first, n, fmt.Errorf("populate: %w", err))
	}
	if len(foreign) > 0 {
		if !p.setPinnedExcept(table, first, n, foreign) {
			return ErrPinUnavailable // as below
		}
		p.trimFaultAround(table, first, n)
		return wrapRun("pin", table, first, n, fmt.Errorf("%d of its pages: %w", len(foreign), ErrChargedElsewhere))
	}
	if !p.setPinned(table, first, n, true) {
		// disable ran during the populate: it unlocked the mapping and
		// cleared the bits; recording the run now would report pages
		// pinned that are not, and hints would skip them for good.
		return ErrPinUnavailable
	}
	p.trimFaultAround(table, first, n)
	return nil
}

// unmapUnpinned unmaps (so unlocks) the pages of [first, first+n) of table
// that are mapped and not pinned: what a populate that failed part way
// left behind. LOCKS_EXCLUDED(p.mu)
func (p *Pinner) unmapUnpinned(table uint32, first, n uint64) {
	p.mu.RLock()
	b := p.maps[table]
	if b == nil {
		p.mu.RUnlock()
		return
	}
	pages := (uint64(len(b)) + PageSize - 1) / PageSize
	runs := unpinnedRuns(nil, p.pinned[table], first, min(first+n, pages), nil)
	p.mu.RUnlock()
	p.unmapRuns(table, b, runs)
}

// tablePages is the reach of one page table (PTRS_PER_PTE pages, 2 MiB):
// everything a fault maps besides the faulting page stays within it.
const tablePages = 512

// aroundPages is the kernel's default fault-around window (fault_around_bytes,
// 64 KiB): a fault maps the cached pages of the window, aligned by virtual
// address, that holds the faulting page.
const aroundPages = 16

// auditEvery: the first trim and one in this many after it read the whole
// page tables of their run, to find out whether faults map beyond
// aroundPages here (a raised fault_around_bytes); the pinner then unmaps
// what earlier trims missed (sweep) and always reads whole page tables.
const auditEvery = 64

// MaxTransientPages bounds the pages locked beyond the pinned set: while a run
// is being pinned, the cached neighbours that the populate mapped around its
// two ends (within their page tables) are locked until trimFaultAround
// unmaps them.
const MaxTransientPages = 2 * (tablePages - 1)

// trimFaultAround unmaps (so unlocks) the pages that populating
// [first, first+n) mapped around it and that are not pinned.
//
// A fault maps more than the faulting page (measured on 6.18, ext4 and the
// mount): fault-around maps the cached pages of a fault_around_bytes window
// (64 KiB) aligned by virtual address (pte_index), not by file offset, and
// a large folio is mapped whole when it fits the VMA and the page table. A
// trim of the file-aligned 64 KiB window left 6, 10 and 2 neighbours locked
// with mapping bases 6, 10 and 2 pages past a 64 KiB boundary, and up to 241
// with a warm ext4 file. Both stay within the page table of the faulting
// address, so the pinner reads which pages are mapped (/proc/self/pagemap)
// and unmaps the ones it has not pinned.
//
// It reads the run's fault-around windows and one page either side first
// (18 entries for one page, not 1024: the whole page tables cost 9% of the
// daemon's CPU under hinted decode). A large folio mapped whole is contiguous
// with the faulting page, so if it reaches past the windows, the page just
// past them is mapped: only then (or on an audit, or once an audit found
// pages mapped beyond the windows) are the whole page tables read.
func (p *Pinner) trimFaultAround(table uint32, first, n uint64) {
	p.mu.RLock()
	b := p.maps[table]
	if b == nil || p.trimOff {
		p.mu.RUnlock()
		return
	}
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	pages := (uint64(len(b)) + PageSize - 1) / PageSize
	bits := p.pinned[table]
	if p.exact[table] && !p.wideTrim.Load() {
		// Nothing to trim; an audit checks that now and then.
		var runs [][2]uint64
		if p.trims.Add(1)%auditEvery == 1 {
			lo, hi := faultWindow(base, first, n, tablePages*PageSize, pages)
			runs = unpinnedRuns(nil, bits, lo, hi, p.mappedPages(base, lo, hi))
		}
		p.mu.RUnlock()
		if len(runs) > 0 {
			p.wideTrim.Store(true)
			p.log.Warn("exact faults mapped pages that were not asked for; the pinner reads whole page tables from now on",
				zap.Uint32("table", table), zap.Uint64("page", runs[0][0]))
			p.unmapRuns(table, b, runs)
			p.sweep()
		}
		return
	}
	lo, hi, mapped, widened := p.faultMapped(base, first, n, pages, bits)
	runs := unpinnedRuns(nil, bits, lo, hi, mapped)
	p.mu.RUnlock()
	p.unmapRuns(table, b, runs)
	if widened {
		p.sweep()
	}
}

// sweep unmaps every page mapped and not pinned in every table: the
// neighbours that trims of the narrow windows missed before an audit found
// faults mapping wider.
func (p *Pinner) sweep() {
	p.mu.RLock()
	maps := slices.Clone(p.maps)
	p.mu.RUnlock()
	for t, b := range maps {
		if b == nil {
			continue
		}
		base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
		pages := (uint64(len(b)) + PageSize - 1) / PageSize
		var runs [][2]uint64
		p.mu.RLock()
		for lo := uint64(0); lo < pages; lo += tablePages {
			hi := min(lo+tablePages, pages)
			runs = unpinnedRuns(runs, p.pinned[t], lo, hi, p.mappedPages(base, lo, hi))
		}
		p.mu.RUnlock()
		p.unmapRuns(uint32(t), b, runs)
	}
}

// unpinnedRuns appends to runs the runs of pages in [lo, hi) that are mapped
// (mapped nil: all) and not pinned in bits.
func unpinnedRuns(runs [][2]uint64, bits []uint64, lo, hi uint64, mapped []bool) [][2]uint64 {
	for q := lo; q < hi; q++ {
		if bitSet(bits, q) || mapped != nil && !mapped[q-lo] {
			continue
		}
		if k := len(runs); k > 0 && runs[k-1][1] == q {
			runs[k-1][1] = q + 1
		} else {
			runs = append(runs, [2]uint64{q, q + 1})
		}
	}
	return runs
}

// bitSet reports whether page q's bit is set in a pinned bitmap.
func bitSet(bits []uint64, q uint64) bool { return bits[q/64]&(1<<(q%64)) != 0 }

// unmapRuns unmaps (so unlocks) runs of table's mapping b.
func (p *Pinner) unmapRuns(table uint32, b []byte, runs [][2]uint64) {
	for _, r := range runs {
		end := min(r[1]*PageSize, uint64(len(b)))
		if err := unix.Madvise(b[r[0]*PageSize:end], unix.MADV_DONTNEED_LOCKED); err != nil {
			p.log.Warn("unmapping fault-around neighbours failed; they stay locked until close",
				zap.Uint32("table", table), zap.Uint64("first", r[0]), zap.Uint64("pages", r[1]-r[0]), zap.Error(err))
		}
	}
}

// faultMapped returns the file pages [lo, hi) that populating [first,
// first+n) of the mapping at base may have mapped, and which of them are
// mapped (nil: unknown, treat all as mapped); bits are the table's pinned
// pages. See trimFaultAround. SHARED_LOCKS_REQUIRED(p.mu)
func (p *Pinner) faultMapped(base, first, n, pages uint64, bits []uint64) (lo, hi uint64, mapped []bool, widened bool) {
	audit := !p.wideTrim.Load() && p.trims.Add(1)%auditEvery == 1
	lo, hi = faultWindow(base, first, n, tablePages*PageSize, pages)
	// The windows and up to probeSlack pages either side of them within the
	// page tables (a folio is mapped whole only within its page table).
	nlo, nhi := faultWindow(base, first, n, p.around*PageSize, pages)
	plo, phi := max(lo, nlo-min(nlo, probeSlack)), min(hi, nhi+probeSlack)
	pinned := func(q uint64) bool { return bitSet(bits, q) }
	if !audit && !p.wideTrim.Load() {
		if m := p.mappedPages(base, plo, phi); m != nil && !reachesPast(m, plo, nlo, nhi, phi, lo, hi, pinned) {
			return nlo, nhi, m[nlo-plo : nhi-plo], false
		}
		// Unknown, or a folio may reach past the windows.
	}
	mapped = p.mappedPages(base, lo, hi)
	if audit && mapped != nil && !reachesPast(mapped[plo-lo:phi-lo], plo, nlo, nhi, phi, lo, hi, pinned) {
		// Nothing reaches the probes, so nothing should be mapped and
		// unpinned beyond them; if something is, faults map wider here.
		for q := lo; q < hi; q++ {
			if (q < plo || q >= phi) && mapped[q-lo] && !pinned(q) {
				p.wideTrim.Store(true)
				widened = true
				p.log.Warn("faults map pages beyond the 64 KiB fault-around window here (fault_around_bytes raised?); the pinner reads whole page tables from now on",
					zap.Uint64("page", q))
				break
			}
		}
	}
	return lo, hi, mapped, widened
}

// probeSlack bounds how far past the fault-around windows the pinner looks
// for the first page it has not pinned (its probe); see reachesPast.
const probeSlack = 24

// reachesPast reports whether a large folio that the run's faults mapped may
// reach past the windows [nlo, nhi), from m, the mapped state of pages [plo,
// phi) around them, within page tables [lo, hi). A folio mapped whole is
// contiguous with its faulting page, so going outward from the windows, the
// first page not pinned by us is mapped if the folio reaches it; if that page
// is unmapped, the folio stops before it. Pinned pages are mapped anyway and
// say nothing, so they are stepped over; past probeSlack of them it gives up
// (true). A window that ends at its page table's end needs no probe there.
func reachesPast(m []bool, plo, nlo, nhi, phi, lo, hi uint64, pinned func(uint64) bool) bool {
	side := func(q uint64, step int, stop, edge uint64) bool {
		for ; q != stop; q = uint64(int64(q) + int64(step)) {
			if !pinned(q) {
				return m[q-plo]
			}
		}
		return stop != edge // ran out of probes before the page table's end
	}
	below := nlo > lo && side(nlo-1, -1, plo-1, lo-1)
	above := nhi < hi && side(nhi, 1, phi, hi)
	return below || above
}

// mappedPages reports, for file pages [lo, hi) of the mapping at base,
// whether each is mapped (present in /proc/self/pagemap); nil if pagemap
// cannot be read (then every page is treated as mapped).
func (p *Pinner) mappedPages(base, lo, hi uint64) []bool {
	if hi <= lo {
		return nil
	}
	p.pagemapOnce.Do(func() {
		p.pagemap, _ = os.Open("/proc/self/pagemap")
	})
	if p.pagemap == nil {
		return nil
	}
	p.pagemaps.Add(1)
	var small [8 * (aroundPages + 2*probeSlack)]byte
	buf := small[:]
	if 8*(hi-lo) > uint64(len(small)) {
		buf = make([]byte, 8*(hi-lo))
	}
	buf = buf[:8*(hi-lo)]
	if _, err := p.pagemap.ReadAt(buf, int64((base/PageSize+lo)*8)); err != nil {
		return nil
	}
	out := make([]bool, hi-lo)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(buf[8*i:])&(1<<63) != 0
	}
	return out
}

// faultWindow is the file pages [lo, hi) that faults on pages [first,
// first+n) of a mapping at virtual address base of pages pages can map:
// every window of span bytes, aligned by virtual address, that the run
// touches.
func faultWindow(base, first, n, span, pages uint64) (lo, hi uint64) {
	va0 := base + first*PageSize
	va1 := base + (first+n)*PageSize // end of the run
	wlo := va0 &^ (span - 1)
	whi := (va1 + span - 1) &^ (span - 1)
	lo = 0
	if wlo > base {
		lo = (wlo - base) / PageSize
	}
	hi = min(pages, (whi-base+PageSize-1)/PageSize)
	return lo, hi
}

// setPinned records pages [first, first+n) of table as pinned (on) or not.
// Once pinning is disabled it records no pin and returns false: disable
// clears the bits under p.mu after setting unavailable, so a run populated
// before it and recorded after it would stay marked forever.
func (p *Pinner) setPinned(table uint32, first, n uint64, on bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on && p.unavailable.Load() {
		return false
	}
	bits := p.pinned[table]
	for q := first; q < first+n && q/64 < uint64(len(bits)); q++ {
		w, m := &bits[q/64], uint64(1)<<(q%64)
		switch {
		case on && *w&m == 0:
			*w |= m
			p.count.Add(1)
		case !on && *w&m != 0:
			*w &^= m
			p.count.Add(-1)
		}
	}
	return true
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
	if err := unix.Madvise(r, unix.MADV_DONTNEED_LOCKED); err != nil {
		// The pages stay locked, so they stay recorded as pinned.
		return wrapRun("unpin", table, first, n, fmt.Errorf("madvise(MADV_DONTNEED_LOCKED): %w", err))
	}
	p.setPinned(table, first, n, false)
	return nil
}

// Resident reports whether page k is in the page cache (ResidentRun).
func (p *Pinner) Resident(k PageKey) bool {
	var vec [1]byte
	return p.ResidentRun(k.Table, k.Page, 1, vec[:]) && vec[0]&1 != 0
}

// ResidentRun sets bit 0 of vec[i] when page first+i of table is in the
// page cache, for i < n (cachestat on the table's descriptor for a window
// of up to statPages pages, and for any window when pinning is
// unavailable; else mincore on the pinner's mapping, which it creates if
// needed; it never faults a page in). It reports false, and vec means
// nothing, when it cannot tell: pinning is unavailable on a kernel without
// cachestat, the pinner is closed, or the run is past the file's end.
func (p *Pinner) ResidentRun(table uint32, first, n uint64, vec []byte) bool {
	ok, _ := p.residentRun(table, first, n, vec)
	return ok
}

// residentRun is ResidentRun, and whether Seen answered it without a
// system call.
func (p *Pinner) residentRun(table uint32, first, n uint64, vec []byte) (ok, skipped bool) {
	if !p.seen.Any(table, first, n) {
		// Never served nor stored: not cached, and no system call to
		// say so.
		clear(vec[:n])
		return true, true
	}
	if !p.Available() {
		// No mapping to ask mincore of, and making one would fail again.
		ok, _ := p.statRun(table, first, n, vec)
		return ok, false
	}
	if n <= statPages {
		if ok, err := p.statRun(table, first, n, vec); ok || errors.Is(err, errPinnerClosed) {
			return ok, false
		}
	}
	r, err := p.run(table, first, n, true)
	if err != nil || r == nil {
		return false, false
	}
	defer p.inflight.Done()
	return uint64(pagecache.Pages(len(r))) == n && pagecache.Mincore(r, vec) == nil, false
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
	for t, f := range p.readers {
		if f != nil {
			_ = f.Close()
			p.readers[t] = nil
		}
	}
	p.count.Store(0)
	if p.pagemap != nil {
		_ = p.pagemap.Close()
	}
	p.closeCharges()
	if p.exactFD >= 0 { // after the munmaps: closing it unregisters them
		_ = unix.Close(p.exactFD)
		p.exactFD = -1
	}
	return errors.Join(errs...)
}

// readThroughChunk bounds one pread of readThrough (and its scratch buffer).
const readThroughChunk = 256 << 10

// readThrough reads n bytes of table from off with pread(2), so they are in
// the page cache before the populate maps them (see the Pinner's doc: a
// populate that has to read holds the mmap lock through our own FUSE
// handler). The bytes read are thrown away. Call it between run and
// p.inflight.Done.
// LOCKS_EXCLUDED(p.mu)
func (p *Pinner) readThrough(table uint32, off int64, n int) error {
	f, err := p.reader(table)
	if err != nil {
		return err
	}
	bp, _ := p.readBuf.Get().(*[]byte)
	if bp == nil {
		b := make([]byte, readThroughChunk)
		bp = &b
	}
	defer p.readBuf.Put(bp)
	for n > 0 {
		c := min(n, readThroughChunk)
		got, err := f.ReadAt((*bp)[:c], off)
		if err != nil && !(errors.Is(err, io.EOF) && got == c) {
			return fmt.Errorf("read through %s at %d (+%d): %w", p.files[table].Path, off, c, err)
		}
		off, n = off+int64(c), n-c
	}
	return nil
}

// reader is table's descriptor for readThrough, opened on first use.
// LOCKS_EXCLUDED(p.mu)
func (p *Pinner) reader(table uint32) (*os.File, error) {
	p.mu.Lock()
	if p.readers == nil {
		p.readers = make([]*os.File, len(p.files))
		p.readerFDs = make([]int, len(p.files))
	}
	f := p.readers[table]
	p.mu.Unlock()
	if f == nil {
		// Open outside the lock: it goes through our own FUSE handlers when
		// the file is on the mount.
		nf, err := os.Open(p.files[table].Path)
		if err != nil {
			return nil, fmt.Errorf("read through: %w", err)
		}
		// Read only the run: without FADV_RANDOM the kernel reads ahead
		// around it, into large folios that the populate then maps and
		// the trim must split again.
		fd := int(nf.Fd())
		if err := unix.Fadvise(fd, 0, 0, unix.FADV_RANDOM); err != nil {
			_ = nf.Close()
			return nil, fmt.Errorf("read through: fadvise %s: %w", p.files[table].Path, err)
		}
		p.mu.Lock()
		if f = p.readers[table]; f == nil {
			p.readers[table], p.readerFDs[table], f = nf, fd, nf
		} else {
			_ = nf.Close()
		}
		p.mu.Unlock()
	}
	return f, nil
}

// checkRun reports why pages [first, first+n) are not all pages of table's
// file, or nil when they are.
func (p *Pinner) checkRun(table uint32, first, n uint64) error {
	if int(table) >= len(p.files) {
		return fmt.Errorf("no table %d (%d tables)", table, len(p.files))
	}
	f := p.files[table]
	size := uint64(max(f.Size, 0))
	if pages := (size + PageSize - 1) / PageSize; first >= pages || n > pages-first {
		return fmt.Errorf("past the end of %s (%d bytes)", f.Path, f.Size)
	}
	return nil
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
	if err := p.checkRun(table, first, n); err != nil {
		return nil, err
	}
	p.mu.Lock()
	var b []byte
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, errPinnerClosed
		}
		if b = p.maps[table]; b != nil || !create {
			break
		}
		if p.unavailable.Load() {
			p.mu.Unlock()
			return nil, ErrPinUnavailable
		}
		var wait chan struct{}
		if p.mapping != nil {
			wait = p.mapping[table]
		}
		if wait == nil {
			break
		}
		// Another call is mapping the table: wait for its mapping rather
		// than make a second one. Two at once (the pin worker and a
		// prefill hint's ResidentRun on a table's first use) were each
		// charged the whole table by mlock2 under a finite
		// RLIMIT_MEMLOCK, and the second's ENOMEM turned pinning off for
		// good with a warning that blamed the limit (9 runs of 9).
		p.mu.Unlock()
		<-wait
		p.mu.Lock()
	}
	if b == nil && !create {
		p.mu.Unlock()
		return nil, nil
	}
	p.inflight.Add(1) // from here on Close waits for this call
	if b == nil {
		if p.mapping == nil {
			p.mapping = make([]chan struct{}, len(p.files))
		}
		done := make(chan struct{})
		p.mapping[table] = done
		p.mu.Unlock()
		var err error
		b, err = p.mapTable(table)
		p.mu.Lock()
		p.mapping[table] = nil
		close(done)
		if err != nil {
			p.mu.Unlock()
			p.inflight.Done()
			return nil, err
		}
	}
	p.mu.Unlock()
	end := min((first+n)*PageSize, uint64(max(p.files[table].Size, 0)))
	return b[first*PageSize : end : end], nil
}

// mapTable maps table's file and locks the mapping (on fault), and records
// it: the first use of a table, one call at a time (run). LOCKS_EXCLUDED(p.mu)
func (p *Pinner) mapTable(table uint32) ([]byte, error) {
	f := p.files[table]
	// Map outside the lock: open and mmap go through our own FUSE
	// handlers when the file is on the mount.
	m, err := p.mmap(f)
	if err != nil {
		return nil, err
	}
	// Lock the whole mapping, on fault: one VMA, nothing read yet. If
	// the kernel refuses (ENOMEM: RLIMIT_MEMLOCK without CAP_IPC_LOCK,
	// charged for the whole mapping), pages mapped here would not be
	// locked: run unpinned rather than claim them.
	if err := p.lockMapping(m); err != nil {
		_ = unix.Munmap(m)
		p.disable(fmt.Errorf("mlock2(MLOCK_ONFAULT) of %s (%d bytes): %w", f.Path, len(m), err))
		return nil, ErrPinUnavailable
	}
	exact := p.makeExact(f, m)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.maps[table] = m
	p.pinned[table] = make([]uint64, (uint64(len(m))/PageSize+64)/64)
	p.exact[table] = exact
	return m, nil
}

func mapFile(f TableFile) ([]byte, error) {
	fd, err := unix.Open(f.Path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", f.Path, err)
	}
	defer unix.Close(fd) // the mapping keeps its own reference to the file
	// Private, so that it may be registered for exact faults (exact.go); a
	// read-only private mapping maps the page cache's own pages.
	b, err := unix.Mmap(fd, 0, int(f.Size), unix.PROT_READ, unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("mmap %s (%d bytes): %w", f.Path, f.Size, err)
	}
	// Without MADV_RANDOM, the fault that mlock takes on a cold page reads
	// ahead around it (up to 128 KiB): pinning one page would read 32.
	// Without MADV_NOHUGEPAGE, a fault on a page of a 2 MiB folio maps (so
	// locks) the whole folio with one PMD, exact faults or not.
	for _, advice := range []int{unix.MADV_RANDOM, unix.MADV_NOHUGEPAGE} {
		if err := unix.Madvise(b, advice); err != nil {
			_ = unix.Munmap(b)
			return nil, fmt.Errorf("madvise %s (%d): %w", f.Path, advice, err)
		}
	}
	return b, nil
}

// makeExact registers the new mapping m of f for exact faults (exact.go),
// opening the userfaultfd on first use; false (the pinner trims) where the
// kernel refuses, said once in the log.
func (p *Pinner) makeExact(f TableFile, m []byte) bool {
	if p.noExact {
		return false
	}
	p.exactOnce.Do(func() {
		fd, err := newExactFaults()
		if err != nil {
			p.log.Info("pinned pages' fault-around neighbours are unmapped after each pin (exact faults unavailable)", zap.Error(err))
			return
		}
		p.exactFD = fd
	})
	if p.exactFD < 0 {
		return false
	}
	if err := registerExact(p.exactFD, m); err != nil {
		p.log.Info("pinned pages' fault-around neighbours are unmapped after each pin (exact faults refused)", zap.String("table", f.Path), zap.Error(err))
		return false
	}
	return true
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

// disable turns pinning off for good, with one warning, and releases every
// page locked so far: from now on nothing is reported pinned.
func (p *Pinner) disable(err error) {
	p.unavailable.Store(true)
	p.warnOnce.Do(func() {
		var lim unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim)
		p.log.Warn("mlock refused: the hot tier runs unpinned; grant CAP_IPC_LOCK or raise RLIMIT_MEMLOCK (ulimit -l) above the table files' size",
			zap.Error(err), zap.Bool("cap_ipc_lock", p.capLock), zap.Uint64("rlimit_memlock", lim.Cur))
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	for t, b := range p.maps {
		if b == nil {
			continue
		}
		_ = unix.Madvise(b, unix.MADV_DONTNEED_LOCKED)
		_ = unix.Munlock(b)
		clear(p.pinned[t])
	}
	p.count.Store(0)
}

func hasCapIPCLock() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[unix.CAP_IPC_LOCK/32].Effective&(1<<(unix.CAP_IPC_LOCK%32)) != 0
}

// lockedBytes is "Locked" of /proc/self/smaps_rollup: the proportional share
// of this process's locked resident pages (VmLck counts whole MLOCK_ONFAULT
// mappings).
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

package cache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/memcg"
)

// Whose memory cgroup pays for a pinned page.
//
// The kernel charges a page-cache page to the memory cgroup of the process
// whose access allocated it, and the charge stays with the page for its
// life: a reader's fault through the mount charges the reader's group,
// the daemon's own pread or NOTIFY_STORE the daemon's. Locking a page in
// the daemon's mapping does not move the charge, so a tier that pinned
// faulted pages filled the reader's group with locked pages it could not
// reclaim: a reader in a 256 MiB group gathering random rows was
// OOM-killed after ~12 s with 241 MiB unevictable (128 MiB of 128 in
// TestMemcgReaderNotKilledByTier). cgroup v2 never moves a charge, and
// v1's memory.move_charge_at_immigrate moves only a task's own pages when
// the task moves.
//
// So before a page is recorded pinned, the pinner asks the kernel which
// group the page is charged to (its mapping's PFN from /proc/self/pagemap,
// then /proc/kpagecgroup: the group's inode; both need CAP_SYS_ADMIN, which
// the daemon has as root). A page charged to a group that is neither the
// daemon's nor one of its ancestors is copied out (pread through the page
// cache), unmapped from the daemon's mapping, dropped from the page cache
// and from every reader's mapping (NOTIFY_INVAL_INODE), stored again from
// the daemon (NOTIFY_STORE allocates the new page in the daemon's context,
// so its group pays) and populated again. A reader that touches the page
// between the drop and the store takes one more fault, served as any
// other, and may allocate the page first: then it is tried again, and
// after maxRecharges it is not pinned at all (ErrChargedElsewhere), which
// leaves it reclaimable by its group. No wrong byte is possible: the bytes
// stored are the page cache's own, read a moment before.

// Recharger drops pages from the page cache and stores bytes in their
// place, from the daemon's own context. fs.Server implements it
// (NOTIFY_INVAL_INODE and NOTIFY_STORE); the pinner must not import fs.
type Recharger interface {
	// Invalidate drops n bytes of table from off from the page cache and
	// from every process's mapping of them.
	Invalidate(table uint32, off, n int64) error
	// Store puts data into the page cache of table at off.
	Store(table uint32, off int64, data []byte) error
}

// ErrChargedElsewhere is a pin refused because its page stayed charged to
// another process's memory cgroup after being stored again: pinning it
// would hold memory that group cannot reclaim.
var ErrChargedElsewhere = errors.New("page charged to another memory cgroup")

// maxRecharges bounds how often one pin drops and stores a page again while
// readers keep faulting it back in first.
const maxRecharges = 3

// charges is the pinner's view of memory cgroups; set up once, at the first
// pin after SetRecharger.
type charges struct {
	once       sync.Once
	rc         Recharger
	kpc        *os.File // /proc/kpagecgroup; nil: not checked
	own        []uint64 // inodes of the daemon's group and its ancestors
	recharged  atomic.Uint64
	unreadable atomic.Bool // a PFN read as 0: no CAP_SYS_ADMIN after all
}

// SetRecharger lets the pinner move the charge of pages a reader's fault
// brought in to the daemon's memory cgroup before it pins them. Call it
// before the first pin. Without it (or where the kernel will not say whose
// a page is) pages are pinned where they are charged, as before.
func (p *Pinner) SetRecharger(rc Recharger) { p.charge.rc = rc }

// Recharged is how many pages were stored again so that the daemon's group
// pays for their pin.
func (p *Pinner) Recharged() uint64 { return p.charge.recharged.Load() }

// chargeCheck reports whether pins are checked for their memory cgroup,
// setting the check up on first use.
func (p *Pinner) chargeCheck() bool {
	c := &p.charge
	c.once.Do(func() {
		if c.rc == nil {
			return
		}
		self, err := memcg.Own()
		if err != nil {
			return // no memory cgroups: every page is charged to the root
		}
		own, err := self.Inodes()
		if err != nil {
			p.log.Warn("pinned pages may be charged to readers' memory cgroups: the daemon's own group is unreadable", zap.Error(err))
			return
		}
		f, err := os.Open("/proc/kpagecgroup")
		if err != nil {
			p.log.Warn("pinned pages may be charged to readers' memory cgroups (a reader in a limited group can be OOM-killed by the tier): /proc/kpagecgroup needs CAP_SYS_ADMIN",
				zap.Error(err))
			return
		}
		c.kpc, c.own = f, own
		p.log.Info("pinned pages are charged to the daemon's memory cgroup", zap.Stringer("cgroup", self))
	})
	return c.kpc != nil && !c.unreadable.Load()
}

// foreignPages returns, of pages [first, first+n) of table (mapped at b in
// the pinner's mapping), those not pinned before that are charged to a
// memory cgroup other than the daemon's or its ancestors'. Unmapped pages,
// and pages whose group cannot be read, count as the daemon's.
func (p *Pinner) foreignPages(table uint32, first uint64, b []byte) ([]uint64, error) {
	n := (uint64(len(b)) + PageSize - 1) / PageSize
	ent := make([]byte, 8*n)
	va := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	p.pagemapOnce.Do(func() { p.pagemap, _ = os.Open("/proc/self/pagemap") })
	if p.pagemap == nil {
		return nil, nil
	}
	if _, err := p.pagemap.ReadAt(ent, int64(va/PageSize*8)); err != nil {
		return nil, fmt.Errorf("pagemap: %w", err)
	}
	p.mu.RLock()
	bits := p.pinned[table]
	var pages, pfns []uint64
	for i := range n {
		e := binary.LittleEndian.Uint64(ent[8*i:])
		if e&(1<<63) == 0 || bits != nil && bitSet(bits, first+i) {
			continue
		}
		pfn := e & (1<<55 - 1)
		if pfn == 0 {
			// The kernel hides PFNs from a process without
			// CAP_SYS_ADMIN: nothing can be told.
			p.mu.RUnlock()
			if !p.charge.unreadable.Swap(true) {
				p.log.Warn("pinned pages may be charged to readers' memory cgroups: /proc/self/pagemap hides page frames (no CAP_SYS_ADMIN)")
			}
			return nil, nil
		}
		pages, pfns = append(pages, first+i), append(pfns, pfn)
	}
	p.mu.RUnlock()
	var foreign []uint64
	ino := make([]byte, 8*maxPinRun)
	for i := 0; i < len(pfns); {
		// One read for each stretch of consecutive frames (a folio's).
		j := i + 1
		for j < len(pfns) && j-i < maxPinRun && pfns[j] == pfns[j-1]+1 {
			j++
		}
		buf := ino[:8*(j-i)]
		if _, err := p.charge.kpc.ReadAt(buf, int64(pfns[i]*8)); err != nil {
			return nil, fmt.Errorf("kpagecgroup: %w", err)
		}
		for k := i; k < j; k++ {
			if g := binary.LittleEndian.Uint64(buf[8*(k-i):]); g != 0 && !slices.Contains(p.charge.own, g) {
				foreign = append(foreign, pages[k])
			}
		}
		i = j
	}
	return foreign, nil
}

// ownCharge makes every page of the run [first, first+n) of table, just
// populated at b, that is charged to another process's memory cgroup the
// daemon's (see above), and returns the pages it could not: they are
// unmapped from the pinner's mapping again. Call it between run and
// p.inflight.Done, after a populate that succeeded.
func (p *Pinner) ownCharge(table uint32, first uint64, b []byte) (left []uint64, err error) {
	if !p.chargeCheck() {
		return nil, nil
	}
	foreign, err := p.foreignPages(table, first, b)
	for try := 0; err == nil && len(foreign) > 0 && try < maxRecharges; try++ {
		for _, run := range pageRuns(foreign) {
			if err = p.recharge(table, first, b, run[0], run[1]); err != nil {
				break
			}
		}
		if err == nil {
			foreign, err = p.foreignPages(table, first, b)
		}
	}
	if err != nil || len(foreign) == 0 {
		return nil, err
	}
	for _, run := range pageRuns(foreign) {
		_ = unix.Madvise(b[(run[0]-first)*PageSize:min((run[1]-first)*PageSize, uint64(len(b)))], unix.MADV_DONTNEED_LOCKED)
	}
	return foreign, nil
}

// recharge stores pages [lo, hi) of table again from the daemon, so that
// its memory cgroup is charged for them, and maps them again into b (the
// run from page first).
func (p *Pinner) recharge(table uint32, first uint64, b []byte, lo, hi uint64) error {
	r := b[(lo-first)*PageSize : min((hi-first)*PageSize, uint64(len(b)))]
	// The bytes of the page cache, read through the daemon's descriptor
	// (never by touching the mapping: see the kernel facts on faults of our
	// own mount); the pages are cached and locked, so no FUSE read.
	data, err := p.readInto(table, int64(lo*PageSize), make([]byte, len(r)))
	if err != nil {
		return err
	}
	if err := unix.Madvise(r, unix.MADV_DONTNEED_LOCKED); err != nil {
		return fmt.Errorf("unmapping to recharge: %w", err)
	}
	off := int64(lo * PageSize)
	if err := p.charge.rc.Invalidate(table, off, int64(len(r))); err != nil {
		return fmt.Errorf("recharge: %w", err)
	}
	if err := p.charge.rc.Store(table, off, data); err != nil {
		// Dropped and not stored: read it in through the daemon's own
		// descriptor (charged to the daemon too), so that the populate
		// does not fault through our own Read handler.
		if err := p.readThrough(table, off, len(r)); err != nil {
			return err
		}
	}
	p.charge.recharged.Add(hi - lo)
	if err := p.mlock(r); err != nil {
		return fmt.Errorf("populate after recharge: %w", err)
	}
	return nil
}

// pageRuns turns sorted pages into runs [lo, hi) of adjacent ones.
func pageRuns(pages []uint64) [][2]uint64 {
	var runs [][2]uint64
	for _, q := range pages {
		if k := len(runs); k > 0 && runs[k-1][1] == q {
			runs[k-1][1]++
		} else {
			runs = append(runs, [2]uint64{q, q + 1})
		}
	}
	return runs
}

// readInto reads up to len(b) bytes of table from off through the
// daemon's descriptor of the table file (readThrough's), stopping at the
// file's end, and returns them.
func (p *Pinner) readInto(table uint32, off int64, b []byte) ([]byte, error) {
	f, err := p.reader(table)
	if err != nil {
		return nil, err
	}
	// The last page of a file is short: what lies past the end is not
	// stored (a store past EOF would grow the file).
	b = b[:max(0, min(int64(len(b)), p.files[table].Size-off))]
	if _, err := f.ReadAt(b, off); err != nil {
		return nil, fmt.Errorf("recharge: reading %s at %d (+%d): %w", p.files[table].Path, off, len(b), err)
	}
	return b, nil
}

// setPinnedExcept records pages [first, first+n) of table pinned, but for
// the sorted pages skip; false as setPinned (pinning was disabled meanwhile).
func (p *Pinner) setPinnedExcept(table uint32, first, n uint64, skip []uint64) bool {
	for q := first; q < first+n; {
		if len(skip) > 0 && skip[0] == q {
			skip, q = skip[1:], q+1
			continue
		}
		end := first + n
		if len(skip) > 0 {
			end = skip[0]
		}
		if !p.setPinned(table, q, end-q, true) {
			return false
		}
		q = end
	}
	return true
}

// closeCharges closes /proc/kpagecgroup. Close calls it.
func (p *Pinner) closeCharges() {
	if p.charge.kpc != nil {
		_ = p.charge.kpc.Close()
	}
}

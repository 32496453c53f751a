package cache

import (
	"errors"
	"unsafe"

	"golang.org/x/sys/unix"
)

// statPages is the largest window ResidentRun answers with cachestat(2)
// rather than mincore(2). A decode step's pages are scattered, a window of a
// page or two each: cachestat on the table's descriptor costs ~0.25 µs a
// call here against ~0.6 µs for mincore on a single page (and more in the
// daemon, where the mapping's lock and the pinner's lock are shared with
// the pin worker); mincore answers a wide window for ~40 ns a page more,
// cachestat only with a count, so a prefill window stays with mincore.
const statPages = 4

// Costs of a residency lookup here (Linux 6.18 on these VMs, one thread, a
// file whose pages are half cached): cachestat ~235 ns a call; mincore ~570
// ns a call and ~47 ns a page of its window, gaps included.
const (
	statCallNs    = 235
	mincoreCallNs = 570
	mincorePageNs = 47
)

// errNoCachestat is cachestat's answer on a kernel without it (before 6.5);
// the pinner then asks mincore always.
var errNoCachestat = errors.New("cachestat unavailable")

// statRun is ResidentRun by cachestat(2) on the table's read-through
// descriptor: for a window of at most statPages pages, and for every
// window where pinning is unavailable (no mapping to ask mincore of). One
// call answers a window whose pages are all cached or none; a window
// partly cached is halved until each part is (its second half's count is
// the window's less the first's, no call). A page counts as
// cached from the moment its folio is in the page cache, before its read
// has completed (mincore waits for that): either way the reader finds it
// without a new read, and a fetch of it would read it twice. ok is false
// when it cannot tell; err says why (errNoCachestat: never again).
// LOCKS_EXCLUDED(p.mu)
func (p *Pinner) statRun(table uint32, first, n uint64, vec []byte) (ok bool, err error) {
	if p.noStat.Load() {
		return false, errNoCachestat
	}
	if p.checkRun(table, first, n) != nil {
		return false, nil
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return false, errPinnerClosed
	}
	p.inflight.Add(1) // Close closes the readers after the calls in flight
	fd := -1
	if p.readers != nil && p.readers[table] != nil {
		fd = p.readerFDs[table]
	}
	p.mu.Unlock()
	defer p.inflight.Done()
	if fd < 0 { // the table's first lookup or read-through: open it
		f, err := p.reader(table)
		if err != nil {
			return false, err
		}
		fd = int(f.Fd())
	}
	count := func(pg, k uint64) (uint64, error) {
		r := unix.CachestatRange{Off: pg * PageSize, Len: k * PageSize}
		var cs unix.Cachestat_t
		// Raw: it walks the page cache's tree under RCU and never blocks,
		// and the scheduler's hooks around a system call cost a third of
		// its time.
		_, _, errno := unix.RawSyscall6(unix.SYS_CACHESTAT, uintptr(fd), uintptr(unsafe.Pointer(&r)), uintptr(unsafe.Pointer(&cs)), 0, 0, 0)
		if errno != 0 {
			if errno == unix.ENOSYS {
				p.noStat.Store(true)
				return 0, errNoCachestat
			}
			return 0, errno
		}
		return cs.Cache, nil
	}
	// fill answers pages [pg, pg+k), c of which are cached. Counts taken
	// at different moments may disagree (a page evicted or read between
	// them): an answer is then stale either way, which costs a read or a
	// fault, never wrong bytes.
	var fill func(pg, k, c uint64) error
	fill = func(pg, k, c uint64) error {
		out := vec[pg-first : pg-first+k]
		switch {
		case c == 0:
			clear(out)
		case c >= k:
			for i := range out {
				out[i] = 1
			}
		default:
			h := k / 2
			c1, err := count(pg, h)
			if err != nil {
				return err
			}
			if err := fill(pg, h, c1); err != nil {
				return err
			}
			return fill(pg+h, k-h, c-min(c1, c))
		}
		return nil
	}
	c, err := count(first, n)
	if err == nil {
		err = fill(first, n, c)
	}
	return err == nil, err
}

// PerRun reports whether runs runs of pages spread over span pages are
// looked up for less a run at a time (cachestat, each run at most statPages
// long) than in one mincore window over the span, gaps included: a decode
// step's scale pages, ~70 rows spread over a table of ~2,000 pages, took a
// mincore window of the whole table. Without cachestat a run at a time is
// a mincore call each.
func (p *Pinner) PerRun(runs, span uint64) bool {
	call := uint64(statCallNs)
	if p.noStat.Load() {
		call = mincoreCallNs
	}
	return runs*call < mincoreCallNs+span*mincorePageNs
}

package cache

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A table's first use by two callers at once (the pin worker's PinRun and a
// prefill hint's ResidentRun) maps and locks it once: the second waits for
// the first's mapping. Two mlock2 calls of the whole table were each charged
// to RLIMIT_MEMLOCK, and the second's ENOMEM turned pinning off for good.
// The fake lockMapping refuses a second lock of the table as that limit
// would; the first mmap waits (up to a second) for a second mmap to start,
// which is where the two calls met.
func TestPinnerMapsATableOnceOnConcurrentFirstUse(t *testing.T) {
	f := coldFile(t, 64*PageSize)
	p := newTestPinner(t, f)
	var mmaps, locks atomic.Int32
	second := make(chan struct{})
	mapFirst := p.mmap
	p.mmap = func(tf TableFile) ([]byte, error) {
		if mmaps.Add(1) == 1 {
			select {
			case <-second:
			case <-time.After(time.Second):
			}
		} else {
			close(second)
		}
		return mapFirst(tf)
	}
	lockFirst := p.lockMapping
	p.lockMapping = func(b []byte) error {
		if locks.Add(1) > 1 {
			return unix.ENOMEM // the limit holds one table's mapping
		}
		return lockFirst(b)
	}
	var wg sync.WaitGroup
	var pinErr error
	wg.Go(func() { pinErr = p.PinRun(0, 3, 2) })
	wg.Go(func() {
		vec := make([]byte, 8)
		p.ResidentRun(0, 0, 8, vec)
	})
	wg.Wait()
	if n := locks.Load(); n != 1 || !p.Available() {
		t.Fatalf("%d mmaps and %d locks of one table on its first use by two callers (pinning available: %v); want 1 and 1",
			mmaps.Load(), n, p.Available())
	}
	if pinErr != nil {
		t.Fatal(pinErr)
	}
	if !p.Pinned(PageKey{Page: 3}) {
		t.Fatal("the pin that shared the mapping pinned nothing")
	}
}

// disable during a populate (another call's mlock refused) leaves nothing
// recorded pinned: the populate's run was recorded after disable cleared the
// bits, so it stayed "pinned" forever, and hints skipped those pages as
// pinned (a lost hint).
func TestPinnerDisableDuringPopulateRecordsNothing(t *testing.T) {
	f := coldFile(t, 16*PageSize)
	p := newTestPinner(t, f)
	populate := p.mlock
	p.mlock = func(b []byte) error {
		if err := populate(b); err != nil {
			return err
		}
		p.disable(errors.New("injected: another call's mlock refused"))
		return nil
	}
	err := p.PinRun(0, 2, 3)
	if !errors.Is(err, ErrPinUnavailable) {
		t.Errorf("a pin disabled during its populate: %v, want ErrPinUnavailable", err)
	}
	for pg := uint64(2); pg < 5; pg++ {
		if p.Pinned(PageKey{Page: pg}) {
			t.Fatalf("page %d recorded pinned after pinning was disabled", pg)
		}
	}
	if n := p.PinnedPages(); n != 0 {
		t.Fatalf("%d pages counted pinned after pinning was disabled", n)
	}
}

// With exact faults, a populate that fails part way leaves nothing locked
// and does not turn exact faults off: the pages mapped before the failure
// were left locked and unrecorded (exact mappings are not trimmed), and the
// next audit found them and switched to whole page-table trims for good.
func TestPinnerHalfFailedPopulateWithExactFaults(t *testing.T) {
	f := warmFile(t, 1024)
	p := newTestPinner(t, f)
	base := vmLck(t)
	if err := p.Pin(PageKey{Page: 100}); err != nil { // the first trim's audit, of a clean pin
		t.Fatal(err)
	}
	requireExact(t, p)
	populate := p.mlock
	p.mlock = func(b []byte) error {
		if err := populate(b[:2*PageSize]); err != nil {
			return err
		}
		return unix.EIO
	}
	if err := p.PinRun(0, 300, 4); err == nil {
		t.Fatal("a failing populate succeeded")
	}
	wantLocked(t, base, 1, "a populate that failed after mapping 2 of 4 pages")
	p.mlock = populate
	p.trims.Store(auditEvery) // the next trim audits
	if err := p.Pin(PageKey{Page: 600}); err != nil {
		t.Fatal(err)
	}
	if p.wideTrim.Load() {
		t.Fatal("an audit after a failed populate turned exact faults off")
	}
	wantLocked(t, base, 2, "a pin after the failed one")
}

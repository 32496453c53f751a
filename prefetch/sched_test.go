package prefetch

import (
	"slices"
	"testing"

	"github.com/engramfs/engramfs/cache"
)

// These tests drive the scheduler core by hand: no goroutines, no loader,
// no root. Each step is what a loop would do, in the order a race could
// interleave it.

// submit is one submission of runs on b, as SubmitPart makes it.
func submit(c *core, b *Barrier, decode bool, frameEnd bool, runs ...pageRun) uint64 {
	seq := c.submission(b)
	c.admit(b, seq, runs, decode, decode)
	c.endSubmission(b, seq, frameEnd)
	return seq
}

// settledThrough reports whether every submission of b up to seq settled:
// the condition a barrier taken after seq waits for.
func settledThrough(b *Barrier, seq uint64) bool { return b.settledThrough(seq) }

// fetchAll claims everything and settles it with o, as the loops would.
func fetchAll(c *core, o Outcome) []cache.Run {
	var all []cache.Run
	for {
		runs := nextAll(c, 1<<30)
		if len(runs) == 0 {
			return all
		}
		for _, r := range runs {
			c.answered(r)
			c.settle(r.Table, r.First, r.N, o)
		}
		all = append(all, runs...)
	}
}

// nextAll is next's claim, decode runs then prefill runs.
func nextAll(c *core, budget int) []cache.Run {
	decode, prefill := c.next(budget)
	return append(decode, prefill...)
}

func pages(runs []cache.Run) map[cache.PageKey]int {
	out := map[cache.PageKey]int{}
	for _, r := range runs {
		for pg := r.First; pg < r.First+r.N; pg++ {
			out[cache.PageKey{Table: r.Table, Page: pg}]++
		}
	}
	return out
}

func TestCoreDecodeFirstAndRoundRobin(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 1000})
	pre, a, b := NewBarrier(), NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 100, 50})
	submit(c, a, true, true, pageRun{0, 1, 1}) // a sends two decode frames
	submit(c, a, true, true, pageRun{0, 3, 1})
	submit(c, b, true, true, pageRun{0, 5, 1})
	got := nextAll(c, 3)
	want := []cache.Run{{Table: 0, First: 1, N: 1}, {Table: 0, First: 5, N: 1}, {Table: 0, First: 3, N: 1}}
	if len(got) != len(want) {
		t.Fatalf("first claim %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("first claim %v, want %v (decode round robin: a, b, a)", got, want)
		}
	}
	if c.inflight != 3 {
		t.Fatalf("inflight %d, want 3", c.inflight)
	}
	// The budget splits the prefill run; the rest stays at the front.
	if got := nextAll(c, 10); len(got) != 1 || got[0] != (cache.Run{Table: 0, First: 100, N: 10}) {
		t.Fatalf("prefill claim %v, want pages 100-109", got)
	}
	if got := nextAll(c, 100); len(got) != 1 || got[0] != (cache.Run{Table: 0, First: 110, N: 40}) {
		t.Fatalf("prefill claim %v, want pages 110-149", got)
	}
}

// next tells decode runs (demand reads for the loader) from prefill runs.
func TestCoreNextSeparatesDecodeFromPrefill(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 1000})
	pre, a := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 100, 4})
	submit(c, a, true, true, pageRun{0, 1, 2})
	decode, prefill := c.next(100)
	if len(decode) != 1 || decode[0] != (cache.Run{Table: 0, First: 1, N: 2}) {
		t.Errorf("decode runs %v, want pages 1-2", decode)
	}
	if len(prefill) != 1 || prefill[0] != (cache.Run{Table: 0, First: 100, N: 4}) {
		t.Errorf("prefill runs %v, want pages 100-103", prefill)
	}
}

// A race that once lost a decode hint: a page's state is deleted when fetched
// (here: faulted and confirmed) and re-created by a new decode hint while an
// older prefill run for it is still queued. Dropping that stale run must not
// settle the new state, and claiming must still find it.
func TestCoreStaleRunNeverSettlesANewerState(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 4})
	pre, dec := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 10, 4}) // pages 10-13 as prefill
	k := cache.PageKey{Table: 0, Page: 11}
	if confirm, _, _ := c.faulted([]cache.PageKey{k}); len(confirm) != 1 {
		t.Fatalf("faulted returned %v, want page 11 to confirm", confirm)
	}
	c.settle(0, 11, 1, Resident) // confirmed resident
	seq := submit(c, dec, true, true, pageRun{0, 11, 1})
	// A prefill flood drops the old run (it holds the old page 11).
	submit(c, pre, false, true, pageRun{0, 50, 4})
	if settledThrough(dec, seq) {
		t.Fatal("the decode hint settled when a stale prefill run was dropped")
	}
	if dec.status.Dropped != 0 {
		t.Fatalf("decode status %+v: a decode page was dropped", dec.status)
	}
	runs := fetchAll(c, Resident)
	if pages(runs)[k] != 1 {
		t.Fatalf("page 11 claimed %d times, want once: %v", pages(runs)[k], runs)
	}
	if !settledThrough(dec, seq) || dec.status.Resident != 1 || dec.status.Pages != 1 {
		t.Fatalf("decode status %+v, settled %v; want 1 page resident", dec.status, settledThrough(dec, seq))
	}
}

func TestCoreStaleRunNeverClaimsANewerState(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	pre, dec := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 10, 1})
	// Claimed through a decode run and settled while the prefill run waits.
	submit(c, dec, true, true, pageRun{0, 10, 1})
	if runs := nextAll(c, 1); len(runs) != 1 {
		t.Fatalf("claim %v", runs)
	}
	c.answered(cache.Run{Table: 0, First: 10, N: 1})
	c.settle(0, 10, 1, Resident)
	// Hinted again as prefill: a fresh state and run.
	seq := submit(c, pre, false, true, pageRun{0, 10, 1})
	runs := fetchAll(c, Resident)
	if n := pages(runs)[cache.PageKey{Table: 0, Page: 10}]; n != 1 {
		t.Fatalf("page 10 claimed %d times after re-hint, want once", n)
	}
	if !settledThrough(pre, seq) {
		t.Fatal("the prefill re-hint never settled")
	}
}

func TestCoreBarrierWaitsForExactlyItsSubmissions(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	b := NewBarrier()
	s1 := submit(c, b, true, true, pageRun{0, 1, 1})
	first := nextAll(c, 1) // page 1 in flight
	s2 := submit(c, b, true, true, pageRun{0, 2, 1})
	if settledThrough(b, s1) {
		t.Fatal("settled before its page")
	}
	c.answered(first[0])
	c.settle(first[0].Table, first[0].First, first[0].N, Resident)
	if !settledThrough(b, s1) {
		t.Fatal("a barrier for the first frame waits for the second")
	}
	if settledThrough(b, s2) {
		t.Fatal("the second frame settled before its page")
	}
	// A page named by both frames of the same handle waits in the older.
	s3 := submit(c, b, false, true, pageRun{0, 2, 1})
	if b.status.Pages != 2 {
		t.Fatalf("pages %d, want 2: a page named twice counts once", b.status.Pages)
	}
	fetchAll(c, Failed)
	if !settledThrough(b, s3) || b.status.Failed != 1 || b.status.Resident != 1 || b.status.Frames != 3 {
		t.Fatalf("status %+v", b.status)
	}
}

func TestCoreMemoryIndependentOfMentions(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 1 << 20})
	b := NewBarrier()
	for range 100 {
		submit(c, b, false, true, pageRun{0, 0, 1000}, pageRun{1, 0, 10})
	}
	if c.pages.len() != 1010 || c.prefill.pages != 1010 || c.prefill.len() != 2 {
		t.Fatalf("after 100 mentions: %d states, %d queued pages in %d runs; want 1010, 1010, 2", c.pages.len(), c.prefill.pages, c.prefill.len())
	}
	c.pages.each(func(_ cache.PageKey, s *pageState) {
		if len(s.more) != 0 {
			t.Fatal("a handle waits on a page more than once")
		}
	})
	if len(b.open) != 1 {
		t.Fatalf("%d submissions open, want 1 (the later ones added nothing)", len(b.open))
	}
}

func TestCorePrefillLargerThanQueueKeepsItsTail(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	b := NewBarrier()
	submit(c, b, false, true, pageRun{0, 0, 50})
	submit(c, b, false, true, pageRun{0, 1000, 30}, pageRun{0, 2000, 300})
	if c.prefill.pages != 100 {
		t.Fatalf("%d pages queued, want the queue's 100", c.prefill.pages)
	}
	runs := fetchAll(c, Resident)
	got := pages(runs)
	for pg := uint64(2200); pg < 2300; pg++ {
		if got[cache.PageKey{Table: 0, Page: pg}] != 1 {
			t.Fatalf("tail page %d not fetched: %v", pg, runs)
		}
	}
	if len(got) != 100 {
		t.Fatalf("fetched %d pages, want 100", len(got))
	}
	if b.status.Pages != 380 || b.status.Dropped != 280 || b.status.Resident != 100 || len(b.open) != 0 {
		t.Fatalf("status %+v open %v", b.status, b.open)
	}
}

func TestCoreDecodeNeverDropped(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 10})
	pre, dec := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 0, 10})
	seq := submit(c, dec, true, true, pageRun{0, 5, 10}) // 5-9 upgraded, 10-14 fresh
	submit(c, pre, false, true, pageRun{0, 100, 10})     // drops the first prefill run
	runs := fetchAll(c, Resident)
	got := pages(runs)
	for pg := uint64(5); pg < 15; pg++ {
		if got[cache.PageKey{Table: 0, Page: pg}] != 1 {
			t.Fatalf("decode page %d fetched %d times", pg, got[cache.PageKey{Table: 0, Page: pg}])
		}
	}
	if !settledThrough(dec, seq) || dec.status.Resident != 10 || dec.status.Dropped != 0 {
		t.Fatalf("decode status %+v", dec.status)
	}
	if pre.status.Dropped != 5 || pre.status.Resident != 15 {
		t.Fatalf("prefill status %+v: want 5 dropped (0-4), 15 resident (5-9 via decode, 100-109)", pre.status)
	}
}

func TestCoreFaultCancelsQueuedNotInflight(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	b := NewBarrier()
	seq := submit(c, b, false, true, pageRun{0, 0, 2})
	nextAll(c, 1) // page 0 in flight
	confirm, _, late := c.faulted([]cache.PageKey{{Table: 0, Page: 0}, {Table: 0, Page: 1}, {Table: 0, Page: 7}})
	if len(confirm) != 1 || confirm[0].Page != 1 {
		t.Fatalf("faulted returned %v, want only the queued page 1", confirm)
	}
	if late != 2 {
		t.Fatalf("late %d, want 2 (page 0 in flight, page 1 queued; page 7 never hinted)", late)
	}
	// A second fault on the page the first one cancelled: its prefetch is
	// neither queued nor in flight any more.
	if confirm, _, late := c.faulted([]cache.PageKey{{Table: 0, Page: 1}}); len(confirm) != 0 || late != 0 {
		t.Fatalf("second fault on a cancelled page: confirm %v, late %d; want neither", confirm, late)
	}
	if runs := nextAll(c, 10); len(runs) != 0 {
		t.Fatalf("claimed %v after the fault cancelled the rest", runs)
	}
	if settledThrough(b, seq) {
		t.Fatal("settled before the faulted page was confirmed")
	}
	c.settle(0, 1, 1, Resident)
	c.answered(cache.Run{Table: 0, First: 0, N: 1})
	c.settle(0, 0, 1, Resident)
	if !settledThrough(b, seq) || b.status.Resident != 2 {
		t.Fatalf("status %+v", b.status)
	}
}

func TestCoreDrainFailsQueuedWork(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	a, b := NewBarrier(), NewBarrier()
	submit(c, a, false, true, pageRun{0, 0, 5})
	submit(c, b, true, true, pageRun{1, 0, 5})
	c.drain()
	if c.pages.len() != 0 || len(a.open) != 0 || len(b.open) != 0 || a.status.Failed != 5 || b.status.Failed != 5 {
		t.Fatalf("after drain: %d states, a %+v, b %+v", c.pages.len(), a.status, b.status)
	}
	if runs := nextAll(c, 100); len(runs) != 0 {
		t.Fatalf("claimed %v after drain", runs)
	}
}

// Prefill work fills the in-flight budget; a decode step that arrives then
// is claimed at once, up to its own bound, and not past it; prefill gets
// no slot while decode holds the budget's worth.
func TestCoreDecodeDoesNotWaitForPrefillSlots(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 1000, decodeInflight: 4})
	pre, dec := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 0, 100})
	const budget = 8
	if runs := nextAll(c, budget); len(pages(runs)) != budget {
		t.Fatalf("prefill claimed %v, want %d pages", runs, budget)
	}
	submit(c, dec, true, true, pageRun{0, 200, 10})
	decode, prefill := c.next(budget - c.inflight) // nothing left of the budget
	if len(pages(decode)) != 4 || len(prefill) != 0 {
		t.Fatalf("with the budget full of prefill: decode %v, prefill %v; want 4 decode pages", decode, prefill)
	}
	if decode, prefill := c.next(budget - c.inflight); len(decode)+len(prefill) != 0 {
		t.Fatalf("past the decode bound: decode %v, prefill %v; want nothing", decode, prefill)
	}
	// Decode answers free decode slots, not prefill ones.
	c.answered(decode[0])
	c.settle(decode[0].Table, decode[0].First, decode[0].N, Resident)
	decode, prefill = c.next(budget - c.inflight)
	if want := []cache.Run{{Table: 0, First: 204, N: 4}}; !slices.Equal(decode, want) || len(prefill) != 0 {
		t.Fatalf("after the decode answers: decode %v, prefill %v; want %v", decode, prefill, want)
	}
}

// decodeBusy says whether decode work is pending, pages in flight as
// prefill that a decode step named included, and its channel closes when
// the last of them settles, whatever the outcome.
func TestCoreDecodeBusy(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 100})
	pre, dec := NewBarrier(), NewBarrier()
	if c.decodeBusy() != nil {
		t.Fatal("busy with nothing queued")
	}
	submit(c, pre, false, true, pageRun{0, 0, 2})
	if c.decodeBusy() != nil {
		t.Fatal("busy with prefill work only")
	}
	inflight := nextAll(c, 1) // page 0 in flight as prefill
	submit(c, dec, true, true, pageRun{0, 0, 1}, pageRun{0, 5, 1})
	busy := c.decodeBusy()
	if busy == nil {
		t.Fatal("not busy with decode work queued")
	}
	decode, _ := c.next(10) // page 5, for decode
	if want := []cache.Run{{Table: 0, First: 5, N: 1}}; !slices.Equal(decode, want) {
		t.Fatalf("decode claimed %v, want %v", decode, want)
	}
	c.answered(decode[0])
	c.settle(0, 5, 1, Failed)
	select {
	case <-busy:
		t.Fatal("idle with page 0, which the decode step named, still in flight")
	default:
	}
	c.answered(inflight[0])
	c.settle(0, 0, 1, Resident)
	select {
	case <-busy:
	default:
		t.Fatal("still busy after every decode page settled")
	}
	if c.decodeBusy() != nil {
		t.Fatal("busy after every decode page settled")
	}
}

// While decode work is pending, prefill work keeps to a quarter of the
// decode bound in flight; once it has settled, prefill has the whole budget
// again.
func TestCorePrefillYieldsSlotsWhileDecodePending(t *testing.T) {
	c := newCore(coreConfig{prefillPages: 1000, decodeInflight: 8})
	pre, dec := NewBarrier(), NewBarrier()
	submit(c, pre, false, true, pageRun{0, 0, 100})
	submit(c, dec, true, true, pageRun{0, 500, 1})
	decode, prefill := c.next(16)
	if len(pages(decode)) != 1 || len(pages(prefill)) != 2 {
		t.Fatalf("with decode pending: decode %v, prefill %v; want 1 page and 2", decode, prefill)
	}
	if decode, prefill := c.next(16 - c.inflight); len(decode)+len(prefill) != 0 {
		t.Fatalf("prefill past its share while decode is pending: %v %v", decode, prefill)
	}
	c.answered(decode[0])
	c.settle(0, 500, 1, Resident)
	if _, prefill := c.next(16 - c.inflight); len(pages(prefill)) != 14 {
		t.Fatalf("after decode settled: prefill %v, want 14 pages", prefill)
	}
}

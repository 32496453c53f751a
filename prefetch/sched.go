package prefetch

import (
	"slices"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/hints"
)

// This file is the scheduler's core: admission, priority, drops, cancellation
// by a fault and settlement, as plain data. It starts no goroutine, does no
// I/O and takes no lock: the Prefetcher holds its mutex around every call,
// and the loops around it (fetch.go, push.go) do the waiting.
//
// Every page the core knows has one pageState, however many hints name it:
// memory follows the pages queued or in flight, not the mentions. Work sits
// in queues as runs of adjacent pages. A run never owns its pages: it only
// says "these pages were queued at generation id". The generation is what
// makes stale work harmless: a state created after a run (gen > run.id) is
// none of that run's business, so a run that outlived its pages (they were
// fetched through another run, faulted in, or settled and hinted again) can
// neither claim, drop nor settle the newer state.

// Outcome is how a page settled.
type Outcome uint8

const (
	// Resident: stored into the page cache, or confirmed there after a
	// fault read it first.
	Resident Outcome = iota
	// Failed: the backing read or the store failed, or the prefetcher closed.
	Failed
	// Dropped: prefill work dropped from a full queue (never decode work).
	Dropped
)

// Status is what a barrier reports (the control file's status line).
type Status = hints.Status

type stage uint8

const (
	stQueued   stage = iota // waiting in a queue
	stInflight              // handed to the loader; settles when pushed or failed
	stFaulted               // a FUSE read served it: settles once confirmed resident
)

// pageState is one page queued, in flight or awaiting confirmation.
type pageState struct {
	gen    uint64 // run id of the admission that created it
	stage  stage
	decode bool // queued as decode work: never dropped
	// claimedDecode: claimed by a decode run, so counted in
	// core.inflightDecode until the loader answers it.
	claimedDecode bool
	// admitDecode: offer it to the hot tier as decode work once resident.
	admitDecode bool
	// faulted: a reader faulted it while it was queued or in flight. The
	// hot tier heard of it then, as a fault (Prefetcher.Faulted), so its
	// settle offers it nothing: one access, heard once.
	faulted bool
	// Handles waiting for it, each with the oldest of its submissions that
	// named the page: a later submission of the same handle that names it
	// again adds nothing (any barrier covering the later one covers the
	// older one too).
	first link
	more  []link
}

type link struct {
	b   *Barrier
	seq uint64
}

// run is pages [first, first+n) of table, queued by admission id.
type run struct {
	id    uint64
	table uint32
	first uint64
	n     uint64
}

// runFIFO is a queue of runs that counts its pages.
type runFIFO struct {
	runs  []run
	head  int
	pages int
}

func (q *runFIFO) len() int { return len(q.runs) - q.head }

func (q *runFIFO) push(r run) {
	// Reclaim the consumed prefix once it is half the slice.
	if q.head > 64 && q.head*2 >= len(q.runs) {
		q.runs = append(q.runs[:0], q.runs[q.head:]...)
		q.head = 0
	}
	q.runs = append(q.runs, r)
	q.pages += int(r.n)
}

func (q *runFIFO) pop() (run, bool) {
	if q.head == len(q.runs) {
		return run{}, false
	}
	r := q.runs[q.head]
	q.runs[q.head] = run{}
	q.head++
	q.pages -= int(r.n)
	return r, true
}

// pushFront puts back the rest of a run just popped.
func (q *runFIFO) pushFront(r run) {
	if q.head > 0 {
		q.head--
		q.runs[q.head] = r
	} else {
		q.runs = append([]run{r}, q.runs[q.head:]...)
		q.head = 0
	}
	q.pages += int(r.n)
}

func (q *runFIFO) reset() { *q = runFIFO{} }

// coreConfig bounds the core.
type coreConfig struct {
	prefillPages int // pages the prefill queue holds; past it the oldest runs drop
	// decodeInflight is how many pages of decode work may be in flight
	// whatever prefill work holds: a decode step that arrives while
	// prefill fills the in-flight budget starts at once instead of waiting
	// for prefill reads to answer one by one (measured: a 72-row step
	// beside four handles flooding prefill took 2.2-4.3x its time alone).
	// 0: decode shares the caller's budget only.
	decodeInflight int
}

// pageIndex is the state of every page the core knows, a map per table
// keyed by page: a uint64 key hashes on the runtime's fast path, where a
// PageKey struct went through the generic hash and an equality call (a
// third of the flood's admission CPU, measured in
// BenchmarkPrefillFloodPart).
type pageIndex struct {
	tables []map[uint64]*pageState
	n      int
}

func (x *pageIndex) get(table uint32, page uint64) *pageState {
	if int(table) >= len(x.tables) {
		return nil
	}
	return x.tables[table][page]
}

func (x *pageIndex) put(table uint32, page uint64, s *pageState) {
	for int(table) >= len(x.tables) {
		x.tables = append(x.tables, nil)
	}
	m := x.tables[table]
	if m == nil {
		m = map[uint64]*pageState{}
		x.tables[table] = m
	}
	if _, ok := m[page]; !ok {
		x.n++
	}
	m[page] = s
}

func (x *pageIndex) del(table uint32, page uint64) {
	if int(table) >= len(x.tables) {
		return
	}
	if _, ok := x.tables[table][page]; ok {
		delete(x.tables[table], page)
		x.n--
	}
}

// len is the number of page states.
func (x *pageIndex) len() int { return x.n }

// each calls fn for every page state; fn may delete the page it is given.
func (x *pageIndex) each(fn func(k cache.PageKey, s *pageState)) {
	for t, m := range x.tables {
		for pg, s := range m {
			fn(cache.PageKey{Table: uint32(t), Page: pg}, s)
		}
	}
}

// core is the scheduler state. Not safe for concurrent use.
type core struct {
	cfg     coreConfig
	pages   pageIndex
	prefill runFIFO
	// Handles with decode work, served round robin: one run each per turn,
	// so a handle that sends prefill-sized decode frames delays the others
	// by one run, not by its whole backlog.
	ring []*Barrier
	rr   int
	id   uint64 // last admission id
	// inflight is the number of pages handed to the loader and not yet
	// answered; inflightDecode, those of them claimed by decode runs.
	inflight, inflightDecode int

	// decodeWanted counts the pages decode work named that have not
	// settled; decodeIdle, when not nil, is closed when it drops to 0.
	decodeWanted int
	decodeIdle   chan struct{}

	// Tallies for the counters (the Prefetcher publishes them).
	queued, dropped uint64
	throttledDrops  uint64 // of dropped: for throttled handles (Barrier.throttled)
	// onDrop hears of dropped pages (per-layer counters, the hint
	// accuracy bitmap); may be nil.
	onDrop func(table uint32, first, n uint64)
}

func newCore(cfg coreConfig) *core {
	return &core{cfg: cfg}
}

// submission opens a new submission (a part of a frame) on b.
func (c *core) submission(b *Barrier) uint64 {
	b.seq++
	return b.seq
}

// endSubmission closes what submission seq opened: frameEnd counts a frame.
// Barriers cover it from now on.
func (c *core) endSubmission(b *Barrier, seq uint64, frameEnd bool) {
	b.accepted = seq
	if frameEnd {
		b.status.Frames++
	}
	b.advance()
}

// pinned counts the pages of b's current submission that were pinned
// already, and cached those that were in the page cache already (resident,
// nothing to fetch). A page b still waits for from an earlier submission
// (queued, in flight, or faulted and being confirmed: the page cache may
// have it already) counts once, when it settles; counting it here too
// would count it twice.
func (c *core) present(b *Barrier, pinned, cached []cache.PageKey) {
	for _, k := range pinned {
		if !c.waiting(b, k) {
			b.status.Pages++
			b.status.Pinned++
		}
	}
	for _, k := range cached {
		if !c.waiting(b, k) {
			b.status.Pages++
			b.status.Resident++
			b.status.Cached++
		}
	}
}

// waiting reports whether b waits for page k.
func (c *core) waiting(b *Barrier, k cache.PageKey) bool {
	s := c.pages.get(k.Table, k.Page)
	return s != nil && s.linked(b)
}

// pageRun is pages [first, first+n) of table: what a submission names.
type pageRun struct {
	table uint32
	first uint64
	n     uint64
}

// admit queues runs (sorted, non-overlapping) for b's submission seq.
// decode: queue as decode work (b's own queue, never dropped); otherwise as
// prefill work, on the shared queue, dropped oldest first when full. A
// prefill submission larger than the whole queue keeps its last pages.
// admitDecode: offer the pages to the hot tier as decode work.
func (c *core) admit(b *Barrier, seq uint64, runs []pageRun, decode, admitDecode bool) {
	if len(runs) == 0 {
		return
	}
	c.id++
	id := c.id
	if !decode {
		total := 0
		for _, r := range runs {
			total += int(r.n)
		}
		// Keep the tail: it is what the next chunk needs last, and the
		// queue's own rule (oldest first) would drop the head anyway.
		for skip := total - c.cfg.prefillPages; skip > 0; {
			r := &runs[0]
			k := min(uint64(skip), r.n)
			c.dropUnqueued(b, r.table, r.first, k)
			r.first += k
			r.n -= k
			skip -= int(k)
			if r.n == 0 {
				runs = runs[1:]
			}
		}
	}
	for _, r := range runs {
		start, n := r.first, uint64(0) // the pages of r this admission queues
		flush := func() {
			if n > 0 {
				c.enqueue(b, run{id: id, table: r.table, first: start, n: n}, decode)
			}
		}
		for pg := r.first; pg < r.first+r.n; pg++ {
			s := c.pages.get(r.table, pg)
			fresh := false
			switch {
			case s == nil:
				s = &pageState{gen: id}
				c.pages.put(r.table, pg, s)
				fresh = true
			case s.stage == stQueued && decode && !s.decode:
				// Queued as prefill: it gets a decode run too, so it is
				// not stuck behind prefill work, and it is never dropped.
				fresh = true
			}
			if decode && !s.decode {
				s.decode = true
				c.decodeWanted++
			}
			if decode || admitDecode {
				s.admitDecode = true
			}
			if s.addLink(b, seq) {
				b.status.Pages++
				b.wait(seq)
			}
			if fresh {
				if n == 0 {
					start = pg
				}
				n++
				continue
			}
			flush()
			n = 0
		}
		flush()
	}
}

// dropUnqueued counts pages [first, first+n) of table, cut off a prefill
// submission of b before they were queued, as dropped, but for those b
// waits for already (they settle, and count, as they will). A handle that
// waits for nothing, as a fresh oversize frame's, is counted a run at a
// time: no page lookups under the lock for a 4M-row frame.
func (c *core) dropUnqueued(b *Barrier, table uint32, first, n uint64) {
	if len(b.open) == 0 {
		b.status.Pages += n
		b.status.Dropped += n
		c.dropped += n
		if c.onDrop != nil {
			c.onDrop(table, first, n)
		}
		return
	}
	for pg := first; pg < first+n; pg++ {
		if c.waiting(b, cache.PageKey{Table: table, Page: pg}) {
			continue
		}
		b.status.Pages++
		b.status.Dropped++
		c.dropped++
		if c.onDrop != nil {
			c.onDrop(table, pg, 1)
		}
	}
}

// enqueue puts r on its queue, making room in the prefill queue first.
func (c *core) enqueue(b *Barrier, r run, decode bool) {
	c.queued += r.n
	if decode {
		b.decodeQ.push(r)
		if !b.inRing {
			b.inRing = true
			c.ring = append(c.ring, b)
		}
		return
	}
	for c.prefill.pages+int(r.n) > c.cfg.prefillPages && c.prefill.len() > 0 {
		c.dropOldest()
	}
	c.prefill.push(r)
}

// throttled reports whether every handle waiting for the page is
// throttled: its pushes are being evicted before its barrier returns.
func (s *pageState) throttled() bool {
	if s.first.b == nil || !s.first.b.throttled {
		return false
	}
	for _, l := range s.more {
		if !l.b.throttled {
			return false
		}
	}
	return true
}

// linked reports whether b waits for the page.
func (s *pageState) linked(b *Barrier) bool {
	if s.first.b == b {
		return true
	}
	for _, l := range s.more {
		if l.b == b {
			return true
		}
	}
	return false
}

// addLink records that b's submission seq waits for the page; false if b
// was waiting for it already.
func (s *pageState) addLink(b *Barrier, seq uint64) bool {
	if s.first.b == nil {
		s.first = link{b, seq}
		return true
	}
	if s.linked(b) {
		return false
	}
	s.more = append(s.more, link{b, seq})
	return true
}

// dropOldest drops the oldest prefill run: the pages it queued that are
// still only queued as prefill settle as dropped.
func (c *core) dropOldest() {
	r, ok := c.prefill.pop()
	if !ok {
		return
	}
	for pg := r.first; pg < r.first+r.n; pg++ {
		s := c.pages.get(r.table, pg)
		if s == nil || s.gen != r.id || s.stage != stQueued || s.decode {
			continue // not this run's page any more
		}
		c.pages.del(r.table, pg)
		c.dropped++
		if c.onDrop != nil {
			c.onDrop(r.table, pg, 1)
		}
		s.settle(Dropped, nil)
	}
}

// next claims work: decode runs first, one run per handle per turn, up to
// budget pages or to what cfg.decodeInflight leaves, whichever is more;
// then prefill runs oldest first, up to what budget leaves. budget is what
// the in-flight bound leaves (it may be negative when decode went past
// it). The claimed pages are in flight from now on; the caller hands the
// returned runs to the loader, decode runs as demand reads.
func (c *core) next(budget int) (decode, prefill []cache.Run) {
	var out []cache.Run
	dbudget := max(budget, c.cfg.decodeInflight-c.inflightDecode)
	claimed := dbudget
	for dbudget > 0 && len(c.ring) > 0 {
		if c.rr >= len(c.ring) {
			c.rr = 0
		}
		b := c.ring[c.rr]
		r, _ := b.decodeQ.pop()
		out, dbudget = c.claim(out, &b.decodeQ, r, dbudget, true)
		b.noteRoom()
		if b.decodeQ.len() == 0 {
			b.inRing = false
			c.ring = append(c.ring[:c.rr], c.ring[c.rr+1:]...)
		} else {
			c.rr++
		}
	}
	budget -= claimed - dbudget
	if c.decodeWanted > 0 && c.cfg.decodeInflight > 0 {
		// While decode work is pending, prefill keeps to a quarter of
		// the decode bound: the read engine serves reads in the order
		// they came, so every prefill read handed over now is one more a
		// decode read of this step may queue behind. One page at least:
		// prefill always moves.
		budget = min(budget, max(c.cfg.decodeInflight/4, 1)-(c.inflight-c.inflightDecode))
	}
	decode = out
	out = nil
	for budget > 0 && c.prefill.len() > 0 {
		r, _ := c.prefill.pop()
		out, budget = c.claim(out, &c.prefill, r, budget, false)
	}
	return decode, out
}

// claim claims the pages of r still queued for it, up to budget; what the
// budget leaves goes back to the front of q. decode: r is decode work.
func (c *core) claim(out []cache.Run, q *runFIFO, r run, budget int, decode bool) ([]cache.Run, int) {
	var cur cache.Run
	for pg := r.first; pg < r.first+r.n; pg++ {
		if budget == 0 {
			q.pushFront(run{id: r.id, table: r.table, first: pg, n: r.first + r.n - pg})
			break
		}
		s := c.pages.get(r.table, pg)
		if s == nil || s.gen > r.id || s.stage != stQueued {
			continue
		}
		if !decode && !s.decode && s.throttled() {
			c.pages.del(r.table, pg)
			c.dropped++
			c.throttledDrops++
			if c.onDrop != nil {
				c.onDrop(r.table, pg, 1)
			}
			s.settle(Dropped, nil)
			continue
		}
		s.stage = stInflight
		budget--
		c.inflight++
		if decode {
			s.claimedDecode = true
			c.inflightDecode++
		}
		if cur.N > 0 && cur.First+cur.N == pg {
			cur.N++
			continue
		}
		if cur.N > 0 {
			out = append(out, cur)
		}
		cur = cache.Run{Table: r.table, First: pg, N: 1}
	}
	if cur.N > 0 {
		out = append(out, cur)
	}
	return out, budget
}

// answered returns the pages of r to the in-flight budget: the loader
// answered them. They wait for a pusher now (Prefetcher.unstored).
func (c *core) answered(r cache.Run) {
	c.inflight -= int(r.N)
	for pg := r.First; pg < r.First+r.N; pg++ {
		if s := c.pages.get(r.Table, pg); s != nil && s.claimedDecode {
			s.claimedDecode = false
			c.inflightDecode--
		}
	}
}

// admissions reports which of pages [first, first+n) of table are to be
// offered to the hot tier as decode work (true) or as prefill work. A page a
// reader faulted before its prefetch settled is not: the tier heard of that
// access as a fault already, and hearing of it twice would promote a page
// read once (a late decode prefetch would reach the protected segment, an
// early one would not).
func (c *core) admissions(table uint32, first, n uint64, fn func(k cache.PageKey, decode bool)) {
	for pg := first; pg < first+n; pg++ {
		if s := c.pages.get(table, pg); s != nil && s.stage != stQueued && !s.faulted {
			fn(cache.PageKey{Table: table, Page: pg}, s.admitDecode)
		}
	}
}

// settle ends pages [first, first+n) of table that are in flight or awaiting
// confirmation: every handle waiting for them hears outcome.
func (c *core) settle(table uint32, first, n uint64, o Outcome) { c.settleWhy(table, first, n, o, nil) }

// settleWhy is settle with why the pages failed (o Failed), which every
// handle waiting for them hears in its barrier's status.
func (c *core) settleWhy(table uint32, first, n uint64, o Outcome, why error) {
	for pg := first; pg < first+n; pg++ {
		s := c.pages.get(table, pg)
		if s == nil || s.stage == stQueued {
			continue // not claimed: not ours to settle
		}
		c.forget(table, pg, s)
		s.settle(o, why)
	}
}

// forget deletes the state of page pg of table.
func (c *core) forget(table uint32, pg uint64, s *pageState) {
	c.pages.del(table, pg)
	if !s.decode {
		return
	}
	if c.decodeWanted--; c.decodeWanted == 0 && c.decodeIdle != nil {
		close(c.decodeIdle)
		c.decodeIdle = nil
	}
}

// decodeBusy returns nil when no decode work is pending, else a channel
// closed once none is.
func (c *core) decodeBusy() <-chan struct{} {
	if c.decodeWanted == 0 {
		return nil
	}
	if c.decodeIdle == nil {
		c.decodeIdle = make(chan struct{})
	}
	return c.decodeIdle
}

// faulted cancels the fetch of keys still queued: a FUSE read is serving
// them, so fetching them again would read them twice. They are not resident
// yet (the read's reply is still on its way to the kernel), so they do not
// settle here: the caller confirms each returned page resident, then
// settles it. Pages in flight are left alone: the loader hands the fault the
// prefetch's own read. late counts the keys whose prefetch was queued or in
// flight, once a page: a page a fault cancelled or caught already is neither.
// Either way the page is marked faulted, so its settle offers the hot tier
// nothing (see admissions).
//
// A page awaiting confirmation is the pusher's own Confirm read, which
// faulted it in again (it was evicted after the first fault's reply): it
// is no demand, and demand is keys without it (keys itself when there is
// none). The reader's access was the first fault.
func (c *core) faulted(keys []cache.PageKey) (confirm, demand []cache.PageKey, late uint64) {
	demand = keys
	for i, k := range keys {
		s := c.pages.get(k.Table, k.Page)
		own := s != nil && s.stage == stFaulted
		switch {
		case own && len(demand) == len(keys):
			demand = slices.Clone(keys[:i])
		case !own && len(demand) < len(keys):
			demand = append(demand, k)
		}
		if s == nil {
			continue
		}
		switch s.stage {
		case stQueued:
			s.stage = stFaulted
			s.faulted = true
			confirm = append(confirm, k)
			late++
		case stInflight:
			if !s.faulted {
				s.faulted = true
				late++
			}
		}
	}
	return confirm, demand, late
}

// drain empties the queues at close: every queued page fails. Pages in
// flight or awaiting confirmation still settle through their own paths.
func (c *core) drain() {
	c.pages.each(func(k cache.PageKey, s *pageState) {
		if s.stage == stQueued {
			c.forget(k.Table, k.Page, s)
			s.settle(Failed, ErrStopped)
		}
	})
	c.prefill.reset()
	for _, b := range c.ring {
		b.decodeQ.reset()
		b.inRing = false
		b.noteRoom()
	}
	c.ring = nil
}

func (s *pageState) settle(o Outcome, why error) {
	s.first.b.settle(s.first.seq, o, why)
	for _, l := range s.more {
		l.b.settle(l.seq, o, why)
	}
}

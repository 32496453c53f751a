package prefetch

import (
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/cache"
)

// The pushers: they take every answer waiting, store the fetched pages into
// the page cache (adjacent pages in one store: merging saves a notify round
// trip per page), confirm the pages a fault cancelled, and settle them all.
// They hold no lock while storing: a store waits for the folio lock of a
// page a FUSE read is serving, and that read must be able to finish
// (docs/design.md, "Kernel facts and what the code does about them": storing
// the page a Read handler is serving hangs forever).

// outcome is one answer for the pushers.
type outcome struct {
	run     cache.Run
	pages   [][]byte // fetched data; nil with err
	err     error
	confirm bool // a fault cancelled the fetch: confirm the page resident
	decode  bool // fetched for a decode hint: pushed and settled first
	fetched bool // the loader's answer for claimed pages: in the in-flight budget until settled
}

// maxStorePages caps one merged store (1 MiB, as a backing read).
const maxStorePages = cache.MaxRunPages

// A pusher looks for decode answers after every store of a prefill batch
// and stores and settles those first: a decode step's pages wait for at
// most one prefill store (up to maxStorePages pages merged), where a pusher
// that took every answer waiting stored them whole before it looked again
// (issue 24: a one-row decode step waited ~100 ms behind 5,000 prefill
// stores). Taking prefill answers in slices of 64 pages instead cost the
// serving loop's prefill chunks 25-50 ms of waiting (0.4 ms before): a
// settle and a tier admission per slice, and fewer adjacent pages merged.

// settled is a run's outcome, ready for the core.
type settled struct {
	run     cache.Run
	o       Outcome
	fetched bool  // claimed pages the loader answered: they leave the in-flight budget
	why     error // the reason of a failure, for the barriers' status
}

func (p *Prefetcher) signalPushers() {
	select {
	case p.outReady <- struct{}{}:
	default:
	}
}

// pushScratch is one pusher's reusable memory: a pusher handles every
// fetched page, so it allocates nothing per batch once warm.
type pushScratch struct {
	batch   []outcome // the previous batch, emptied: the next p.out
	buf     []byte    // merged stores
	done    []settled
	runs    []cache.Run
	decode  []cache.PageKey
	prefill []cache.PageKey
}

// maxScratch bounds what a pusher keeps between batches (a prefill flood's
// batch may be huge once; it is not kept).
const maxScratch = 4096

// reuse is s emptied, to be filled again, or nil past maxScratch.
func reuse[T any](s []T) []T {
	if cap(s) > maxScratch {
		return nil
	}
	return s[:0]
}

func (p *Prefetcher) pushLoop() {
	defer p.pushers.Done()
	var sc, dsc pushScratch // dsc: decode answers taken during a prefill batch
	for {
		p.omu.Lock()
		batch := p.takeLocked(sc.batch[:0])
		p.omu.Unlock()
		if len(batch) == 0 {
			sc.batch = batch
			select {
			case <-p.outReady:
				continue
			case <-p.pushQuit:
				p.omu.Lock()
				empty := len(p.out)+len(p.outDecode) == 0
				p.omu.Unlock()
				if empty {
					return
				}
				continue
			}
		}
		p.mu.Lock()
		p.pushing++
		p.mu.Unlock()
		p.pushPart(batch, &sc, &dsc)
		p.mu.Lock()
		p.pushing--
		p.idle.Broadcast()
		p.mu.Unlock()
		clear(batch) // the pages go back to the collector
		sc.batch = reuse(batch)
	}
}

// takeLocked appends to batch the answers a pusher handles next: every
// decode answer waiting, else every other answer.
//
// REQUIRES(p.omu)
func (p *Prefetcher) takeLocked(batch []outcome) []outcome {
	if len(p.outDecode) > 0 {
		batch = append(batch, p.outDecode...)
		clear(p.outDecode)
		p.outDecode = reuse(p.outDecode)
		return batch
	}
	batch = append(batch, p.out...)
	clear(p.out)
	p.out = reuse(p.out)
	return batch
}

// pushDecodeWaiting stores and settles the decode answers waiting, if any,
// with dsc: a prefill batch's pusher calls it between its stores.
func (p *Prefetcher) pushDecodeWaiting(dsc *pushScratch) {
	p.omu.Lock()
	if len(p.outDecode) == 0 {
		p.omu.Unlock()
		return
	}
	batch := p.takeLocked(dsc.batch[:0])
	p.omu.Unlock()
	p.pushPart(batch, dsc, nil)
	clear(batch)
	dsc.batch = reuse(batch)
}

// pushPart stores, confirms and settles answers, adjacent pages in one store.
// dsc, when not nil, is the scratch for decode answers that arrive
// meanwhile: they are stored and settled between this batch's stores.
func (p *Prefetcher) pushPart(batch []outcome, sc, dsc *pushScratch) {
	if len(batch) == 0 {
		return
	}
	slices.SortFunc(batch, func(a, b outcome) int {
		if a.run.Table != b.run.Table {
			return int(a.run.Table) - int(b.run.Table)
		}
		return compareU64(a.run.First, b.run.First)
	})
	done, buf := sc.done[:0], sc.buf
	for i := 0; i < len(batch); {
		o := batch[i]
		switch {
		case o.confirm:
			done = append(done, p.confirm(o.run))
			i++
			continue
		case o.err != nil:
			p.st.PrefetchPagesFailed.Add(o.run.N)
			done = append(done, settled{run: o.run, o: Failed, fetched: o.fetched, why: o.err})
			p.landed(o.run.N)
			i++
			continue
		}
		// Merge the answers that continue this one.
		j, n := i+1, o.run.N
		for j < len(batch) && !batch[j].confirm && batch[j].err == nil && batch[j].run.Table == o.run.Table &&
			batch[j].run.First == o.run.First+n && n+batch[j].run.N <= maxStorePages {
			n += batch[j].run.N
			j++
		}
		data := o.pages[0]
		if n > 1 {
			buf = buf[:0]
			for _, b := range batch[i:j] {
				for _, pg := range b.pages {
					buf = append(buf, pg...)
				}
			}
			data = buf
		}
		r := cache.Run{Table: o.run.Table, First: o.run.First, N: n}
		s := p.store(r, data)
		s.fetched = o.fetched
		done = append(done, s)
		p.landed(n)
		i = j
		if dsc != nil {
			p.pushDecodeWaiting(dsc)
		}
	}
	p.settle(done, sc)
	sc.done = reuse(done)
	if cap(buf) > 4*maxStorePages*cache.PageSize {
		buf = nil
	}
	sc.buf = buf
}

// store pushes run r's data into the page cache.
func (p *Prefetcher) store(r cache.Run, data []byte) settled {
	off := int64(r.First) * cache.PageSize
	err := p.pusher.Store(r.Table, off, data)
	if err == nil {
		p.st.PrefetchPagesStored.Add(r.N)
		p.layerOf[r.Table].Pushed.Add(r.N)
		return settled{run: r, o: Resident}
	}
	p.st.PrefetchStoreErrors.Add(r.N)
	p.st.PrefetchPagesFailed.Add(r.N)
	p.log.Warn("page cache store failed", zap.Uint32("table", r.Table), zap.Int64("offset", off), zap.Error(err))
	return settled{run: r, o: Failed, why: fmt.Errorf("table %s: page cache store of pages [%d, +%d): %w", p.model.Tables[r.Table].Name, r.First, r.N, err)}
}

// confirm makes sure a page a fault read is in the page cache.
func (p *Prefetcher) confirm(r cache.Run) settled {
	if p.confirmer == nil {
		return settled{run: r, o: Resident}
	}
	if err := p.confirmer.Confirm(r.Table, int64(r.First)*cache.PageSize); err != nil {
		p.st.PrefetchPagesFailed.Add(r.N)
		p.log.Warn("confirming a faulted page failed", zap.Uint32("table", r.Table), zap.Uint64("page", r.First), zap.Error(err))
		return settled{run: r, o: Failed, why: fmt.Errorf("table %s: confirming faulted page %d: %w", p.model.Tables[r.Table].Name, r.First, err)}
	}
	return settled{run: r, o: Resident}
}

// settle offers the resident pages to the hot tier, then settles them all:
// once a barrier returns, the tier has heard of its pages (a warm restart
// flushes the tier's pin queue right after its barrier and counts what is
// pinned). Admit runs without p.mu: pinning faults through our own Read
// handler, which takes p.mu (Faulted).
func (p *Prefetcher) settle(done []settled, sc *pushScratch) {
	// Their stores have landed (or failed): a fault reads them through the
	// page cache now, or from backing, not from the loader's hold.
	runs := sc.runs[:0]
	for _, d := range done {
		runs = append(runs, d.run)
	}
	p.loader.Release(runs...)
	sc.runs = reuse(runs)
	decodeKeys, prefillKeys := sc.decode[:0], sc.prefill[:0]
	if p.hot != nil {
		p.mu.Lock()
		for _, d := range done {
			if d.o != Resident {
				continue
			}
			p.c.admissions(d.run.Table, d.run.First, d.run.N, func(k cache.PageKey, decode bool) {
				if decode {
					decodeKeys = append(decodeKeys, k)
				} else {
					prefillKeys = append(prefillKeys, k)
				}
			})
		}
		p.mu.Unlock()
		if len(decodeKeys) > 0 {
			p.hot.Admit(decodeKeys, cache.SignalDecode)
		}
		if len(prefillKeys) > 0 {
			p.hot.Admit(prefillKeys, cache.SignalPrefill)
		}
	}
	p.mu.Lock()
	freed := false
	var checks []throttleCheck
	for _, d := range done {
		if d.fetched {
			freed = true
			if d.o == Resident {
				checks = p.markPushed(d.run, checks)
			}
		}
		p.c.settleWhy(d.run.Table, d.run.First, d.run.N, d.o, d.why)
	}
	p.mu.Unlock()
	if len(checks) > 0 {
		p.throttle(checks)
	}
	if freed {
		p.wakeFetch()
	}
	sc.decode, sc.prefill = reuse(decodeKeys), reuse(prefillKeys)
}

// markPushed marks the pages of run r, just stored, as pushed: a fault on
// one before the next counts as a push evicted before use. A page a reader
// faulted while its fetch was in flight is not marked: that reader used it.
// It returns checks with the handles that want their first pushed prefill
// page looked up (every throttleCheckPages pages pushed for them).
//
// REQUIRES(p.mu)
func (p *Prefetcher) markPushed(r cache.Run, checks []throttleCheck) []throttleCheck {
	for pg := r.First; pg < r.First+r.N; pg++ {
		s := p.c.pages.get(r.Table, pg)
		if s == nil || s.faulted {
			continue
		}
		p.markBits(p.pushed, r.Table, pg, 1)
		if s.decode {
			continue
		}
		k := cache.PageKey{Table: r.Table, Page: pg}
		checks = pushedFor(s.first.b, k, checks)
		for _, l := range s.more {
			checks = pushedFor(l.b, k, checks)
		}
	}
	return checks
}

// throttleCheckPages: a handle's first pushed prefill page is looked up
// once per this many pages pushed for it since its last barrier (a
// mincore call, ~1 µs).
const throttleCheckPages = 1024

// throttleCheck is a handle whose first pushed page to look up.
type throttleCheck struct {
	b *Barrier
	k cache.PageKey
}

// pushedFor counts page k as pushed for b.
//
// REQUIRES(p.mu)
func pushedFor(b *Barrier, k cache.PageKey, checks []throttleCheck) []throttleCheck {
	if b.pushedSince == 0 {
		b.pushedFirst = k
	}
	if b.pushedSince++; b.pushedSince%throttleCheckPages == 0 && !b.throttled {
		checks = append(checks, throttleCheck{b, b.pushedFirst})
	}
	return checks
}

// throttle looks up the first pushed page of each check's handle: evicted
// before its barrier returned, the handle's prefill work is more than the
// page cache holds, and every further page it pushed would evict one it
// pushed before its reader got there (issue 24: a prefill larger than
// memory read 90% of its pushed pages again). The rest of its prefill work
// drops instead (core.claim; counted dropped, and in
// prefetch_pages_throttled): its reader faults those pages, one read each.
func (p *Prefetcher) throttle(checks []throttleCheck) {
	if p.hot == nil {
		return
	}
	var vec [1]byte
	for _, c := range checks {
		if !p.hot.ResidentRun(c.k.Table, c.k.Page, 1, vec[:]) || vec[0]&1 != 0 {
			continue // cannot tell, or still there
		}
		p.mu.Lock()
		if c.b.pushedSince > 0 && c.b.pushedFirst == c.k { // not a new barrier since
			c.b.throttled = true
		}
		p.mu.Unlock()
	}
}

// landed takes n answered pages off the pushers' backlog (their store
// landed or failed) and lets the fetch loop claim again.
func (p *Prefetcher) landed(n uint64) {
	p.unstored.Add(-int64(n))
	p.wakeFetch()
}

package prefetch

import (
	"github.com/engramfs/engramfs/cache"
)

// The fetch loop: it claims work from the core while the in-flight budget
// allows and hands it to the loader in one batch per claim (a decode frame's
// pages, a slice of a prefill chunk), so the read engine submits them
// together instead of a goroutine blocking per run. It never waits for a
// read: the loader answers through fetched, from its completion goroutine.

// wakeFetch tells the fetch loop that there may be work or room.
func (p *Prefetcher) wakeFetch() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *Prefetcher) fetchLoop() {
	defer close(p.fetchDone)
	for {
		select {
		case <-p.kick:
		case <-p.quit:
			return
		}
		p.claimAndFetch()
	}
}

// claimAndFetch claims work while the in-flight budget allows and hands it
// to the loader. The fetch loop runs it when woken; a decode hint's writer
// runs it too, right after admitting the step, so the step's reads start
// without waiting for the fetch loop's goroutine to be scheduled (on these
// VMs a wake-up of an idle CPU costs tens of µs). Both may run it at once:
// each claim is made under p.mu.
func (p *Prefetcher) claimAndFetch() {
	for {
		p.mu.Lock()
		var decode, prefill []cache.Run
		if !p.closed {
			// Pages read and not yet stored are bounded too (issue 24:
			// with the budget back at the answer alone, 49,981 answered
			// pages, +209 MiB, waited for a held pusher against a bound
			// of 128), but more loosely than reads: a budget held until
			// the store made the disk wait for the pusher and the pusher
			// for the disk (a prefill chunk's wait went from 0.4 to
			// 150 ms in the serving loop).
			budget := min(p.cfg.InflightPages-p.c.inflight, p.unstoredBound()-p.c.inflight-int(p.unstored.Load()))
			decode, prefill = p.c.next(budget)
			p.publishLocked() // a throttled handle's pages drop as they are claimed
		}
		p.mu.Unlock()
		if len(decode)+len(prefill) == 0 {
			return
		}
		// A decode hint's reads are demand reads (an object store
		// serves and hedges them as it does a fault's); prefill's
		// wait their turn.
		if len(decode) > 0 {
			p.loader.FetchHeld(decode, cache.OriginDecode, p.fetchedDecode)
		}
		if len(prefill) > 0 {
			p.loader.FetchHeld(prefill, cache.OriginPrefetch, p.fetchedPrefill)
		}
	}
}

// fetched receives the loader's answer for part of a claimed run. It runs
// on the read engine's completion goroutine (or inside Fetch) and must not
// block: it returns the read budget, queues the answer for the pushers,
// decode answers on their own queue, and wakes both loops. The pages stay
// in the pushers' backlog (unstored) until their store has landed.
func (p *Prefetcher) fetched(r cache.Run, pages [][]byte, err error, decode bool) {
	p.mu.Lock()
	p.c.answered(r)
	p.mu.Unlock()
	p.unstored.Add(int64(r.N))
	o := outcome{run: r, pages: pages, err: err, decode: decode, fetched: true}
	p.omu.Lock()
	if decode {
		p.outDecode = append(p.outDecode, o)
	} else {
		p.out = append(p.out, o)
	}
	p.omu.Unlock()
	p.signalPushers()
	p.wakeFetch()
}

func (p *Prefetcher) fetchedDecode(r cache.Run, pages [][]byte, err error) {
	p.fetched(r, pages, err, true)
}

func (p *Prefetcher) fetchedPrefill(r cache.Run, pages [][]byte, err error) {
	p.fetched(r, pages, err, false)
}

// unstoredBoundFactor: pages in flight and answered-not-stored together are
// at most this many times InflightPages.
const unstoredBoundFactor = 8

// unstoredBound is how many pages may be in flight or read and waiting for a
// pusher, all together.
func (p *Prefetcher) unstoredBound() int { return unstoredBoundFactor * p.cfg.InflightPages }

package warm

import (
	"context"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/prefetch"
)

// Prefetcher is the page-level submit of prefetch.Prefetcher.
type Prefetcher interface {
	SubmitPages(keys []cache.PageKey, sig cache.Signal, b *prefetch.Barrier)
}

// Pins is what the warm-up needs of the hot tier (cache.HotCache): whether
// a page is pinned, and a way to wait for the pins queued so far.
// (prefetch.HotTier is the hot tier as the prefetcher sees it.)
type Pins interface {
	Pinned(k cache.PageKey) bool
	Flush()
}

// DefaultBatchPages is how many pages the warm-up has queued at once: well
// under the hot tier's pin queue (at least 131,072 pages), whose overflow
// would be dropped, and a small part of the default prefill queue (262,144 pages), so
// live prefill hints keep their room.
const DefaultBatchPages = 4096

// Config is one warm-up.
type Config struct {
	Keys       []cache.PageKey // the pages to make hot again
	BatchPages int             // 0: DefaultBatchPages
	Prefetch   Prefetcher
	Hot        Pins
	Stats      *stats.Counters
	Log        *zap.Logger
	// Done, if set, is called once the warm-up ends (not when stopped).
	Done func(Result)
}

// Result is how a warm-up went.
type Result struct {
	Pages    int           // pages in the state
	Pinned   int           // of which pinned at the end
	Duration time.Duration // from start to the last page settled
}

// Warmer is a warm-up running in the background.
type Warmer struct {
	keys   []cache.PageKey
	next   atomic.Int64 // keys[next:] are not settled yet
	cancel context.CancelFunc
	done   chan struct{}
}

// Start fetches c.Keys in the background, in batches, as prefill work (live
// decode hints always go first) admitted to the hot tier as decode work, so
// the pages are pinned again, not merely resident. Progress is in
// c.Stats.WarmPagesTotal and WarmPagesDone.
func Start(c Config) *Warmer {
	if c.BatchPages <= 0 {
		c.BatchPages = DefaultBatchPages
	}
	if c.Log == nil {
		c.Log = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &Warmer{keys: c.Keys, cancel: cancel, done: make(chan struct{})}
	c.Stats.WarmPagesTotal.Store(uint64(len(c.Keys)))
	c.Stats.WarmPagesDone.Store(0)
	go w.run(ctx, c)
	return w
}

func (w *Warmer) run(ctx context.Context, c Config) {
	defer close(w.done)
	start := time.Now()
	for i := 0; i < len(w.keys); {
		j := min(i+c.BatchPages, len(w.keys))
		b := prefetch.NewBarrier()
		c.Prefetch.SubmitPages(w.keys[i:j], cache.SignalDecode, b)
		if err := b.Wait(ctx); err != nil && ctx.Err() != nil {
			return // stopped
		}
		// A failed page is not fatal: it stays cold and faults in later.
		// Wait for the pins too, so the next batch never overflows the
		// tier's pin queue.
		c.Hot.Flush()
		w.next.Store(int64(j))
		c.Stats.WarmPagesDone.Store(uint64(j))
		i = j
	}
	res := Result{Pages: len(w.keys), Duration: time.Since(start)}
	for _, k := range w.keys {
		if c.Hot.Pinned(k) {
			res.Pinned++
		}
	}
	c.Log.Info("warm restart finished", zap.Int("pages", res.Pages), zap.Int("pinned", res.Pinned),
		zap.Duration("took", res.Duration))
	if c.Done != nil {
		c.Done(res)
	}
}

// Pending lists the pages not yet settled: what a stop during the warm-up
// must save again, or they would be forgotten.
func (w *Warmer) Pending() []cache.PageKey { return w.keys[w.next.Load():] }

// Stop ends the warm-up (pages already queued stay queued) and waits for it.
func (w *Warmer) Stop() {
	w.cancel()
	<-w.done
}

// Wait blocks until the warm-up has ended.
func (w *Warmer) Wait() { <-w.done }

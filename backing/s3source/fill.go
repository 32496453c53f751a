package s3source

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// filler is the background fill lane (MirrorConfig.FillRate): it copies
// the pages of open shards that the mirror does not hold yet into it, at
// most FillRate bytes a second, with the lowest priority of all GETs:
//
//   - one fill GET at a time, of up to fillChunk bytes of unmirrored pages;
//   - it takes a slot only when one is free (no GET waits for one), and a
//     demand or prefill GET that has to wait for a slot cancels it
//     (slots.acquire preempts it), so it never delays them;
//   - it never makes the mirror evict: a fill write that does not fit the
//     budget is dropped (mirror.flush), and the lane pauses while the
//     mirror is full; its extents are the first evicted (a fill write does
//     not touch their LRU stamp);
//   - what is done is the mirror's bitmap, so a remount goes on from there;
//   - Source.Close stops it and waits: no goroutine or GET is left.
type filler struct {
	s    *Source
	rate int64 // bytes a second

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	kick   chan struct{} // a shard was opened: look for work now

	cursor map[*mirrorFile]int64 // the next page to look at, by file
	tokens float64               // bytes the lane may fetch now, at most fillChunk
	last   time.Time             // when tokens was last refilled
}

const (
	// fillChunk bounds a fill GET, and the bytes the lane may fetch at
	// once: its burst.
	fillChunk = 256 << 10
	// fillPause is how long the lane waits when there is nothing to fill
	// or no room: no shard open, every page mirrored, the budget full.
	fillPause = time.Second
	// fillBusy is how long it waits when no slot is free.
	fillBusy = 20 * time.Millisecond
)

func newFiller(s *Source, rate int64) *filler {
	fl := &filler{s: s, rate: rate, done: make(chan struct{}), kick: make(chan struct{}, 1),
		cursor: map[*mirrorFile]int64{}, tokens: fillChunk, last: time.Now()}
	fl.ctx, fl.cancel = context.WithCancel(context.Background())
	go fl.run()
	return fl
}

// wait sleeps d, or until the lane stops or a shard is opened.
func (fl *filler) wait(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-fl.kick:
	case <-fl.ctx.Done():
	}
}

// opened tells the lane a shard was opened.
func (fl *filler) opened() {
	select {
	case fl.kick <- struct{}{}:
	default:
	}
}

// stop stops the lane and waits for it (its GET canceled).
func (fl *filler) stop() {
	fl.cancel()
	<-fl.done
}

func (fl *filler) run() {
	defer close(fl.done)
	for fl.ctx.Err() == nil {
		sh, off, n := fl.next()
		if sh == nil || fl.s.mir.full(n) {
			fl.wait(fillPause)
			continue
		}
		if !fl.take(n) {
			return
		}
		for fl.ctx.Err() == nil && !fl.fetch(sh, off, n) {
			fl.wait(fillBusy) // no free slot: try again
		}
	}
}

// take waits until the lane may fetch n more bytes and counts them as
// fetched: the bytes fetched by time t are at most fillChunk + rate × t
// (counted when a GET starts, so a GET canceled or failed counts too).
func (fl *filler) take(n int64) bool {
	for {
		now := time.Now()
		fl.tokens = min(fillChunk, fl.tokens+float64(fl.rate)*now.Sub(fl.last).Seconds())
		fl.last = now
		if fl.tokens >= float64(n) {
			fl.tokens -= float64(n)
			return true
		}
		fl.wait(time.Duration((float64(n) - fl.tokens) / float64(fl.rate) * float64(time.Second)))
		if fl.ctx.Err() != nil {
			return false
		}
	}
}

// next finds the first run of unmirrored pages of an open shard, up to
// fillChunk bytes, from where the lane left off in each shard (shards in
// name order). nil: nothing to fill now.
func (fl *filler) next() (*shard, int64, int64) {
	for _, sh := range fl.s.opened.sorted() {
		f := sh.mir
		p, ok := f.unmirrored(sh.id.ETag, fl.cursor[f])
		if !ok {
			fl.cursor[f] = f.pages // done, unless pages are evicted (then the budget is full)
			continue
		}
		end := p + 1
		f.mu.RLock()
		for end < f.pages && (end-p)*mirrorPage < fillChunk && f.bits[end/64]&(1<<(end%64)) == 0 {
			end++
		}
		f.mu.RUnlock()
		fl.cursor[f] = end
		return sh, p * mirrorPage, min(end*mirrorPage, f.size) - p*mirrorPage
	}
	// A round found nothing: look again from the start next time (pages
	// may be evicted, or shards opened, meanwhile).
	clear(fl.cursor)
	return nil, 0, 0
}

// fetch GETs [off, off+n) of sh in a slot nobody waits for and queues its
// pages for the mirror; false: no slot was free.
func (fl *filler) fetch(sh *shard, off, n int64) bool {
	s := fl.s
	if !sh.enter(1) {
		return true // closing: nothing to do
	}
	defer sh.inflight.Done()
	ctx, cancel := context.WithTimeout(sh.ctx, s.cfg.AttemptTimeout)
	defer cancel()
	stop := context.AfterFunc(fl.ctx, cancel)
	defer stop()
	var preempted atomic.Bool
	if !s.slots.tryAcquireFill(func() { preempted.Store(true); cancel() }) {
		return false
	}
	defer s.slots.releaseFill()
	s.st.S3Gets.Add(1)
	s.st.S3FillGets.Add(1)
	body, err := s.c.GetRange(ctx, sh.key, off, n, sh.id.ETag)
	if err != nil {
		switch {
		case preempted.Load():
			s.st.S3FillPreempted.Add(1)
		case errors.Is(err, errPrecondition) || errors.Is(err, fs.ErrNotExist):
			// The object changed or is gone: its mirror serves and fills
			// nothing more (a 412 a chunk, at the fill rate, otherwise).
			s.st.S3ETagFailures.Add(1)
			sh.mir.invalidate(sh.id.ETag)
		}
		return true
	}
	buf := make([]byte, n)
	got, err := io.ReadFull(body, buf)
	body.Close()
	s.st.S3GetBytes.Add(uint64(got))
	s.st.S3FillBytes.Add(uint64(got))
	if err != nil {
		if preempted.Load() {
			s.st.S3FillPreempted.Add(1)
		}
		return true
	}
	sh.mir.putFill(sh.id.ETag, off, buf)
	return true
}

// shardSet is the open shards with a mirror, for the fill lane.
type shardSet struct {
	mu  sync.Mutex
	set map[*shard]struct{} // GUARDED_BY(mu)
}

// sorted returns the shards in name order.
func (o *shardSet) sorted() []*shard {
	o.mu.Lock()
	defer o.mu.Unlock()
	shards := make([]*shard, 0, len(o.set))
	for sh := range o.set {
		shards = append(shards, sh)
	}
	slices.SortFunc(shards, func(a, b *shard) int { return strings.Compare(a.name, b.name) })
	return shards
}

func (o *shardSet) add(sh *shard) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.set == nil {
		o.set = map[*shard]struct{}{}
	}
	o.set[sh] = struct{}{}
}

func (o *shardSet) remove(sh *shard) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.set, sh)
}

package cache

import (
	"testing"
	"time"

	"go.uber.org/zap"
)

// The worker's gathering delay runs from the oldest page queued: under a
// steady trickle of faults (a page every 20 ms, each well inside a 100 ms
// delay, fewer than a batch), pages are pinned while the trickle goes on.
// Counted from the newest page, nothing was pinned until the trickle
// stopped.
func TestHotCacheGathersFromTheOldestPage(t *testing.T) {
	f := sparseFile(t, 512)
	h, _, _ := newHot(t, 400, zap.NewNop(), f)
	h.faultPinDelay, h.pinDelay = 100*time.Millisecond, 100*time.Millisecond // before the first Admit
	for pg := range uint64(pinBatch - 1) {
		h.Admit([]PageKey{pk(pg)}, SignalFault)
		if h.Pinned(pk(0)) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no page pinned during a trickle of %d faults 20 ms apart with a 100 ms gathering delay: the delay restarts with each page", pinBatch-1)
}

// Pages queued while a batch is being pinned gather like any others: the
// worker waits for a batch (or its delay) before taking them, instead of
// pinning a lone page per round (the loop before the fix for lone-page
// batches, which only a timing-dependent test could see). Deterministic:
// the first batch is stalled in the pinner while a page is admitted, and
// the worker must next be seen gathering, not pinning.
func TestHotCacheGathersPagesQueuedDuringABatch(t *testing.T) {
	f := sparseFile(t, 512)
	h, p, _ := newHot(t, 400, zap.NewNop(), f)
	stalled, release := make(chan struct{}), make(chan struct{})
	pins := make(chan uint64, 16)
	populate := p.mlock
	first := true
	p.mlock = func(b []byte) error { // the worker's goroutine alone calls it
		pins <- uint64(len(b)) / PageSize
		if first {
			first = false
			close(stalled)
			<-release
		}
		return populate(b)
	}
	gathering := make(chan int, 16)
	h.gatherWaits = func(queued int) {
		select {
		case gathering <- queued:
		default:
		}
	}
	h.faultPinDelay, h.pinDelay = time.Hour, time.Millisecond // a hint's batch goes at once, faults' wait
	h.Admit([]PageKey{pk(0)}, SignalDecode)
	select {
	case <-stalled:
	case <-time.After(testDeadline):
		t.Fatal("the first batch was not pinned")
	}
	h.Admit([]PageKey{pk(100)}, SignalFault) // queued while the batch is stalled
	for len(gathering) > 0 {
		<-gathering // the first batch's own gathering
	}
	<-pins // the first batch's
	close(release)
	select {
	case queued := <-gathering:
		if queued != 1 {
			t.Fatalf("the worker gathers with %d pages queued, want the lone page", queued)
		}
	case n := <-pins:
		t.Fatalf("the page queued during a batch was pinned at once, alone (a run of %d), instead of gathering a batch", n)
	case <-time.After(testDeadline):
		t.Fatal("the worker neither gathered nor pinned after the stalled batch")
	}
	if h.Pinned(pk(100)) {
		t.Fatal("the lone page is pinned while the worker gathers")
	}
	flush(t, h)
	if !h.Pinned(pk(100)) {
		t.Fatal("the lone page is not pinned after Flush")
	}
}

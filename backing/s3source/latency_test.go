package s3source

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"
)

// feed adds n samples of d to class c at now.
func feed(l *latency, c, n int, d time.Duration, now time.Time) {
	for range n {
		l.add(c, d, now)
	}
}

func TestLatencyWarmupAndFloor(t *testing.T) {
	l := &latency{floor: 5 * time.Millisecond}
	now := time.Unix(1000, 0)
	feed(l, latencyQuiet, latencyWarmup-1, time.Millisecond, now)
	if d := l.delay(latencyQuiet); d != 0 {
		t.Fatalf("delay %v after %d samples, want 0 (no hedging yet)", d, latencyWarmup-1)
	}
	feed(l, latencyQuiet, 1, time.Millisecond, now)
	if d := l.delay(latencyQuiet); d != l.floor {
		t.Fatalf("delay %v for 1 ms GETs, want the floor %v", d, l.floor)
	}
}

// A lone GET is hedged after the p97 of lone GETs, not after that of the
// crowded GETs of a decode step, however many more of those there are; a
// 1% tail does not move the p97.
func TestLatencyClassesApart(t *testing.T) {
	l := &latency{floor: time.Millisecond}
	now := time.Unix(1000, 0)
	feed(l, latencyBusy, 2*latencyWindow, 60*time.Millisecond, now)
	if d := l.delay(latencyQuiet); d != 60*time.Millisecond {
		t.Errorf("quiet delay %v with no quiet samples, want the busy class's 60ms", d)
	}
	for i := range 200 {
		d := 21 * time.Millisecond
		if i%100 == 50 {
			d = 200 * time.Millisecond
		}
		l.add(latencyQuiet, d, now)
	}
	if d := l.delay(latencyQuiet); d != 21*time.Millisecond {
		t.Errorf("quiet delay %v, want 21ms", d)
	}
	if d := l.delay(latencyBusy); d != 60*time.Millisecond {
		t.Errorf("busy delay %v, want 60ms", d)
	}
	if latencyClass(1) != latencyQuiet || latencyClass(latencyQuietMax) != latencyQuiet || latencyClass(latencyQuietMax+1) != latencyBusy {
		t.Error("latencyClass: wrong classes")
	}
}

// An old phase ages out of the window: samples older than latencyAge count
// only while they are among the newest latencyWarmup.
func TestLatencyAgesOut(t *testing.T) {
	l := &latency{floor: time.Millisecond}
	t0 := time.Unix(1000, 0)
	feed(l, latencyQuiet, latencyWindow, 60*time.Millisecond, t0)
	// Young enough: the old phase still dominates the window.
	feed(l, latencyQuiet, latencyWarmup+8, 20*time.Millisecond, t0.Add(latencyAge/2))
	if d := l.delay(latencyQuiet); d != 60*time.Millisecond {
		t.Errorf("delay %v, want 60ms while the 60ms samples are young", d)
	}
	// Later, the same count of new samples is the whole window.
	l = &latency{floor: time.Millisecond}
	feed(l, latencyQuiet, latencyWindow, 60*time.Millisecond, t0)
	feed(l, latencyQuiet, latencyWarmup+8, 20*time.Millisecond, t0.Add(latencyAge+time.Second))
	if d := l.delay(latencyQuiet); d != 20*time.Millisecond {
		t.Errorf("delay %v, want 20ms once the 60ms samples are older than %v", d, latencyAge)
	}
	// Old samples still count when too few are young.
	l = &latency{floor: time.Millisecond}
	feed(l, latencyQuiet, latencyWindow, 60*time.Millisecond, t0)
	feed(l, latencyQuiet, latencyEvery, 20*time.Millisecond, t0.Add(latencyAge+time.Second))
	if d := l.delay(latencyQuiet); d != 60*time.Millisecond {
		t.Errorf("delay %v, want 60ms (only %d young samples)", d, latencyEvery)
	}
}

func TestHedgeBudget(t *testing.T) {
	var b hedgeBudget
	if b.spend() {
		t.Fatal("a hedge with no demand GET yet")
	}
	for range 100 {
		b.earn(5)
	}
	n := 0
	for b.spend() {
		n++
	}
	if n != 5 {
		t.Errorf("%d hedges for 100 GETs at 5%%, want 5", n)
	}
	// Credit saved over a long calm is capped.
	for range 100000 {
		b.earn(5)
	}
	n = 0
	for b.spend() {
		n++
	}
	if n != hedgeBurst {
		t.Errorf("%d hedges after 100000 GETs without any, want the burst of %d", n, hedgeBurst)
	}
	if g := b.gets.Load(); g != 100100 {
		t.Errorf("%d GETs counted, want 100100", g)
	}
}

// A crowd is counted each time the GETs in flight pass latencyQuietMax,
// so a GET that started alone sees a crowd that formed before its first
// byte.
func TestSlotsCountCrowds(t *testing.T) {
	s := newSlots(latencyQuietMax + 2)
	for i := 1; i <= latencyQuietMax; i++ {
		if n, ok := s.tryAcquire(); !ok || n != i {
			t.Fatalf("tryAcquire: %d in flight, %v; want %d", n, ok, i)
		}
	}
	if c := s.crowds.Load(); c != 0 {
		t.Fatalf("%d crowds with %d GETs in flight, want 0", c, latencyQuietMax)
	}
	if n, err := s.acquire(context.Background(), true); err != nil || latencyClass(n) != latencyBusy {
		t.Fatalf("acquire: %d in flight (%v), want a busy class", n, err)
	}
	s.tryAcquire()
	if c := s.crowds.Load(); c != 1 {
		t.Fatalf("%d crowds, want 1", c)
	}
	s.release()
	s.release()
	s.tryAcquire()
	if c := s.crowds.Load(); c != 2 {
		t.Fatalf("%d crowds after the GETs in flight fell to %d and grew again, want 2", c, latencyQuietMax)
	}
}

// A young window's one slow GET does not set the delay: the p97 of a few
// dozen samples is never the largest.
func TestLatencyFewSamplesIgnoreOneSlow(t *testing.T) {
	l := &latency{floor: time.Millisecond}
	now := time.Unix(1000, 0)
	l.add(latencyQuiet, 200*time.Millisecond, now)
	feed(l, latencyQuiet, 2*latencyEvery+3, 21*time.Millisecond, now) // recomputed at 2×latencyEvery samples
	if d := l.delay(latencyQuiet); d != 21*time.Millisecond {
		t.Errorf("delay %v after 1 slow GET and %d fast ones, want 21ms", d, 2*latencyEvery-1)
	}
}

// The delay is the p97 of the window, not the p95 nor the median: of 200
// samples of 1..200 ms the p97 is 195 ms (the p95 would be 191 ms).
func TestLatencyIsTheP97(t *testing.T) {
	l := &latency{floor: time.Millisecond}
	now := time.Unix(1000, 0)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, i := range rng.Perm(200) {
		l.add(latencyQuiet, time.Duration(i+1)*time.Millisecond, now)
	}
	if d := l.delay(latencyQuiet); d != 195*time.Millisecond {
		t.Errorf("delay %v for samples of 1..200 ms, want their p97, 195ms", d)
	}
}

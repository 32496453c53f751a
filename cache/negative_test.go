package cache

import (
	"errors"
	"testing"
	"time"
)

var errTest = errors.New("injected failure")

// The negative cache forgets its expired entries oldest first and stops at
// the first live one; an entry remembered again since keeps its new life.
func TestNegativeOrderExpires(t *testing.T) {
	t0 := time.Unix(1000, 0)
	m := map[PageKey]negativeHit{}
	var o negativeOrder
	remember := func(pg uint64, at time.Time) {
		until := at.Add(NegativeTTL)
		m[PageKey{Page: pg}] = negativeHit{until: until}
		o.push(PageKey{Page: pg}, until)
	}
	for pg := range uint64(100) {
		remember(pg, t0.Add(time.Duration(pg)*time.Millisecond))
	}
	remember(5, t0.Add(500*time.Millisecond)) // 5 again, later
	o.expire(m, t0.Add(NegativeTTL+49*time.Millisecond))
	if len(m) != 51 { // 50..99, and 5's second life
		t.Fatalf("%d entries left, want 51", len(m))
	}
	if _, ok := m[PageKey{Page: 5}]; !ok {
		t.Fatal("an entry remembered again was forgotten by its first life's expiry")
	}
	if _, ok := m[PageKey{Page: 49}]; ok {
		t.Fatal("an expired entry was kept")
	}
	if got := len(o.q) - o.head; got != 51 {
		t.Fatalf("%d entries queued, want 51: expire walked past the live ones", got)
	}
	o.expire(m, t0.Add(2*NegativeTTL))
	if len(m) != 0 || o.head != 0 || len(o.q) != 0 {
		t.Fatalf("%d entries and a queue of %d left after every entry expired", len(m), len(o.q)-o.head)
	}
}

// A failed page costs about the same whether the negative cache is empty or
// full of live entries: BenchmarkLoaderRememberFull against ...Empty. The
// scan that made room cost 0.9 ms a failure when full.
func BenchmarkLoaderRememberFull(b *testing.B) { benchRemember(b, maxNegative) }

// BenchmarkLoaderRememberEmpty is the baseline of BenchmarkLoaderRememberFull.
func BenchmarkLoaderRememberEmpty(b *testing.B) { benchRemember(b, 0) }

func benchRemember(b *testing.B, fill int) {
	l := NewLoader(nil, nil, nil)
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	l.mu.Lock()
	for pg := range uint64(fill) {
		l.remember(PageKey{Page: pg}, errTest)
	}
	l.mu.Unlock()
	b.ResetTimer()
	for i := range b.N {
		l.mu.Lock()
		if fill == 0 { // each entry expires before the next: the cache stays nearly empty
			now = now.Add(NegativeTTL)
		}
		l.remember(PageKey{Table: 1, Page: uint64(i)}, errTest)
		l.mu.Unlock()
	}
}

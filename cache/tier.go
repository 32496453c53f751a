package cache

import (
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Signal says why a page is being accessed; it decides how far the tier lets
// the page in.
type Signal uint8

const (
	// SignalDecode: a decode step names the page. Full admission.
	SignalDecode Signal = iota
	// SignalFault: a demand fault reached FUSE. Full admission.
	SignalFault
	// SignalPrefill: a prefill hint names the page. A prefill chunk streams
	// 10K-40K unique rows once, so it never promotes and never displaces a
	// protected page; a miss enters probation only if the ghost list
	// remembers the page (see admitPrefill for the measurement).
	SignalPrefill
)

// Changes is what one Tier.Access decided. An executor applies Unpin first,
// then Pin: after that the pinned set equals the tier's membership.
//
// Within one Access call a page admitted and evicted again appears in neither
// list, and a page evicted and admitted again usually appears in neither
// either (it stays pinned). Only when the ghost entry that records the eviction
// is itself pushed out within the same call can a page be in both lists; it is
// then in the tier, and "unpin, then pin" leaves it pinned.
type Changes struct {
	Pin, Unpin   []PageKey // pages newly admitted / evicted
	Hits, Misses int       // accessed pages found / not found in the tier
}

// Reset empties c, keeping its storage.
func (c *Changes) Reset() {
	c.Pin, c.Unpin = c.Pin[:0], c.Unpin[:0]
	c.Hits, c.Misses = 0, 0
}

// Tier is the hot-page policy: a byte-budgeted, scan-resistant segmented LRU
// (SLRU with a ghost list) over pages. It only decides; it pins nothing
// (HotCache executes its Changes).
//
//   - probation holds new pages; protected holds pages hit again while in
//     probation, or re-admitted from the ghost list; the ghost list remembers
//     (without data) the last pages evicted from probation.
//   - Every page in probation or protected counts toward the budget.
//     Protected may use at most 1-probationShare of it; its overflow is
//     demoted to the MRU end of probation, and evictions always come from
//     probation's LRU end. A one-pass scan therefore only churns probation.
//
// The tier is split into shards (a mutex and three segments each, capacity/N
// pages), keyed by a hash of the page, so concurrent FUSE readers and hint
// writers rarely meet on one lock. Every method is safe for concurrent use.
type Tier struct {
	shards       []shard
	shift        uint // shard index = mixed hash >> shift
	admitPrefill prefillAdmission
	calls        atomic.Uint64 // numbers Access calls, for stamps
}

// Tuning, measured with BenchmarkTierTuning and BenchmarkTierHitRatio
// (tier_bench_test.go; capacity 2% of 1M rows, 72-row Zipf(0.9) decode
// steps, a 20K-row prefill chunk every 50 steps; decode hit ratios, with
// prefill rows drawn uniformly / by popularity):
//   - probation's reserve 5% / 10% / 20% / 25% / 33% (12K steps): 0.539 /
//     0.537 / 0.532 / 0.529 / 0.523 and 0.548 / 0.547 / 0.543 / 0.542 /
//     0.538. The ghost list does the work of a long probation; 10% is the knee.
//   - ghost list none / 0.5x / 1x / 2x capacity (10% reserve): 0.524 / 0.535 /
//     0.537 / 0.534 and 0.523 / 0.546 / 0.547 / 0.540.
//   - prefill admission none / ghost-remembered only / all (3K steps): 0.497 /
//     0.496 / 0.420 and 0.494 / 0.514 / 0.512; with 20% of decode rows
//     repeating the last chunk, 0.443 / 0.473 / 0.450. Admitting every prefill
//     page floods probation: -8 points when chunks are unrelated to decode.
//     Admitting only pages the ghost list remembers (recently in the tier)
//     loses nothing there and keeps the gain when they are related.
const (
	maxShards         = 16
	minShardPages     = 512 // below this per shard, use fewer shards: tiny shards waste budget to rounding
	probationPermille = 100 // probation's reserved share of a shard
	ghostPermille     = 1000
	admitPrefill      = prefillGhost
)

// prefillAdmission is how far a prefill miss gets into the tier.
type prefillAdmission uint8

const (
	prefillNone  prefillAdmission = iota // not at all
	prefillGhost                         // into probation if the ghost list remembers it
	prefillAll                           // into probation
)

// tierOptions exist for the benchmarks that pick the constants above.
type tierOptions struct {
	shards            int // 0: by capacity
	probationPermille int
	ghostPermille     int
	admitPrefill      prefillAdmission
}

func defaultTierOptions() tierOptions {
	return tierOptions{probationPermille: probationPermille, ghostPermille: ghostPermille, admitPrefill: admitPrefill}
}

// shard is one independent SLRU. Its stamps let an Access call cancel its own
// pin of a page it then evicts (and its own unpin of a page it then re-admits)
// without searching its output.
type shard struct {
	mu           sync.Mutex
	capacity     int                            // pages; probation+protected never exceed it after a key is processed
	protectedMax int                            // capacity minus probation's reserved share
	probation    *simplelru.LRU[PageKey, stamp] // GUARDED_BY(mu)
	protected    *simplelru.LRU[PageKey, stamp] // GUARDED_BY(mu)
	ghost        *simplelru.LRU[PageKey, stamp] // GUARDED_BY(mu)
}

// stamp ties an entry to the Access call that last admitted it (idx: its
// index in that call's Changes.Pin, or -1) or, in the ghost list, that last
// evicted it (idx: its index in Changes.Unpin, or -1).
type stamp struct {
	call uint64
	idx  int32
}

// tombstone marks a cancelled slot in Changes until the call compacts it. No
// table has id 2^32-1.
var tombstone = PageKey{Table: ^uint32(0), Page: ^uint64(0)}

// NewTier returns a tier of capacityBytes (rounded down to whole pages). A
// capacity under one page disables it: every call is a cheap no-op.
func NewTier(capacityBytes int64) *Tier {
	return newTier(capacityBytes, defaultTierOptions())
}

func newTier(capacityBytes int64, o tierOptions) *Tier {
	pages := capacityBytes / PageSize
	t := &Tier{admitPrefill: o.admitPrefill}
	if pages <= 0 {
		return t
	}
	n := o.shards
	if n <= 0 {
		n = maxShards
		for n > 1 && pages/int64(n) < minShardPages {
			n /= 2
		}
	}
	if n&(n-1) != 0 || int64(n) > pages {
		n = 1
	}
	t.shift = uint(64 - bits.TrailingZeros(uint(n)))
	t.shards = make([]shard, n)
	for i := range t.shards {
		c := int(pages / int64(n))
		if int64(i) < pages%int64(n) {
			c++ // shard capacities sum to exactly the budget
		}
		t.shards[i].init(c, o)
	}
	return t
}

func (s *shard) init(capacity int, o tierOptions) {
	s.capacity = capacity
	reserve := max(1, (capacity*o.probationPermille+999)/1000)
	s.protectedMax = max(0, capacity-reserve)
	// The segments get one slot of slack: simplelru would otherwise evict
	// silently (it has no callback here) before evict() can report the page.
	s.probation, _ = simplelru.NewLRU[PageKey, stamp](capacity+1, nil)
	s.protected, _ = simplelru.NewLRU[PageKey, stamp](capacity+1, nil)
	s.ghost, _ = simplelru.NewLRU[PageKey, stamp](max(1, capacity*o.ghostPermille/1000), nil)
}

func (t *Tier) shardOf(k PageKey) *shard {
	h := (k.Page ^ uint64(k.Table)<<40) * 0x9e3779b97f4a7c15 // Fibonacci hashing: the top bits are well mixed
	return &t.shards[h>>t.shift]
}

// call is the state of one Access call.
type call struct {
	id           uint64
	out          *Changes
	pin0, unpin0 int // where this call's entries start in out
	tombs        int
}

func (c *call) pin(k PageKey) int32 {
	c.out.Pin = append(c.out.Pin, k)
	return int32(len(c.out.Pin) - 1)
}

func (c *call) unpin(k PageKey) int32 {
	c.out.Unpin = append(c.out.Unpin, k)
	return int32(len(c.out.Unpin) - 1)
}

func (c *call) compact() {
	if c.tombs == 0 {
		return
	}
	c.out.Pin = c.out.Pin[:c.pin0+copyLive(c.out.Pin[c.pin0:])]
	c.out.Unpin = c.out.Unpin[:c.unpin0+copyLive(c.out.Unpin[c.unpin0:])]
}

func copyLive(ks []PageKey) int {
	n := 0
	for _, k := range ks {
		if k != tombstone {
			ks[n] = k
			n++
		}
	}
	return n
}

// Access records an access to each page of keys (in order; a page named twice
// is a hit the second time) and appends to out the pages to pin and unpin.
// It does no I/O: it takes one shard lock per key, for well under a
// microsecond. LOCKS_EXCLUDED(every shard's mu).
func (t *Tier) Access(keys []PageKey, sig Signal, out *Changes) {
	if len(t.shards) == 0 || len(keys) == 0 {
		return
	}
	c := call{id: t.calls.Add(1), out: out, pin0: len(out.Pin), unpin0: len(out.Unpin)}
	for _, k := range keys {
		s := t.shardOf(k)
		s.mu.Lock()
		s.access(k, sig, t.admitPrefill, &c)
		s.mu.Unlock()
	}
	c.compact()
}

// access is one page. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *shard) access(k PageKey, sig Signal, admit prefillAdmission, c *call) {
	if sig == SignalPrefill {
		// Peek, not Get: a prefill chunk names a row once, which says nothing
		// about whether decode will want it again.
		if s.protected.Contains(k) || s.probation.Contains(k) {
			c.out.Hits++
			return
		}
		c.out.Misses++
		g, ghost := s.ghost.Peek(k)
		if admit == prefillAll || admit == prefillGhost && ghost {
			s.admit(k, false, g, ghost, c)
		}
		return
	}
	if _, ok := s.protected.Get(k); ok {
		c.out.Hits++
		return
	}
	if v, ok := s.probation.Peek(k); ok {
		c.out.Hits++
		s.probation.Remove(k)
		s.protected.Add(k, v)
		s.demote()
		return
	}
	c.out.Misses++
	g, ghost := s.ghost.Peek(k)
	s.admit(k, ghost, g, ghost, c)
}

// admit inserts a page that is in neither segment, then evicts to the budget.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *shard) admit(k PageKey, protect bool, g stamp, ghost bool, c *call) {
	st := stamp{call: c.id, idx: -1}
	if ghost && g.call == c.id && g.idx >= 0 {
		// Evicted earlier in this very call: cancel that unpin; the page
		// never stops being pinned.
		c.out.Unpin[g.idx] = tombstone
		c.tombs++
	} else {
		st.idx = c.pin(k)
	}
	if ghost {
		s.ghost.Remove(k)
	}
	if protect && s.protectedMax > 0 {
		s.protected.Add(k, st)
		s.demote()
	} else {
		s.probation.Add(k, st)
	}
	s.evict(c)
}

// demote moves protected's overflow to probation's MRU end (SLRU): a page
// that stops being hit gets one more probation lifetime before eviction.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *shard) demote() {
	for s.protected.Len() > s.protectedMax {
		k, v, _ := s.protected.RemoveOldest()
		s.probation.Add(k, v)
	}
}

// evict brings the shard back to its budget, from probation's LRU end.
// Protected is never above protectedMax < capacity, so probation is never
// empty here; the fallback only guards the arithmetic.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *shard) evict(c *call) {
	for s.probation.Len()+s.protected.Len() > s.capacity {
		k, v, ok := s.probation.RemoveOldest()
		if !ok {
			if k, v, ok = s.protected.RemoveOldest(); !ok {
				return
			}
		}
		g := stamp{call: c.id, idx: -1}
		if v.call == c.id && v.idx >= 0 {
			// Admitted earlier in this very call: cancel that pin.
			c.out.Pin[v.idx] = tombstone
			c.tombs++
		} else {
			g.idx = c.unpin(k)
		}
		s.ghost.Add(k, g)
	}
}

// Contains reports whether page k is in the tier (pinned, or about to be).
// LOCKS_EXCLUDED(shard mu)
func (t *Tier) Contains(k PageKey) bool {
	if len(t.shards) == 0 {
		return false
	}
	s := t.shardOf(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.probation.Contains(k) || s.protected.Contains(k)
}

// Len is the number of pages in the tier.
func (t *Tier) Len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += s.probation.Len() + s.protected.Len()
		s.mu.Unlock()
	}
	return n
}

// Capacity is the budget in pages (the sum of the shard budgets).
func (t *Tier) Capacity() int {
	n := 0
	for i := range t.shards {
		n += t.shards[i].capacity
	}
	return n
}

// Keys lists the pages in the tier, shard by shard, each shard hottest first
// (protected, then probation, MRU to LRU): the order to re-admit them in
// after a restart.
func (t *Tier) Keys() []PageKey {
	var ks []PageKey
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		ks = appendNewestFirst(ks, s.protected.Keys())
		ks = appendNewestFirst(ks, s.probation.Keys())
		s.mu.Unlock()
	}
	return ks
}

func appendNewestFirst(dst, oldestFirst []PageKey) []PageKey {
	for i := len(oldestFirst) - 1; i >= 0; i-- {
		dst = append(dst, oldestFirst[i])
	}
	return dst
}

// Remove drops page k from the tier without reporting an unpin: for a page
// whose pin failed or was never attempted. If an Access call that is still
// running had admitted k, its Changes.Pin still names k: an executor running
// Remove concurrently with Access must check Contains before pinning (HotCache
// does). LOCKS_EXCLUDED(shard mu)
func (t *Tier) Remove(k PageKey) {
	if len(t.shards) == 0 {
		return
	}
	s := t.shardOf(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.probation.Remove(k) {
		s.protected.Remove(k)
	}
}

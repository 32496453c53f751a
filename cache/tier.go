package cache

import (
	"slices"
	"sync"
	"sync/atomic"
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

// Changes is what one Tier.Access decided: the pages it admitted that were
// not in the tier before the call (Pin) and the pages it evicted that were
// (Unpin). A page admitted and evicted again within the call is in neither
// list, and so is one evicted and re-admitted. An executor applies both
// lists in any order if it reconciles each named page against Contains
// (HotCache does).
type Changes struct {
	Pin, Unpin   []PageKey // pages newly admitted / evicted
	Hits, Misses int       // accessed pages found / not found in the tier

	events []tierEvent // scratch of Access: admissions and evictions, in order
}

// tierEvent is one admission or eviction within an Access call.
type tierEvent struct {
	key   PageKey
	admit bool
}

// Reset empties c, keeping its storage.
func (c *Changes) Reset() {
	c.Pin, c.Unpin = c.Pin[:0], c.Unpin[:0]
	c.Hits, c.Misses = 0, 0
	c.events = c.events[:0]
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
// The policy was chosen by BenchmarkPolicy (policy_bench_test.go: ten traces,
// Zipf 0.8-1.0 decode, 10K-40K-row prefill chunks drawn uniformly or by
// popularity) against plain LRU, S3-FIFO (Yang et al., SOSP 2023, with
// prefill admitted into small, only from its ghost, or never) and SIEVE
// (Zhang et al., NSDI 2024, with and without prefill). With uniform chunks
// it is the best by 0.4-1.0 points (SIEVE without prefill) and 1.2-1.7
// (S3-FIFO without prefill); with popular chunks S3-FIFO is 1.2-1.7 points
// better, but that variant loses 7-12 points with uniform chunks. When 20% of
// decode rows repeat the last chunk, plain LRU (0.537) beats every candidate
// (S3-FIFO 0.481, an ARC-style adaptive chunk segment 0.478, this 0.473): it
// keeps the whole chunk, which costs the others their scan resistance.
//
// Memory: the segments are intrusive doubly linked lists over slot indexes
// and the index is an open-addressing table of slot indexes: no pointers, so
// the garbage collector never scans it, and ~25 bytes per tracked page
// (pinned or ghost; BenchmarkTierMemory), where the map-and-list SLRU took
// ~300.
//
// The tier is split into stripes (a mutex and three segments each), keyed by a
// hash of the page, so concurrent FUSE readers and hint writers rarely meet
// on one lock. The budget is the tier's, not each stripe's: a page is
// admitted only once it has a page of the budget, taken from the free budget
// or by evicting from its own stripe, so a working set that fits the budget is
// held whole however the hash spreads it (with a budget per stripe, 20,000
// pages in 20,064 lost 171 to the fullest stripes). A stripe's nominal share
// (capacity/N) sizes its protected segment, its ghost list and its slots; a
// stripe above its share gives up ghost slots. Every method is safe for
// concurrent use.
type Tier struct {
	stripes      []stripe
	shift        uint // stripe index = mixed hash >> shift
	admitPrefill prefillAdmission
	capacity     int64        // pages
	used         atomic.Int64 // pages in the tier; never above capacity
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
	maxStripes        = 16
	minStripePages    = 512 // below this per stripe, use fewer stripes: tiny stripes waste budget to rounding
	probationPermille = 100 // probation's reserved share of a stripe
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
	stripes           int // 0: by capacity
	probationPermille int
	ghostPermille     int
	admitPrefill      prefillAdmission
}

func defaultTierOptions() tierOptions {
	return tierOptions{probationPermille: probationPermille, ghostPermille: ghostPermille, admitPrefill: admitPrefill}
}

// Page keys are packed into 64 bits: table in the top keyTableBits, page in
// the rest (2^44 pages of 4 KiB = 64 PiB per table file). The tier ignores a
// page that does not fit (a miss that is never admitted).
const (
	keyTableBits = 20
	keyPageBits  = 64 - keyTableBits
)

func packKey(k PageKey) (uint64, bool) {
	if k.Table >= 1<<keyTableBits || k.Page >= 1<<keyPageBits {
		return 0, false
	}
	return uint64(k.Table)<<keyPageBits | k.Page, true
}

func unpackKey(p uint64) PageKey {
	return PageKey{Table: uint32(p >> keyPageBits), Page: p & (1<<keyPageBits - 1)}
}

// mix is a 64-bit finalizer (murmur3's fmix64): stripes use its top bits, each
// stripe's index its low bits.
func mix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// Segments. Slots 0-2 are the heads of the three circular lists (a slot's
// seg is the list it is on); a slot on no list is free.
const (
	segProbation uint8 = iota
	segProtected
	segGhost
	segFree
	nSegs = 3 // lists with a head slot
)

// stripe is one independent SLRU over slots. A slot is a tracked page: on
// probation, protected or the ghost list. All fields GUARDED_BY(mu).
type stripe struct {
	mu           sync.Mutex
	t            *Tier
	capacity     int    // pages: the stripe's nominal share of the budget
	protectedMax int    // capacity minus probation's reserved share
	ghostMax     int    // ghost list length
	n            [3]int // pages on each list

	key        []uint64 // packed page key of each slot
	prev, next []uint32 // list links
	seg        []uint8  // list of each slot
	free       uint32   // first free slot (linked through next); 0: none
	index      []uint32 // open addressing, linear probing: slot, or 0 for empty
	mask       uint64
}

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
	t.capacity = pages
	n := o.stripes
	if n <= 0 {
		n = maxStripes
		for n > 1 && pages/int64(n) < minStripePages {
			n /= 2
		}
	}
	if n&(n-1) != 0 || int64(n) > pages {
		n = 1
	}
	bits := uint(0)
	for 1<<bits < n {
		bits++
	}
	t.shift = 64 - bits
	t.stripes = make([]stripe, n)
	for i := range t.stripes {
		c := int(pages / int64(n))
		if int64(i) < pages%int64(n) {
			c++ // stripe capacities sum to exactly the budget
		}
		t.stripes[i].t = t
		t.stripes[i].init(c, o)
	}
	return t
}

func (s *stripe) init(capacity int, o tierOptions) {
	s.capacity = capacity
	reserve := max(1, (capacity*o.probationPermille+999)/1000)
	s.protectedMax = max(0, capacity-reserve)
	s.ghostMax = capacity * o.ghostPermille / 1000
	// One page over the budget and one over the ghost list's length exist
	// for a moment, between an admission and its eviction.
	slots := nSegs + capacity + s.ghostMax + 2
	s.key = make([]uint64, slots)
	s.prev = make([]uint32, slots)
	s.next = make([]uint32, slots)
	s.seg = make([]uint8, slots)
	for l := range uint32(nSegs) {
		s.prev[l], s.next[l], s.seg[l] = l, l, uint8(l)
	}
	for i := slots - 1; i >= nSegs; i-- {
		s.seg[i] = segFree
		s.next[i] = s.free
		s.free = uint32(i)
	}
	// Load factor at most 2/3: 1.5-3 index entries per slot.
	size := 1
	for size < (slots-nSegs)*3/2 {
		size <<= 1
	}
	s.index = make([]uint32, size)
	s.mask = uint64(size - 1)
}

func (t *Tier) stripeOf(key uint64) *stripe {
	if len(t.stripes) == 1 {
		return &t.stripes[0]
	}
	return &t.stripes[mix(key)>>t.shift]
}

// lookup returns the slot of key, or 0. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) lookup(key uint64) uint32 {
	for i := mix(key) & s.mask; ; i = (i + 1) & s.mask {
		sl := s.index[i]
		if sl == 0 || s.key[sl] == key {
			return sl
		}
	}
}

// indexAdd records slot sl (whose key is not indexed yet).
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) indexAdd(sl uint32) {
	i := mix(s.key[sl]) & s.mask
	for s.index[i] != 0 {
		i = (i + 1) & s.mask
	}
	s.index[i] = sl
}

// indexDel forgets slot sl, shifting later entries of its probe run back (no
// tombstones). EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) indexDel(sl uint32) {
	i := mix(s.key[sl]) & s.mask
	for s.index[i] != sl {
		i = (i + 1) & s.mask
	}
	for j := i; ; {
		j = (j + 1) & s.mask
		e := s.index[j]
		if e == 0 {
			break
		}
		home := mix(s.key[e]) & s.mask
		// Move e into the hole at i unless its home lies cyclically in (i, j].
		if (j-home)&s.mask >= (j-i)&s.mask {
			s.index[i] = e
			i = j
		}
	}
	s.index[i] = 0
}

// unlink takes slot sl off its list. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) unlink(sl uint32) {
	p, n := s.prev[sl], s.next[sl]
	s.next[p], s.prev[n] = n, p
	s.n[s.seg[sl]]--
}

// pushFront puts slot sl at the MRU end of list l. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) pushFront(l uint8, sl uint32) {
	h := uint32(l)
	n := s.next[h]
	s.prev[sl], s.next[sl] = h, n
	s.prev[n], s.next[h] = sl, sl
	s.seg[sl] = l
	s.n[l]++
}

// oldest is the LRU slot of list l, or 0 when it is empty.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) oldest(l uint8) uint32 {
	if p := s.prev[l]; p != uint32(l) {
		return p
	}
	return 0
}

// release frees slot sl (already unlinked). EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) release(sl uint32) {
	s.indexDel(sl)
	s.seg[sl] = segFree
	s.next[sl] = s.free
	s.free = sl
}

// Access records an access to each page of keys (in order; a page named twice
// is a hit the second time) and appends to out the pages to pin and unpin.
// It does no I/O: it takes one stripe lock per key, for well under a
// microsecond. LOCKS_EXCLUDED(every stripe's mu).
func (t *Tier) Access(keys []PageKey, sig Signal, out *Changes) {
	if len(t.stripes) == 0 || len(keys) == 0 {
		return
	}
	ev0 := len(out.events)
	for _, k := range keys {
		key, ok := packKey(k)
		if !ok {
			out.Misses++
			continue
		}
		s := t.stripeOf(key)
		s.mu.Lock()
		s.access(key, sig, t.admitPrefill, out)
		s.mu.Unlock()
	}
	// A page's first event says whether it was in the tier before the
	// call (it was if it was evicted first), its last whether it is now.
	ev := out.events[ev0:]
	slices.SortStableFunc(ev, func(a, b tierEvent) int { return comparePageKeys(a.key, b.key) })
	for i := 0; i < len(ev); {
		j := i + 1
		for j < len(ev) && ev[j].key == ev[i].key {
			j++
		}
		before, after := !ev[i].admit, ev[j-1].admit
		switch {
		case after && !before:
			out.Pin = append(out.Pin, ev[i].key)
		case before && !after:
			out.Unpin = append(out.Unpin, ev[i].key)
		}
		i = j
	}
	out.events = out.events[:ev0]
}

// access is one page. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) access(key uint64, sig Signal, admit prefillAdmission, out *Changes) {
	sl := s.lookup(key)
	seg := segFree
	if sl != 0 {
		seg = s.seg[sl]
	}
	if sig == SignalPrefill {
		// No LRU update: a prefill chunk names a row once, which says
		// nothing about whether decode will want it again.
		if seg == segProbation || seg == segProtected {
			out.Hits++
			return
		}
		out.Misses++
		if admit == prefillAll || admit == prefillGhost && seg == segGhost {
			s.admit(key, sl, false, out)
		}
		return
	}
	switch seg {
	case segProtected:
		out.Hits++
		s.unlink(sl)
		s.pushFront(segProtected, sl)
	case segProbation:
		out.Hits++
		s.unlink(sl)
		s.pushFront(segProtected, sl)
		s.demote()
	default:
		out.Misses++
		s.admit(key, sl, seg == segGhost, out)
	}
}

// admit inserts a page that is in neither segment (sl is its ghost slot, or
// 0). It first takes a page of the budget: a free one, or one evicted from
// this stripe; if this stripe holds none, the page is not admitted.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) admit(key uint64, sl uint32, protect bool, out *Changes) {
	if sl != 0 {
		s.unlink(sl) // off the ghost list (so the evictions below keep it)
	}
	for {
		u := s.t.used.Load()
		if u < s.t.capacity {
			if s.t.used.CompareAndSwap(u, u+1) {
				break
			}
			continue
		}
		if !s.evictOne(out) {
			if sl != 0 {
				s.release(sl)
			}
			return
		}
	}
	if sl == 0 {
		sl = s.alloc(out)
		s.key[sl] = key
		s.indexAdd(sl)
	}
	out.events = append(out.events, tierEvent{key: unpackKey(key), admit: true})
	if protect && s.protectedMax > 0 {
		s.pushFront(segProtected, sl)
		s.demote()
	} else {
		s.pushFront(segProbation, sl)
	}
}

// alloc returns a free slot: from the free list, else the ghost list's
// oldest, else (a stripe far above its share) a page evicted from the stripe,
// forgotten at once. EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) alloc(out *Changes) uint32 {
	if s.free == 0 {
		g := s.oldest(segGhost)
		if g == 0 {
			s.evictOne(out)
			g = s.oldest(segGhost)
		}
		if g == 0 {
			// Only with no ghost list at all: evictOne released its slot.
			if s.free == 0 {
				panic("cache: tier stripe has no slot to give") // slots > 2 + pages of the stripe
			}
		} else {
			s.unlink(g)
			s.release(g)
		}
	}
	sl := s.free
	s.free = s.next[sl]
	return sl
}

// demote moves protected's overflow to probation's MRU end (SLRU): a page
// that stops being hit gets one more probation lifetime before eviction.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) demote() {
	for s.n[segProtected] > s.protectedMax {
		sl := s.oldest(segProtected)
		s.unlink(sl)
		s.pushFront(segProbation, sl)
	}
}

// evictOne evicts the LRU page of probation (of protected if probation is
// empty) onto the ghost list; false if the stripe holds no page. Protected is
// never above protectedMax < capacity, so probation is rarely empty.
// EXCLUSIVE_LOCKS_REQUIRED(s.mu)
func (s *stripe) evictOne(out *Changes) bool {
	sl := s.oldest(segProbation)
	if sl == 0 {
		if sl = s.oldest(segProtected); sl == 0 {
			return false
		}
	}
	s.unlink(sl)
	s.t.used.Add(-1)
	out.events = append(out.events, tierEvent{key: unpackKey(s.key[sl])})
	if s.ghostMax == 0 {
		s.release(sl)
		return true
	}
	s.pushFront(segGhost, sl)
	if s.n[segGhost] > s.ghostMax {
		g := s.oldest(segGhost)
		s.unlink(g)
		s.release(g)
	}
	return true
}

// Contains reports whether page k is in the tier (pinned, or about to be).
// During an Access call that evicts k and admits it again, it may report
// false for a moment; an executor that acts on it must not run concurrently
// with Access (HotCache reads it under the mutex that its Access calls hold).
// LOCKS_EXCLUDED(stripe mu)
func (t *Tier) Contains(k PageKey) bool {
	key, ok := packKey(k)
	if len(t.stripes) == 0 || !ok {
		return false
	}
	s := t.stripeOf(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	sl := s.lookup(key)
	return sl != 0 && s.seg[sl] != segGhost
}

// segmentOf names the list page k is on ("none" if untracked), for tests.
func (t *Tier) segmentOf(k PageKey) string {
	key, ok := packKey(k)
	if len(t.stripes) == 0 || !ok {
		return "none"
	}
	s := t.stripeOf(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if sl := s.lookup(key); sl != 0 {
		return [...]string{"probation", "protected", "ghost"}[s.seg[sl]]
	}
	return "none"
}

// Len is the number of pages in the tier.
func (t *Tier) Len() int { return int(t.used.Load()) }

// Capacity is the budget in pages.
func (t *Tier) Capacity() int { return int(t.capacity) }

// Keys lists the pages in the tier, stripe by stripe, each stripe hottest first
// (protected, then probation, MRU to LRU): the order to re-admit them in
// after a restart.
func (t *Tier) Keys() []PageKey {
	var ks []PageKey
	for i := range t.stripes {
		ks = t.stripes[i].appendList(ks, segProtected)
		ks = t.stripes[i].appendList(ks, segProbation)
	}
	return ks
}

// appendList appends the pages of list l, MRU first. LOCKS_EXCLUDED(s.mu)
func (s *stripe) appendList(dst []PageKey, l uint8) []PageKey {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sl := s.next[l]; sl != uint32(l); sl = s.next[sl] {
		dst = append(dst, unpackKey(s.key[sl]))
	}
	return dst
}

// Remove drops page k from the tier without reporting an unpin (and without
// remembering it in the ghost list): for a page whose pin failed or was never
// attempted. LOCKS_EXCLUDED(stripe mu)
func (t *Tier) Remove(k PageKey) {
	key, ok := packKey(k)
	if len(t.stripes) == 0 || !ok {
		return
	}
	s := t.stripeOf(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if sl := s.lookup(key); sl != 0 && s.seg[sl] != segGhost {
		s.unlink(sl)
		s.release(sl)
		t.used.Add(-1)
	}
}

func comparePageKeys(a, b PageKey) int {
	switch {
	case a.Table != b.Table:
		if a.Table < b.Table {
			return -1
		}
		return 1
	case a.Page < b.Page:
		return -1
	case a.Page > b.Page:
		return 1
	}
	return 0
}

// ghostLen is the number of pages on the ghost lists.
func (t *Tier) ghostLen() int {
	n := 0
	for i := range t.stripes {
		s := &t.stripes[i]
		s.mu.Lock()
		n += s.n[segGhost]
		s.mu.Unlock()
	}
	return n
}

package cache

import "container/list"

// Reference policies for BenchmarkPolicy: simple, map-based models of each
// published policy, to compare hit ratios on the same traces (not used by
// the daemon; the Tier is the compact production form of the one kept).

// simPolicy is one cache policy over pages of one table.
type simPolicy interface {
	// access records an access and reports whether it was a hit.
	access(k uint64, sig Signal) bool
}

// simLRU is plain LRU: every access alike.
type simLRU struct {
	cap int
	l   *list.List
	m   map[uint64]*list.Element
}

func newSimLRU(capPages int) *simLRU {
	return &simLRU{cap: capPages, l: list.New(), m: map[uint64]*list.Element{}}
}

func (c *simLRU) access(k uint64, _ Signal) bool {
	if e, ok := c.m[k]; ok {
		c.l.MoveToFront(e)
		return true
	}
	c.m[k] = c.l.PushFront(k)
	if c.l.Len() > c.cap {
		delete(c.m, c.l.Remove(c.l.Back()).(uint64))
	}
	return false
}

// lruList is an LRU of keys with a bound, for the segments below.
type lruList struct {
	l *list.List
	m map[uint64]*list.Element
}

func newLRUList() *lruList { return &lruList{l: list.New(), m: map[uint64]*list.Element{}} }

func (s *lruList) has(k uint64) bool { _, ok := s.m[k]; return ok }
func (s *lruList) len() int          { return s.l.Len() }
func (s *lruList) push(k uint64)     { s.m[k] = s.l.PushFront(k) }
func (s *lruList) touch(k uint64)    { s.l.MoveToFront(s.m[k]) }
func (s *lruList) remove(k uint64) bool {
	e, ok := s.m[k]
	if ok {
		s.l.Remove(e)
		delete(s.m, k)
	}
	return ok
}
func (s *lruList) popOldest() uint64 {
	k := s.l.Remove(s.l.Back()).(uint64)
	delete(s.m, k)
	return k
}

// simSLRU is the tier before v2: probation / protected (at most 90%) /
// ghost (1x capacity); decode and faults promote from probation and admit
// ghost hits to protected; prefill never promotes and enters probation only
// when the ghost list remembers the page.
type simSLRU struct {
	cap, protMax, ghostMax int
	prob, prot, ghost      *lruList
}

func newSimSLRU(capPages int) *simSLRU {
	return &simSLRU{cap: capPages, protMax: capPages - max(1, capPages/10), ghostMax: capPages,
		prob: newLRUList(), prot: newLRUList(), ghost: newLRUList()}
}

func (c *simSLRU) access(k uint64, sig Signal) bool {
	if sig == SignalPrefill {
		if c.prot.has(k) || c.prob.has(k) {
			return true
		}
		if c.ghost.remove(k) {
			c.prob.push(k)
			c.evict()
		}
		return false
	}
	if c.prot.has(k) {
		c.prot.touch(k)
		return true
	}
	if c.prob.remove(k) {
		c.prot.push(k)
		c.demote()
		return true
	}
	if c.ghost.remove(k) {
		c.prot.push(k)
		c.demote()
	} else {
		c.prob.push(k)
	}
	c.evict()
	return false
}

func (c *simSLRU) demote() {
	for c.prot.len() > c.protMax {
		c.prob.push(c.prot.popOldest())
	}
}

func (c *simSLRU) evict() {
	for c.prob.len()+c.prot.len() > c.cap {
		c.ghost.push(c.prob.popOldest())
		if c.ghost.len() > c.ghostMax {
			c.ghost.popOldest()
		}
	}
}

// fifoQ is a FIFO of keys with membership.
type fifoQ struct {
	q    []uint64
	head int
	m    map[uint64]struct{}
}

func newFifoQ() *fifoQ { return &fifoQ{m: map[uint64]struct{}{}} }

func (f *fifoQ) len() int          { return len(f.q) - f.head }
func (f *fifoQ) has(k uint64) bool { _, ok := f.m[k]; return ok }
func (f *fifoQ) push(k uint64)     { f.q = append(f.q, k); f.m[k] = struct{}{} }
func (f *fifoQ) pop() uint64 {
	k := f.q[f.head]
	f.head++
	if f.head > 4096 && f.head*2 > len(f.q) {
		f.q = append(f.q[:0], f.q[f.head:]...)
		f.head = 0
	}
	delete(f.m, k)
	return k
}

// simS3FIFO is S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10%) that new
// pages enter, a main FIFO (90%) with 2-bit frequencies and reinsertion, a
// ghost FIFO of keys evicted from the small one (as many as main holds).
// prefill says how a prefill miss gets in: not at all, into main if the
// ghost remembers it, or into small; a prefill hit never counts as a use.
type simS3FIFO struct {
	cap, smallMax  int
	small, main, g *fifoQ
	freq           map[uint64]uint8
	prefill        prefillAdmission
}

func newSimS3FIFO(capPages int, prefill prefillAdmission) *simS3FIFO {
	return &simS3FIFO{cap: capPages, smallMax: max(1, capPages/10), small: newFifoQ(), main: newFifoQ(), g: newFifoQ(),
		freq: map[uint64]uint8{}, prefill: prefill}
}

func (c *simS3FIFO) access(k uint64, sig Signal) bool {
	if f, ok := c.freq[k]; ok {
		if sig != SignalPrefill {
			c.freq[k] = min(f+1, 3)
		}
		return true
	}
	ghost := c.g.has(k)
	if sig == SignalPrefill && (c.prefill == prefillNone || c.prefill == prefillGhost && !ghost) {
		return false
	}
	for c.small.len()+c.main.len() >= c.cap {
		c.evict()
	}
	if ghost {
		c.main.push(k)
	} else {
		c.small.push(k)
	}
	c.freq[k] = 0
	return false
}

func (c *simS3FIFO) evict() {
	if c.small.len() >= c.smallMax || c.main.len() == 0 {
		for c.small.len() > 0 {
			k := c.small.pop()
			if c.freq[k] > 1 {
				c.freq[k] = 0
				c.main.push(k)
				if c.main.len() > c.cap-c.smallMax {
					c.evictMain()
				}
				continue
			}
			delete(c.freq, k)
			c.g.push(k)
			if c.g.len() > c.cap-c.smallMax {
				c.g.pop()
			}
			return
		}
	}
	c.evictMain()
}

func (c *simS3FIFO) evictMain() {
	for c.main.len() > 0 {
		k := c.main.pop()
		if f := c.freq[k]; f > 0 {
			c.freq[k] = f - 1
			c.main.push(k)
			continue
		}
		delete(c.freq, k)
		return
	}
}

// simSIEVE is SIEVE (Zhang et al., NSDI 2024): one FIFO with a visited bit
// and a hand that sweeps from the oldest end, clearing visited bits and
// evicting the first unvisited page; new pages enter at the head unvisited.
// A prefill hit does not set the visited bit; prefillAdmit says whether a
// prefill miss is inserted.
type simSIEVE struct {
	cap          int
	l            *list.List // front = newest
	m            map[uint64]*list.Element
	visited      map[uint64]bool
	hand         *list.Element
	prefillAdmit bool
}

func newSimSIEVE(capPages int, prefillAdmit bool) *simSIEVE {
	return &simSIEVE{cap: capPages, l: list.New(), m: map[uint64]*list.Element{}, visited: map[uint64]bool{}, prefillAdmit: prefillAdmit}
}

func (c *simSIEVE) access(k uint64, sig Signal) bool {
	if _, ok := c.m[k]; ok {
		if sig != SignalPrefill {
			c.visited[k] = true
		}
		return true
	}
	if sig == SignalPrefill && !c.prefillAdmit {
		return false
	}
	if c.l.Len() >= c.cap {
		e := c.hand
		if e == nil {
			e = c.l.Back()
		}
		for c.visited[e.Value.(uint64)] {
			c.visited[e.Value.(uint64)] = false
			if e = e.Prev(); e == nil {
				e = c.l.Back()
			}
		}
		c.hand = e.Prev()
		v := c.l.Remove(e).(uint64)
		delete(c.m, v)
		delete(c.visited, v)
	}
	c.m[k] = c.l.PushFront(k)
	return false
}

// simChunkSLRU is the v1 SLRU plus an adaptive chunk segment for prefill
// pages (ARC's adaptation between recency and frequency, applied to "the
// latest prefill chunks" versus "decode's SLRU"): prefill misses enter a FIFO
// of target size p; pages pushed out of it unused go to a chunk ghost. A
// decode miss that the chunk ghost remembers grows p (a bigger chunk segment
// would have hit), one that the SLRU's ghost remembers shrinks it. A decode
// hit in the chunk segment moves the page to protected.
type simChunkSLRU struct {
	*simSLRU
	chunk, chunkGhost *fifoQ
	inChunk           map[uint64]bool // chunk membership (fifoQ entries go stale when promoted)
	p                 float64
	pMax              float64
}

func newSimChunkSLRU(capPages int) *simChunkSLRU {
	return &simChunkSLRU{simSLRU: newSimSLRU(capPages), chunk: newFifoQ(), chunkGhost: newFifoQ(),
		inChunk: map[uint64]bool{}, pMax: float64(capPages) * 0.9}
}

func (c *simChunkSLRU) size() int { return c.prob.len() + c.prot.len() + len(c.inChunk) }

func (c *simChunkSLRU) access(k uint64, sig Signal) bool {
	if sig == SignalPrefill {
		if c.prot.has(k) || c.prob.has(k) || c.inChunk[k] {
			return true
		}
		if c.ghost.remove(k) {
			c.prob.push(k)
			c.evictAll()
			return false
		}
		if c.p < 1 {
			c.toChunkGhost(k)
			return false
		}
		c.chunk.push(k)
		c.inChunk[k] = true
		c.evictAll()
		return false
	}
	if c.inChunk[k] {
		delete(c.inChunk, k)
		c.prot.push(k)
		c.demote()
		return true
	}
	if c.prot.has(k) {
		c.prot.touch(k)
		return true
	}
	if c.prob.remove(k) {
		c.prot.push(k)
		c.demote()
		return true
	}
	switch {
	case c.chunkGhost.has(k):
		c.p = min(c.pMax, c.p+chunkGrow*max(1, float64(c.ghost.len())/float64(max(1, c.chunkGhost.len()))))
		c.prob.push(k)
	case c.ghost.remove(k):
		c.p = max(0, c.p-max(1, float64(c.chunkGhost.len())/float64(max(1, c.ghost.len()))))
		c.prot.push(k)
		c.demote()
	default:
		c.prob.push(k)
	}
	c.evictAll()
	return false
}

func (c *simChunkSLRU) toChunkGhost(k uint64) {
	if c.chunkGhost.has(k) {
		return
	}
	c.chunkGhost.push(k)
	for c.chunkGhost.len() > c.cap {
		c.chunkGhost.pop()
	}
}

func (c *simChunkSLRU) evictAll() {
	for c.size() > c.cap {
		if len(c.inChunk) > 0 && (float64(len(c.inChunk)) > c.p || c.prob.len() == 0) {
			k := c.chunk.pop()
			if c.inChunk[k] {
				delete(c.inChunk, k)
				c.toChunkGhost(k)
			}
			continue
		}
		c.ghost.push(c.prob.popOldest())
		if c.ghost.len() > c.ghostMax {
			c.ghost.popOldest()
		}
	}
}

var chunkGrow = 8.0 // ARC's step of 1 never grew the chunk segment: 0.465 on repeat0.2

package cache

import (
	"math/bits"
	"sync/atomic"
)

// Seen records, a bit per file page of every table, the pages this daemon
// may have put in the page cache of its mount: those a FUSE read was
// answered for and those it stored (NOTIFY_STORE). A mount's inodes start
// with an empty page cache, and every page of a table file gets there
// through one of the two, so a page whose bit is clear is not cached: a
// residency lookup (mincore, a system call a window) can be skipped for
// it. A set bit says only "may be": the kernel evicts without telling.
//
// Decode and prefill hints look residency up before they fetch
// (prefetch's skipPresent); in the serving loop the pages they go on to
// fetch are the ones never served (a prefill's tail, a decode step's
// cold rows), and each cost a mincore call that could only say no.
//
// A daemon that took a live mount over did not see what its predecessor
// served: Unknown makes every page "may be" for the rest of its life.
type Seen struct {
	pages   []uint64 // per table, its file's pages
	tables  []atomic.Pointer[[]atomic.Uint64]
	unknown atomic.Bool
}

// NewSeen tracks tables whose files have pages[t] pages each.
func NewSeen(pages []uint64) *Seen {
	return &Seen{pages: pages, tables: make([]atomic.Pointer[[]atomic.Uint64], len(pages))}
}

// SetUnknown makes every page "may be cached" from now on.
func (s *Seen) SetUnknown() { s.unknown.Store(true) }

// Mark records pages [first, first+n) of table as possibly cached.
func (s *Seen) Mark(table uint32, first, n uint64) {
	if s == nil || int(table) >= len(s.tables) {
		return
	}
	words := s.tables[table].Load()
	if words == nil {
		fresh := make([]atomic.Uint64, (s.pages[table]+63)/64)
		if s.tables[table].CompareAndSwap(nil, &fresh) {
			words = &fresh
		} else {
			words = s.tables[table].Load()
		}
	}
	end := min(first+n, s.pages[table])
	for pg := first; pg < end; {
		w := pg / 64
		bit := pg % 64
		span := min(64-bit, end-pg)
		mask := ^uint64(0) >> (64 - span) << bit
		if (*words)[w].Load()&mask != mask {
			(*words)[w].Or(mask)
		}
		pg += span
	}
}

// Any reports whether any page of [first, first+n) of table may be in the
// page cache: false only when none was ever served or stored.
func (s *Seen) Any(table uint32, first, n uint64) bool {
	if s == nil || s.unknown.Load() || int(table) >= len(s.tables) {
		return true
	}
	words := s.tables[table].Load()
	if words == nil {
		return false
	}
	end := min(first+n, s.pages[table])
	for pg := first; pg < end; {
		w := pg / 64
		bit := pg % 64
		span := min(64-bit, end-pg)
		mask := ^uint64(0) >> (64 - span) << bit
		if (*words)[w].Load()&mask != 0 {
			return true
		}
		pg += span
	}
	return false
}

// Count is how many pages of [first, first+n) of table were ever served or
// stored; 0 once Unknown, when it cannot be known.
func (s *Seen) Count(table uint32, first, n uint64) uint64 {
	if s == nil || s.unknown.Load() || int(table) >= len(s.tables) {
		return 0
	}
	words := s.tables[table].Load()
	if words == nil {
		return 0
	}
	var c uint64
	end := min(first+n, s.pages[table])
	for pg := first; pg < end; {
		w := pg / 64
		bit := pg % 64
		span := min(64-bit, end-pg)
		mask := ^uint64(0) >> (64 - span) << bit
		c += uint64(bits.OnesCount64((*words)[w].Load() & mask))
		pg += span
	}
	return c
}

// SetSeen has ResidentRun answer "not cached" without a system call for a
// run none of whose pages s has seen. Call it before the pinner is used.
func (p *Pinner) SetSeen(s *Seen) { p.seen = s }

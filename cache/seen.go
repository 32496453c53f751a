package cache

import (
	"encoding/binary"
	"errors"
	"fmt"
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

// seenMagic starts an encoded Seen (Encode): the format's name and version.
const seenMagic = "engramfs-seen-1\n"

// Encode is the bits set so far, for a daemon that takes the mount over
// (Restore): the magic, then for each table that has a bit set its ID,
// its page count and its words, little-endian. nil when unknown (there
// is nothing true to pass on).
func (s *Seen) Encode() []byte {
	if s == nil || s.unknown.Load() {
		return nil
	}
	out := []byte(seenMagic)
	for t := range s.tables {
		words := s.tables[t].Load()
		if words == nil {
			continue
		}
		out = binary.LittleEndian.AppendUint32(out, uint32(t))
		out = binary.LittleEndian.AppendUint64(out, s.pages[t])
		for i := range *words {
			out = binary.LittleEndian.AppendUint64(out, (*words)[i].Load())
		}
	}
	return out
}

// Restore adds the bits of b (a predecessor's Encode for the same model)
// to s and makes s known again: pages neither marked are known uncached.
// A b that does not fit s (another model, a table of another size, a
// truncated or foreign encoding) changes nothing and is an error; s stays
// as it was (unknown, after a takeover).
func (s *Seen) Restore(b []byte) error {
	if len(b) < len(seenMagic) || string(b[:len(seenMagic)]) != seenMagic {
		return errors.New("seen pages: not an encoding this daemon knows")
	}
	type table struct {
		id    uint32
		words []byte
	}
	var tables []table
	for rest := b[len(seenMagic):]; len(rest) > 0; {
		if len(rest) < 12 {
			return errors.New("seen pages: truncated")
		}
		id, pages := binary.LittleEndian.Uint32(rest), binary.LittleEndian.Uint64(rest[4:])
		if int(id) >= len(s.pages) || pages != s.pages[id] {
			return fmt.Errorf("seen pages: table %d of %d pages is not this model's", id, pages)
		}
		n := (pages + 63) / 64 * 8
		if uint64(len(rest)-12) < n {
			return errors.New("seen pages: truncated")
		}
		tables = append(tables, table{id, rest[12 : 12+n]})
		rest = rest[12+n:]
	}
	for _, t := range tables {
		for i := uint64(0); i < uint64(len(t.words))/8; i++ {
			if w := binary.LittleEndian.Uint64(t.words[8*i:]); w != 0 {
				s.orWord(t.id, i, w)
			}
		}
	}
	s.unknown.Store(false)
	return nil
}

// orWord sets the bits w in word i of table's bitmap.
func (s *Seen) orWord(table uint32, i, w uint64) { (*s.bitmap(table))[i].Or(w) }

// bitmap is table's words, made on first use.
func (s *Seen) bitmap(table uint32) *[]atomic.Uint64 {
	if words := s.tables[table].Load(); words != nil {
		return words
	}
	fresh := make([]atomic.Uint64, (s.pages[table]+63)/64)
	if s.tables[table].CompareAndSwap(nil, &fresh) {
		return &fresh
	}
	return s.tables[table].Load()
}

// Mark records pages [first, first+n) of table as possibly cached.
func (s *Seen) Mark(table uint32, first, n uint64) {
	if s == nil || int(table) >= len(s.tables) {
		return
	}
	words := s.bitmap(table)
	forWords(*words, first, min(first+n, s.pages[table]), func(w *atomic.Uint64, mask uint64) bool {
		if w.Load()&mask != mask {
			w.Or(mask)
		}
		return true
	})
}

// forWords calls f with each word of words that holds pages [first, end)
// and the mask of those pages in it, until f returns false.
func forWords(words []atomic.Uint64, first, end uint64, f func(w *atomic.Uint64, mask uint64) bool) {
	for pg := first; pg < end; {
		bit := pg % 64
		span := min(64-bit, end-pg)
		if !f(&words[pg/64], ^uint64(0)>>(64-span)<<bit) {
			return
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
	found := false
	forWords(*words, first, min(first+n, s.pages[table]), func(w *atomic.Uint64, mask uint64) bool {
		found = w.Load()&mask != 0
		return !found
	})
	return found
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
	forWords(*words, first, min(first+n, s.pages[table]), func(w *atomic.Uint64, mask uint64) bool {
		c += uint64(bits.OnesCount64(w.Load() & mask))
		return true
	})
	return c
}

// SetSeen has ResidentRun answer "not cached" without a system call for a
// run none of whose pages s has seen. Call it before the pinner is used.
func (p *Pinner) SetSeen(s *Seen) { p.seen = s }

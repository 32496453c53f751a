package cache

import "testing"

func TestSeenMarksExactlyThePagesServed(t *testing.T) {
	s := NewSeen([]uint64{300, 10})
	if s.Any(0, 0, 300) || s.Any(1, 0, 10) {
		t.Fatal("a table nothing was served of has pages that may be cached")
	}
	s.Mark(0, 60, 10) // crosses a word
	s.Mark(0, 299, 5) // clipped at the file's end
	for _, c := range []struct {
		first, n uint64
		want     bool
	}{
		{0, 60, false}, {59, 1, false}, {60, 1, true}, {69, 1, true}, {70, 1, false},
		{0, 61, true}, {69, 100, true}, {70, 229, false}, {299, 1, true}, {298, 1, false},
		{128, 64, false},
	} {
		if got := s.Any(0, c.first, c.n); got != c.want {
			t.Errorf("Any(0, %d, %d) = %v, want %v", c.first, c.n, got, c.want)
		}
	}
	if s.Any(1, 0, 10) {
		t.Error("a mark on table 0 shows on table 1")
	}
	for _, c := range []struct{ first, n, want uint64 }{
		{0, 300, 11}, {0, 60, 0}, {55, 10, 5}, {64, 100, 6}, {299, 9, 1}, {128, 64, 0},
	} {
		if got := s.Count(0, c.first, c.n); got != c.want {
			t.Errorf("Count(0, %d, %d) = %d, want %d", c.first, c.n, got, c.want)
		}
	}
	if s.Count(1, 0, 10) != 0 || s.Count(7, 0, 1) != 0 {
		t.Error("Count of a table nothing was served of must be 0")
	}
	if s.Any(7, 0, 1) != true {
		t.Error("an unknown table must answer \"may be\"")
	}
	s.SetUnknown()
	if !s.Any(1, 0, 10) {
		t.Error("after SetUnknown every page may be cached")
	}
	if s.Count(0, 0, 300) != 0 {
		t.Error("after SetUnknown no page is known to have been served")
	}
	var none *Seen
	none.Mark(0, 0, 1)
	if !none.Any(0, 0, 1) {
		t.Error("no record must answer \"may be\"")
	}
}

// A successor given its predecessor's Encode knows what it knows: the
// same pages may be cached, the others are known not to be; an encoding
// of another model is refused and leaves the successor unknown.
func TestSeenEncodeRestore(t *testing.T) {
	old := NewSeen([]uint64{300, 10, 5000})
	old.Mark(0, 60, 10)
	old.Mark(2, 4999, 1)
	b := old.Encode()

	next := NewSeen([]uint64{300, 10, 5000})
	next.SetUnknown()
	next.Mark(1, 3, 1) // served by the successor before the state arrived
	if err := next.Restore(b); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		table       uint32
		first, n    uint64
		want        bool
		description string
	}{
		{0, 60, 10, true, "the predecessor's pages"}, {0, 0, 60, false, "pages nobody served"},
		{2, 4999, 1, true, "the last page of a table"}, {2, 0, 4999, false, "the rest of it"},
		{1, 3, 1, true, "a page the successor served itself"}, {1, 0, 3, false, "its neighbours"},
	} {
		if got := next.Any(c.table, c.first, c.n); got != c.want {
			t.Errorf("%s: Any(%d, %d, %d) = %v, want %v", c.description, c.table, c.first, c.n, got, c.want)
		}
	}
	if next.Count(0, 0, 300) != 10 {
		t.Errorf("Count after Restore = %d, want 10", next.Count(0, 0, 300))
	}

	for name, bad := range map[string][]byte{
		"another model": seenMarked([]uint64{300, 11, 5000}).Encode(),
		"truncated":     b[:len(b)-1],
		"foreign":       []byte("not an encoding"),
	} {
		s := NewSeen([]uint64{300, 10, 5000})
		s.SetUnknown()
		if err := s.Restore(bad); err == nil {
			t.Errorf("%s: restored", name)
		}
		if !s.Any(0, 0, 1) {
			t.Errorf("%s: a refused restore made the successor known", name)
		}
	}
	unknown := NewSeen([]uint64{1})
	unknown.SetUnknown()
	if unknown.Encode() != nil {
		t.Error("an unknown Seen encoded bits it cannot vouch for")
	}
}

// seenMarked is a Seen of tables of pages with page 0 of each marked.
func seenMarked(pages []uint64) *Seen {
	s := NewSeen(pages)
	for t := range pages {
		s.Mark(uint32(t), 0, 1)
	}
	return s
}

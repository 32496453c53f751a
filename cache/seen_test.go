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

package hints

import "reflect"

// Status is the answer of the read barrier: read(2) on a control handle
// blocks until every frame accepted on that handle before the read has
// settled, then returns this as one line of JSON. The counts are of pages
// since the previous barrier on the handle; a page that the handle names
// again while it is still pending counts once. Once everything named has
// settled, Pages = Resident + Pinned + Dropped + Failed.
type Status struct {
	Frames   uint64 `json:"frames"`   // frames completed
	Pages    uint64 `json:"pages"`    // pages named (every table of the layers)
	Resident uint64 `json:"resident"` // fetched and in the page cache when the barrier returned
	Pinned   uint64 `json:"pinned"`   // in the pinned hot tier already: nothing to fetch
	Dropped  uint64 `json:"dropped"`  // prefill pages dropped from a full queue (never decode)
	Failed   uint64 `json:"failed"`   // the backing read or the page cache store failed

	// Cached is the part of Resident that was in the page cache already
	// when the hint came (not pinned, not read or stored again).
	Cached uint64 `json:"cached"`

	// Error says what went wrong since the previous barrier, absent when
	// nothing did: the reason of the handle's last rejected frame (its write
	// failed with EINVAL, which carries no text), then "pages failed: " and
	// the first failed page's reason, joined by "; ". It may be cut short
	// (ending in "...") to fit the reader's buffer.
	Error string `json:"error,omitempty"`
}

// Add adds o's counts to s (every count, those added to Status later too)
// and keeps s's Error, or takes o's when s has none.
func (s *Status) Add(o Status) {
	sv, ov := reflect.ValueOf(s).Elem(), reflect.ValueOf(o)
	for i := range sv.NumField() {
		if f := sv.Field(i); f.Kind() == reflect.Uint64 {
			f.SetUint(f.Uint() + ov.Field(i).Uint())
		}
	}
	if s.Error == "" {
		s.Error = o.Error
	}
}

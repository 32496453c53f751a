package hints

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
}

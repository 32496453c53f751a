package cache

import "time"

// negativeOrder is the loader's negative cache in the order its entries were
// remembered. Every entry lives NegativeTTL, so they expire in that order:
// forgetting the expired ones is a walk of the oldest few, where a scan of
// the whole map at every failure once it was full cost 65,536 entries under
// the loader's lock (0.9 ms a failed page).
type negativeOrder struct {
	q    []negativeEntry
	head int
}

type negativeEntry struct {
	k     PageKey
	until time.Time
}

// push records that k was remembered until until (the newest entry).
func (o *negativeOrder) push(k PageKey, until time.Time) {
	// Reclaim the consumed prefix once it is half the slice.
	if o.head > 64 && o.head*2 >= len(o.q) {
		o.q = append(o.q[:0], o.q[o.head:]...)
		o.head = 0
	}
	o.q = append(o.q, negativeEntry{k, until})
}

// expire deletes from m the entries expired at now, oldest first, and stops
// at the first that has not. An entry of m remembered again since (a later
// until) or deleted already is not its queue entry's to delete.
func (o *negativeOrder) expire(m map[PageKey]negativeHit, now time.Time) {
	for o.head < len(o.q) && !now.Before(o.q[o.head].until) {
		e := o.q[o.head]
		if hit, ok := m[e.k]; ok && hit.until.Equal(e.until) {
			delete(m, e.k)
		}
		o.q[o.head] = negativeEntry{}
		o.head++
	}
	if o.head == len(o.q) {
		o.q, o.head = o.q[:0], 0
	}
}

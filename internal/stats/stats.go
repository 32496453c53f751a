// Package stats holds every counter engramfs exposes, in one place.
//
// The JSON names below are the contract of `.engramfs/stats` (design.md); later
// features add fields, they never rename one. Counters are atomics so the hot
// paths (a FUSE read, a backing read) pay one uncontended add and no lock.
package stats

import (
	"encoding/json"
	"runtime"
	"sync/atomic"
)

// Counters is shared by every package of one mount. The zero value is ready.
type Counters struct {
	// Fault path (fs).
	FuseReads     atomic.Uint64 // READ requests on table files that reached FUSE
	FuseReadBytes atomic.Uint64 // bytes returned by those requests

	// Backing store (backing).
	BackingReads  atomic.Uint64 // pread calls on shard files (one per coalesced run)
	BackingBytes  atomic.Uint64 // bytes asked of the shard files (the aligned superset under O_DIRECT)
	BackingErrors atomic.Uint64 // runs that failed (I/O error, short read, shard changed)

	// Hot tier (cache).
	CacheCapacityBytes atomic.Int64  // --cache-size
	CacheUsedBytes     atomic.Int64  // bytes pinned right now
	CacheHits          atomic.Uint64 // hinted or faulted pages found pinned
	CacheMisses        atomic.Uint64 // hinted or faulted pages not pinned
	CacheEvictions     atomic.Uint64 // pages unpinned to stay within the budget
	CachePinned        atomic.Bool   // false when mlock is unavailable (tier runs unpinned)

	// Hints (hints, fs).
	HintFrames   atomic.Uint64 // frames accepted
	HintRows     atomic.Uint64 // rows named by accepted frames
	HintRejected atomic.Uint64 // frames refused with EINVAL

	// Prefetch (prefetch).
	PrefetchPagesQueued  atomic.Uint64 // pages put on a queue
	PrefetchPagesStored  atomic.Uint64 // pages pushed into the page cache (NOTIFY_STORE)
	PrefetchPagesDropped atomic.Uint64 // prefill pages dropped because the queue was full
	PrefetchStoreErrors  atomic.Uint64 // stores that failed (ENOENT included: inode not yet looked up)
	PrefetchLate         atomic.Uint64 // FUSE reads of a page whose prefetch was queued or in flight
}

// Snapshot is the JSON form of Counters, as served by `.engramfs/stats`.
type Snapshot struct {
	FuseReads     uint64 `json:"fuse_reads"`
	FuseReadBytes uint64 `json:"fuse_read_bytes"`

	BackingReads  uint64 `json:"backing_reads"`
	BackingBytes  uint64 `json:"backing_bytes"`
	BackingErrors uint64 `json:"backing_errors"`

	CacheCapacityBytes int64  `json:"cache_capacity_bytes"`
	CacheUsedBytes     int64  `json:"cache_used_bytes"`
	CacheHits          uint64 `json:"cache_hits"`
	CacheMisses        uint64 `json:"cache_misses"`
	CacheEvictions     uint64 `json:"cache_evictions"`
	CachePinned        bool   `json:"cache_pinned"`

	HintFrames   uint64 `json:"hint_frames"`
	HintRows     uint64 `json:"hint_rows"`
	HintRejected uint64 `json:"hint_rejected"`

	PrefetchPagesQueued  uint64 `json:"prefetch_pages_queued"`
	PrefetchPagesStored  uint64 `json:"prefetch_pages_stored"`
	PrefetchPagesDropped uint64 `json:"prefetch_pages_dropped"`
	PrefetchStoreErrors  uint64 `json:"prefetch_store_errors"`
	PrefetchLate         uint64 `json:"prefetch_late"`

	// Goroutines is the daemon's goroutine count when the snapshot was
	// taken: a leak shows up as a count that does not come back down.
	Goroutines int `json:"goroutines"`
}

// Snapshot reads every counter once. Counters are read one by one, so a
// snapshot taken under load is not a single instant; each value is exact.
func (c *Counters) Snapshot() Snapshot {
	return Snapshot{
		FuseReads:     c.FuseReads.Load(),
		FuseReadBytes: c.FuseReadBytes.Load(),

		BackingReads:  c.BackingReads.Load(),
		BackingBytes:  c.BackingBytes.Load(),
		BackingErrors: c.BackingErrors.Load(),

		CacheCapacityBytes: c.CacheCapacityBytes.Load(),
		CacheUsedBytes:     c.CacheUsedBytes.Load(),
		CacheHits:          c.CacheHits.Load(),
		CacheMisses:        c.CacheMisses.Load(),
		CacheEvictions:     c.CacheEvictions.Load(),
		CachePinned:        c.CachePinned.Load(),

		HintFrames:   c.HintFrames.Load(),
		HintRows:     c.HintRows.Load(),
		HintRejected: c.HintRejected.Load(),

		PrefetchPagesQueued:  c.PrefetchPagesQueued.Load(),
		PrefetchPagesStored:  c.PrefetchPagesStored.Load(),
		PrefetchPagesDropped: c.PrefetchPagesDropped.Load(),
		PrefetchStoreErrors:  c.PrefetchStoreErrors.Load(),
		PrefetchLate:         c.PrefetchLate.Load(),

		Goroutines: runtime.NumGoroutine(),
	}
}

// JSON renders a snapshot as one indented JSON object and a newline.
func (c *Counters) JSON() []byte {
	b, _ := json.MarshalIndent(c.Snapshot(), "", "  ") // a struct of numbers cannot fail to marshal
	return append(b, '\n')
}

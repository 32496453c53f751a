// Package stats holds every counter engramfs exposes, in one place.
//
// The JSON names below are the contract of `.engramfs/stats` (docs/design.md,
// "Stats"); later features add fields, they never rename one. What each
// field means is described once, in Fields (fields.go). Counters are atomics so the hot
// paths (a FUSE read, a backing read) pay one uncontended add and no lock.
package stats

import (
	"encoding/json"
	"os"
	"runtime"
	"sync/atomic"
	"time"
)

// Counters is shared by every package of one mount. The zero value is ready.
// What each counter means, its kind and unit are in Fields (fields.go), the
// one description of every stat; here they are grouped by the part of the
// daemon they measure.
type Counters struct {
	// Fault path (fs).
	FuseReads     atomic.Uint64
	FuseReadBytes atomic.Uint64
	// fuseTransport is set when the mount comes up (SetFuseTransport).
	fuseTransport atomic.Pointer[string]

	// Backing store (backing; the loader's negative cache).
	BackingReads    atomic.Uint64
	BackingBytes    atomic.Uint64
	BackingErrors   atomic.Uint64
	BackingFailFast atomic.Uint64
	BackingAgain    atomic.Uint64
	// Object store source and its local SSD mirror (backing/s3source).
	S3Gets             atomic.Uint64
	S3GetBytes         atomic.Uint64
	S3Retries          atomic.Uint64
	S3Hedges           atomic.Uint64
	S3ETagFailures     atomic.Uint64
	MirrorHits         atomic.Uint64
	MirrorBytesRead    atomic.Uint64
	MirrorBytesWritten atomic.Uint64
	MirrorEvictions    atomic.Uint64
	S3FillGets         atomic.Uint64
	S3FillBytes        atomic.Uint64
	S3FillPreempted    atomic.Uint64

	MirrorChecksumFailures atomic.Uint64
	MirrorWriteErrors      atomic.Uint64
	MirrorBudgetBytes      atomic.Int64 // the mirror's budget in force
	// ReadEngine is set once, before the counters are shared.
	ReadEngine string

	// Hot tier (cache).
	CacheCapacityBytes atomic.Int64
	CacheUsedBytes     atomic.Int64
	CacheHits          atomic.Uint64
	CacheMisses        atomic.Uint64
	CacheEvictions     atomic.Uint64
	CachePinned        atomic.Bool
	CachePinDropped    atomic.Uint64

	// Memory cgroups (cmd/engramfs limits, cache charge).
	MemcgLimitBytes     atomic.Int64 // the daemon's own group's limit, read at start
	CacheRequestedBytes atomic.Int64 // --cache-size, before fitting it to that limit
	CachePagesRecharged atomic.Uint64
	CachePinForeign     atomic.Uint64

	// Hints (fs).
	HintFrames   atomic.Uint64
	HintRows     atomic.Uint64
	HintRejected atomic.Uint64
	HintRefused  atomic.Uint64
	HintSteps    atomic.Uint64

	// Control-file handles (fs); ControlHandles is a level.
	ControlHandles        atomic.Int64
	ControlHandlesRefused atomic.Uint64

	// Prefetch (prefetch).
	PrefetchPagesQueued  atomic.Uint64
	PrefetchPagesStored  atomic.Uint64
	PrefetchPagesCached  atomic.Uint64
	PrefetchPagesDropped atomic.Uint64
	PrefetchStoreErrors  atomic.Uint64
	PrefetchLate         atomic.Uint64
	PrefetchLateServed   atomic.Uint64
	PrefetchPagesFailed  atomic.Uint64

	PrefetchPagesReleased atomic.Uint64
	// Prefetch in the serving loop (prefetch): decode hints that found
	// their pages cached, pushes evicted before their reader came.
	PrefetchDecodePagesCached atomic.Uint64
	PrefetchPushedEvicted     atomic.Uint64
	PrefetchPagesThrottled    atomic.Uint64
	// Residency lookups of hints (prefetch's skipPresent): the mincore
	// calls, and those cache.Seen answered without one.
	PrefetchResidencyLookups atomic.Uint64
	PrefetchResidencySkipped atomic.Uint64

	// Warm restart (warm).
	WarmPagesTotal atomic.Uint64
	WarmPagesDone  atomic.Uint64

	// layers is the hint accuracy of each engram layer; read-only after
	// SetLayers, so lookups take no lock.
	layers map[int]*LayerCounters

	// Timings receives service times for the histograms of --metrics-addr.
	// Nil when metrics are off: the hot paths then pay one nil check and no
	// clock read. Set it before the counters are shared, never after.
	Timings Timings
}

// LayerCounters is how well the hints of one layer worked (Fields says
// what each means).
type LayerCounters struct {
	Pushed    atomic.Uint64
	Refaulted atomic.Uint64
	Dropped   atomic.Uint64
}

// SetLayers creates the per-layer counters. Call it once, before the
// counters are shared.
func (c *Counters) SetLayers(layers []int) {
	c.layers = make(map[int]*LayerCounters, len(layers))
	for _, l := range layers {
		c.layers[l] = &LayerCounters{}
	}
}

// Layer returns the counters of layer, or nil when SetLayers did not name it.
func (c *Counters) Layer(layer int) *LayerCounters { return c.layers[layer] }

// Timings hears how long the timed operations took. Implementations must be
// cheap and must not block: FaultServed runs in the FUSE Read handler.
type Timings interface {
	// FaultServed: a READ of a table file, from the request to the reply.
	FaultServed(table uint32, d time.Duration)
	// BackingRead: one backing read of a coalesced run, from its submission
	// to its answer.
	BackingRead(table uint32, d time.Duration)
	// BarrierWaited: a barrier on a control file handle (read(2) or
	// fsync). layer is the one layer its frames named since the previous
	// barrier, BarrierSeveralLayers, or BarrierNoLayer.
	BarrierWaited(layer int, d time.Duration)
}

// Layer values of Timings.BarrierWaited that are not a layer.
const (
	BarrierSeveralLayers = -1
	BarrierNoLayer       = -2
)

// SetFuseTransport records what serves the mount's FUSE requests
// (fs/uring: "uring", "dev", or "dev: " and why not the rings).
func (c *Counters) SetFuseTransport(s string) { c.fuseTransport.Store(&s) }

// FuseTransport is what SetFuseTransport recorded ("" before).
func (c *Counters) FuseTransport() string {
	if p := c.fuseTransport.Load(); p != nil {
		return *p
	}
	return ""
}

// Snapshot is the JSON form of Counters, as served by `.engramfs/stats`.
// Every field is described in Fields (TestFieldsMatchSnapshot).
type Snapshot struct {
	FuseReads     uint64 `json:"fuse_reads"`
	FuseReadBytes uint64 `json:"fuse_read_bytes"`
	FuseTransport string `json:"fuse_transport,omitempty"`

	BackingReads    uint64 `json:"backing_reads"`
	BackingBytes    uint64 `json:"backing_bytes"`
	BackingErrors   uint64 `json:"backing_errors"`
	BackingFailFast uint64 `json:"backing_fail_fast"`
	BackingAgain    uint64 `json:"backing_pages_again"`
	ReadEngine      string `json:"read_engine,omitempty"`

	S3Gets         uint64 `json:"s3_gets"`
	S3GetBytes     uint64 `json:"s3_get_bytes"`
	S3Retries      uint64 `json:"s3_retries"`
	S3Hedges       uint64 `json:"s3_hedges"`
	S3ETagFailures uint64 `json:"s3_etag_failures"`

	MirrorHits         uint64 `json:"mirror_hits"`
	MirrorBytesRead    uint64 `json:"mirror_bytes_read"`
	MirrorBytesWritten uint64 `json:"mirror_bytes_written"`
	MirrorEvictions    uint64 `json:"mirror_evictions"`
	S3FillGets         uint64 `json:"s3_fill_gets"`
	S3FillBytes        uint64 `json:"s3_fill_bytes"`
	S3FillPreempted    uint64 `json:"s3_fill_preempted"`

	MirrorChecksumFailures uint64 `json:"mirror_checksum_failures"`
	MirrorWriteErrors      uint64 `json:"mirror_write_errors"`
	MirrorBudgetBytes      int64  `json:"mirror_budget_bytes"`

	CacheCapacityBytes int64  `json:"cache_capacity_bytes"`
	CacheUsedBytes     int64  `json:"cache_used_bytes"`
	CacheHits          uint64 `json:"cache_hits"`
	CacheMisses        uint64 `json:"cache_misses"`
	CacheEvictions     uint64 `json:"cache_evictions"`
	CachePinned        bool   `json:"cache_pinned"`
	CacheMode          string `json:"cache_mode"`
	CachePinDropped    uint64 `json:"cache_pin_dropped"`

	MemcgLimitBytes     int64  `json:"memcg_limit_bytes"`
	CacheRequestedBytes int64  `json:"cache_requested_bytes"`
	CachePagesRecharged uint64 `json:"cache_pages_recharged"`
	CachePinForeign     uint64 `json:"cache_pin_foreign"`

	HintFrames   uint64 `json:"hint_frames"`
	HintRows     uint64 `json:"hint_rows"`
	HintRejected uint64 `json:"hint_rejected"`
	HintRefused  uint64 `json:"hint_refused"`
	HintSteps    uint64 `json:"hint_steps"`

	ControlHandles        int64  `json:"control_handles"`
	ControlHandlesRefused uint64 `json:"control_handles_refused"`

	PrefetchPagesQueued  uint64 `json:"prefetch_pages_queued"`
	PrefetchPagesStored  uint64 `json:"prefetch_pages_stored"`
	PrefetchPagesCached  uint64 `json:"prefetch_pages_cached"`
	PrefetchPagesDropped uint64 `json:"prefetch_pages_dropped"`
	PrefetchStoreErrors  uint64 `json:"prefetch_store_errors"`
	PrefetchLate         uint64 `json:"prefetch_late"`
	PrefetchLateServed   uint64 `json:"prefetch_late_served"`
	PrefetchPagesFailed  uint64 `json:"prefetch_pages_failed"`

	PrefetchPagesReleased     uint64 `json:"prefetch_pages_released"`
	PrefetchDecodePagesCached uint64 `json:"prefetch_decode_pages_cached"`
	PrefetchPushedEvicted     uint64 `json:"prefetch_pushed_evicted"`
	PrefetchPagesThrottled    uint64 `json:"prefetch_pages_throttled"`
	PrefetchResidencyLookups  uint64 `json:"prefetch_residency_lookups"`
	PrefetchResidencySkipped  uint64 `json:"prefetch_residency_skipped"`

	WarmPagesTotal uint64 `json:"warm_pages_total"`
	WarmPagesDone  uint64 `json:"warm_pages_done"`

	// Layers is the hint accuracy per engram layer, keyed by layer number
	// (a string in JSON).
	Layers map[int]LayerSnapshot `json:"layers,omitempty"`

	Goroutines int `json:"goroutines"`
	Pid        int `json:"pid"`
}

// Snapshot reads every counter once. Counters are read one by one, so a
// snapshot taken under load is not a single instant; each value is exact.
func (c *Counters) Snapshot() Snapshot {
	return Snapshot{
		FuseReads:     c.FuseReads.Load(),
		FuseReadBytes: c.FuseReadBytes.Load(),
		FuseTransport: c.FuseTransport(),

		BackingReads:    c.BackingReads.Load(),
		BackingBytes:    c.BackingBytes.Load(),
		BackingErrors:   c.BackingErrors.Load(),
		BackingFailFast: c.BackingFailFast.Load(),
		BackingAgain:    c.BackingAgain.Load(),
		ReadEngine:      c.ReadEngine,

		S3Gets:         c.S3Gets.Load(),
		S3GetBytes:     c.S3GetBytes.Load(),
		S3Retries:      c.S3Retries.Load(),
		S3Hedges:       c.S3Hedges.Load(),
		S3ETagFailures: c.S3ETagFailures.Load(),

		MirrorHits:         c.MirrorHits.Load(),
		MirrorBytesRead:    c.MirrorBytesRead.Load(),
		MirrorBytesWritten: c.MirrorBytesWritten.Load(),
		MirrorEvictions:    c.MirrorEvictions.Load(),
		S3FillGets:         c.S3FillGets.Load(),
		S3FillBytes:        c.S3FillBytes.Load(),
		S3FillPreempted:    c.S3FillPreempted.Load(),

		MirrorChecksumFailures: c.MirrorChecksumFailures.Load(),
		MirrorWriteErrors:      c.MirrorWriteErrors.Load(),
		MirrorBudgetBytes:      c.MirrorBudgetBytes.Load(),

		CacheCapacityBytes: c.CacheCapacityBytes.Load(),
		CacheUsedBytes:     c.CacheUsedBytes.Load(),
		CacheHits:          c.CacheHits.Load(),
		CacheMisses:        c.CacheMisses.Load(),
		CacheEvictions:     c.CacheEvictions.Load(),
		CachePinned:        c.CachePinned.Load(),
		CacheMode:          cacheMode(c.CachePinned.Load()),
		CachePinDropped:    c.CachePinDropped.Load(),

		MemcgLimitBytes:     c.MemcgLimitBytes.Load(),
		CacheRequestedBytes: c.CacheRequestedBytes.Load(),
		CachePagesRecharged: c.CachePagesRecharged.Load(),
		CachePinForeign:     c.CachePinForeign.Load(),

		HintFrames:   c.HintFrames.Load(),
		HintRows:     c.HintRows.Load(),
		HintRejected: c.HintRejected.Load(),
		HintRefused:  c.HintRefused.Load(),
		HintSteps:    c.HintSteps.Load(),

		ControlHandles:        c.ControlHandles.Load(),
		ControlHandlesRefused: c.ControlHandlesRefused.Load(),

		PrefetchPagesQueued:  c.PrefetchPagesQueued.Load(),
		PrefetchPagesStored:  c.PrefetchPagesStored.Load(),
		PrefetchPagesCached:  c.PrefetchPagesCached.Load(),
		PrefetchPagesDropped: c.PrefetchPagesDropped.Load(),
		PrefetchStoreErrors:  c.PrefetchStoreErrors.Load(),
		PrefetchLate:         c.PrefetchLate.Load(),
		PrefetchLateServed:   c.PrefetchLateServed.Load(),
		PrefetchPagesFailed:  c.PrefetchPagesFailed.Load(),

		PrefetchPagesReleased:     c.PrefetchPagesReleased.Load(),
		PrefetchDecodePagesCached: c.PrefetchDecodePagesCached.Load(),
		PrefetchPushedEvicted:     c.PrefetchPushedEvicted.Load(),
		PrefetchPagesThrottled:    c.PrefetchPagesThrottled.Load(),
		PrefetchResidencyLookups:  c.PrefetchResidencyLookups.Load(),
		PrefetchResidencySkipped:  c.PrefetchResidencySkipped.Load(),

		WarmPagesTotal: c.WarmPagesTotal.Load(),
		WarmPagesDone:  c.WarmPagesDone.Load(),

		Layers: c.layerSnapshots(),

		Goroutines: runtime.NumGoroutine(),
		Pid:        os.Getpid(),
	}
}

func cacheMode(pinned bool) string {
	if pinned {
		return "pinned"
	}
	return "unpinned"
}

// LayerSnapshot is the JSON form of LayerCounters.
type LayerSnapshot struct {
	Pushed    uint64 `json:"pushed"`
	Refaulted uint64 `json:"refaulted"`
	Dropped   uint64 `json:"dropped"`
}

func (c *Counters) layerSnapshots() map[int]LayerSnapshot {
	if len(c.layers) == 0 {
		return nil
	}
	out := make(map[int]LayerSnapshot, len(c.layers))
	for l, lc := range c.layers {
		out[l] = LayerSnapshot{Pushed: lc.Pushed.Load(), Refaulted: lc.Refaulted.Load(), Dropped: lc.Dropped.Load()}
	}
	return out
}

// JSON renders a snapshot as one indented JSON object and a newline.
func (c *Counters) JSON() []byte {
	b, _ := json.MarshalIndent(c.Snapshot(), "", "  ") // a struct of numbers cannot fail to marshal
	return append(b, '\n')
}

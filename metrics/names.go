package metrics

// Every metric engramfs exports, in one place: name, help and kind. The
// counters mirror `.engramfs/stats` field for field (the JSON name is the
// key, so a field added to stats.Snapshot without a metric fails
// TestEveryStatHasAMetric). Counters end in _total, as Prometheus wants.

const namespace = "engramfs"

// Labels. Cardinality stays bounded by the model: one value per engram layer
// (plus "several" and "none" for barriers).
const (
	labelLayer = "layer"

	barrierSeveralLayers = "several" // an fsync whose frames named more than one layer
	barrierNoLayer       = "none"    // an fsync with no frame since the previous one
)

// kind is how a stats field is exported.
type kind uint8

const (
	counter kind = iota // monotonic
	gauge               // a level
)

type statMetric struct {
	name string // without the namespace
	kind kind
	help string
}

// statMetrics maps a JSON field of stats.Snapshot to its metric.
var statMetrics = map[string]statMetric{
	"fuse_reads":      {"fuse_reads_total", counter, "READ requests on table files that reached FUSE (page faults and read(2) misses)."},
	"fuse_read_bytes": {"fuse_read_bytes_total", counter, "Bytes returned by READ requests on table files."},

	"backing_reads":     {"backing_reads_total", counter, "Reads of shard files (one per coalesced run of adjacent pages)."},
	"backing_bytes":     {"backing_bytes_total", counter, "Bytes read from shard files, O_DIRECT alignment included."},
	"backing_errors":    {"backing_errors_total", counter, "Shard reads that failed (I/O error, short read, shard changed since mount)."},
	"backing_fail_fast": {"backing_fail_fast_total", counter, "Pages failed at once, without a read, because their read failed less than a second ago."},

	"s3_gets":          {"s3_gets_total", counter, "GETs sent to the object store, retries and hedges included."},
	"s3_get_bytes":     {"s3_get_bytes_total", counter, "Body bytes received from the object store."},
	"s3_retries":       {"s3_retries_total", counter, "GETs sent again after a 5xx, 429, connection reset, truncated body or a 200 to a range request."},
	"s3_hedges":        {"s3_hedges_total", counter, "Second GETs sent because the first had no first byte after the adaptive p95."},
	"s3_etag_failures": {"s3_etag_failures_total", counter, "GETs refused with 412 Precondition Failed: the object was rewritten under the mount."},

	"mirror_hits":          {"mirror_hits_total", counter, "Object store reads served from the local SSD mirror, without a GET."},
	"mirror_bytes_read":    {"mirror_bytes_read_total", counter, "Bytes read from the local SSD mirror."},
	"mirror_bytes_written": {"mirror_bytes_written_total", counter, "Bytes written to the local SSD mirror and made durable."},
	"mirror_evictions":     {"mirror_evictions_total", counter, "2 MiB extents punched out of the local SSD mirror to keep its budget."},

	"cache_capacity_bytes": {"cache_capacity_bytes", gauge, "Budget of the hot tier (--cache-size)."},
	"cache_used_bytes":     {"cache_used_bytes", gauge, "Bytes of table pages locked in the page cache now."},
	"cache_hits":           {"cache_hits_total", counter, "Hinted or faulted pages found in the hot tier."},
	"cache_misses":         {"cache_misses_total", counter, "Hinted or faulted pages not in the hot tier."},
	"cache_evictions":      {"cache_evictions_total", counter, "Pages unpinned to keep the hot tier within its budget."},
	"cache_pinned":         {"cache_pinned", gauge, "1 when the hot tier can mlock pages, 0 when it runs unpinned."},
	"cache_pin_dropped":    {"cache_pin_dropped_total", counter, "Pages admitted to the hot tier but not pinned because the pin queue was full."},

	"hint_frames":   {"hint_frames_total", counter, "Hint frames accepted on the control file."},
	"hint_rows":     {"hint_rows_total", counter, "Rows named by accepted hint frames."},
	"hint_rejected": {"hint_rejected_total", counter, "Hint frames refused with EINVAL."},
	"hint_refused":  {"hint_refused_total", counter, "Hint writes refused with EAGAIN because the handle's decode backlog was full."},

	"prefetch_pages_queued":  {"prefetch_pages_queued_total", counter, "Pages queued for prefetch by hints and warm restart."},
	"prefetch_pages_stored":  {"prefetch_pages_stored_total", counter, "Pages pushed into the page cache (NOTIFY_STORE)."},
	"prefetch_pages_dropped": {"prefetch_pages_dropped_total", counter, "Prefill pages dropped because the prefill queue was full."},
	"prefetch_store_errors":  {"prefetch_store_errors_total", counter, "Page cache stores that failed (ENOENT included: no reader had looked the file up yet)."},
	"prefetch_late":          {"prefetch_late_total", counter, "FUSE reads of a page whose prefetch was still queued or in flight."},
	"prefetch_pages_failed":  {"prefetch_pages_failed_total", counter, "Hinted pages that settled as failed (backing read or page cache store failed)."},

	"warm_pages_total": {"warm_pages", gauge, "Pages of the saved hot set that the warm restart fetches again."},
	"warm_pages_done":  {"warm_pages_done", gauge, "Pages of the warm restart settled so far (resident, failed or dropped)."},

	"goroutines": {"goroutines", gauge, "Goroutines of the daemon."},
}

// notExported are stats fields with no metric of their own, and why.
var notExported = map[string]string{
	"pid":         "an identity, not a measurement (process_* metrics come from the process collector)",
	"read_engine": "a setting, not a measurement (logged at mount)",
	"layers":      "exported by layer as hint_pages_*_total{layer}",
	"cache_mode":  "the words for cache_pinned (pinned | unpinned), which is exported",
}

// Per-layer hint accuracy (the "layers" object of the stats), labelled by layer.
var layerMetrics = struct{ pushed, refaulted, dropped statMetric }{
	pushed:    statMetric{"hint_pages_pushed_total", counter, "Hinted pages pushed into the page cache, by layer."},
	refaulted: statMetric{"hint_pages_refaulted_total", counter, "Hinted pages a FUSE read asked for anyway (evicted after the push, or pushed late), by layer."},
	dropped:   statMetric{"hint_pages_dropped_total", counter, "Hinted prefill pages dropped from a full queue, by layer."},
}

// Histograms (seconds).
const (
	faultSecondsName   = "fault_seconds"
	faultSecondsHelp   = "Service time of READ requests on table files (the FUSE side of a page fault), by layer."
	backingSecondsName = "backing_read_seconds"
	backingSecondsHelp = "Time of one shard read (a coalesced run), with its queue slot held."
	barrierSecondsName = "barrier_wait_seconds"
	barrierSecondsHelp = "Time fsync on the control file waited for its hinted pages, by the layer its frames named."
)

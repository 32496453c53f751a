package stats

import (
	"reflect"
	"strings"
)

//go:generate go run ./statsdoc ../../docs/operations.md

// Kind is how a stat behaves over the life of a mount.
type Kind uint8

const (
	// Counter starts at 0 at mount and only grows.
	Counter Kind = iota
	// Gauge is a level: it may go down (booleans are gauges of 0 and 1).
	Gauge
	// Info is a setting or an identity, not a measurement: it has no metric.
	Info
)

func (k Kind) String() string {
	switch k {
	case Counter:
		return "counter"
	case Gauge:
		return "gauge"
	}
	return "info"
}

// Field describes one field of Snapshot, or of LayerSnapshot.
type Field struct {
	// Name is the JSON name in `.engramfs/stats`; a field of LayerSnapshot
	// is "layers.<L>.NAME".
	Name string
	Kind Kind
	// Unit is what one step of the value is: "pages", "bytes", ...; ""
	// for Info fields.
	Unit string
	// Group is the section of `engramfs stats` the field is shown in.
	Group string
	// Label is a few words for the `engramfs stats` table: Meaning, cut short.
	Label string
	// Meaning is one sentence, true to the code that writes the field.
	Meaning string
	// Metric is the Prometheus name without the "engramfs_" namespace;
	// every Counter and Gauge has one, no Info field does. A per-layer
	// field's metric has a "layer" label.
	Metric string
}

// LayerPrefix starts the Name of every field of LayerSnapshot.
const LayerPrefix = "layers.<L>."

// PerLayer reports whether f is a field of LayerSnapshot.
func (f Field) PerLayer() bool { return strings.HasPrefix(f.Name, LayerPrefix) }

// JSONKey is f's key in its JSON object (Name without LayerPrefix).
func (f Field) JSONKey() string { return strings.TrimPrefix(f.Name, LayerPrefix) }

// Groups of Fields, in the order `engramfs stats` shows them.
const (
	GroupFaults  = "Page faults"
	GroupBacking = "Backing store"
	GroupS3      = "Object store"
	GroupMirror  = "Object store mirror"
	GroupHot     = "Hot tier"
	GroupHints   = "Hints"
	GroupPrefill = "Prefetch"
	GroupWarm    = "Warm restart"
	GroupDaemon  = "Daemon"
	GroupLayers  = "Hint accuracy by layer"
)

// Fields describes every stat: the one place that says what each means.
// The `engramfs stats` table, the Prometheus metrics (metrics/) and the
// table in docs/operations.md (go generate) are made from it;
// TestFieldsMatchSnapshot keeps it in step with Snapshot.
var Fields = []Field{
	{"fuse_reads", Counter, "requests", GroupFaults, "READs of table files that reached FUSE",
		"READ requests on table files that reached the daemon: demand faults and read(2) misses, header reads, and the hot tier's own populate of a cold page it pins.",
		"fuse_reads_total"},
	{"fuse_read_bytes", Counter, "bytes", GroupFaults, "bytes those READs asked for",
		"Bytes those READs asked for, cut at the end of the file (counted before the READ is served, so failed READs count too).",
		"fuse_read_bytes_total"},
	{"fuse_transport", Info, "", GroupFaults, "what serves FUSE requests",
		"What serves the mount's FUSE requests: uring (per-CPU io_uring queues, --fuse-transport), dev (/dev/fuse), or dev: and why the rings are not used (absent before the mount is up).",
		""},

	{"backing_reads", Counter, "reads", GroupBacking, "backing reads (one per coalesced run)",
		"Reads issued to the backing source, one per coalesced run of adjacent pages: a pread or io_uring read of a shard file, or one object store span (its GET, retries and hedges); mirror hits are not counted.",
		"backing_reads_total"},
	{"backing_bytes", Counter, "bytes", GroupBacking, "bytes asked of the backing source",
		"Bytes those reads asked for: the aligned superset under O_DIRECT, a span's whole range (merged gaps included) from an object store.",
		"backing_bytes_total"},
	{"backing_errors", Counter, "reads", GroupBacking, "backing reads that failed",
		"Reads of a run that failed: I/O error, short read, shard changed or gone, source closed, or a fault injected by --inject-faults.",
		"backing_errors_total"},
	{"backing_fail_fast", Counter, "pages", GroupBacking, "pages failed at once (read failed < 1 s ago)",
		"Pages failed at once, without a read, because their backing read failed less than a second ago (the loader's negative cache).",
		"backing_fail_fast_total"},
	{"backing_pages_again", Counter, "pages", GroupBacking, "pages read again after the daemon cached them",
		"Table pages read from backing that this daemon had already put in the page cache since it started (answered a READ for or stored): the kernel evicted them and a reader or a hint asked again; a daemon that took a live mount over counts none, not knowing its predecessor's.",
		"backing_pages_again_total"},
	{"read_engine", Info, "", GroupBacking, "how backing reads are issued",
		"How backing reads are issued: io_uring or pread for shard files, s3 for an object store (absent when unset).",
		""},

	{"s3_gets", Counter, "GETs", GroupS3, "GETs sent (retries, hedges included)",
		"GETs sent to the object store, retries and hedges included.",
		"s3_gets_total"},
	{"s3_get_bytes", Counter, "bytes", GroupS3, "body bytes received",
		"Body bytes received from the object store, those of cut-short and losing hedged GETs included.",
		"s3_get_bytes_total"},
	{"s3_retries", Counter, "GETs", GroupS3, "GETs sent again after a transient failure",
		"GETs sent again after a retryable failure: 5xx, 429, connection reset, truncated body, a 200 to a range request, an attempt timeout, or a GET that went --s3-stall-timeout without progress.",
		"s3_retries_total"},
	{"s3_hedges", Counter, "GETs", GroupS3, "second GETs for slow demand reads",
		"Second GETs sent because a demand read's (a fault's or a decode hint's) first GET had no answer after the adaptive p97 latency of recent demand GETs (prefill GETs are never hedged).",
		"s3_hedges_total"},
	{"s3_etag_failures", Counter, "reads", GroupS3, "reads refused with 412 (object rewritten)",
		"Object store reads that failed with 412 Precondition Failed: the object was rewritten under the mount.",
		"s3_etag_failures_total"},
	{"s3_fill_gets", Counter, "GETs", GroupS3, "GETs of the background fill lane",
		"GETs of the background fill lane (--s3-fill-rate): pages of open shards not mirrored yet, fetched into the mirror in GET slots nobody waits for (also counted in s3_gets).",
		"s3_fill_gets_total"},
	{"s3_fill_bytes", Counter, "bytes", GroupS3, "body bytes of fill GETs",
		"Body bytes the fill lane received (also counted in s3_get_bytes); at most --s3-fill-rate a second, after a burst of 256 KiB.",
		"s3_fill_bytes_total"},
	{"s3_fill_preempted", Counter, "GETs", GroupS3, "fill GETs stopped for a waiting GET",
		"Fill GETs canceled because a demand or prefill GET had to wait for a slot: the fill lane never delays them.",
		"s3_fill_preempted_total"},

	{"mirror_hits", Counter, "reads", GroupMirror, "reads served from the mirror, no GET",
		"Object store reads served from the local SSD mirror (--s3-mirror) without a GET: read through the read engine local shards use, with O_DIRECT where the mirror's filesystem takes it.",
		"mirror_hits_total"},
	{"mirror_bytes_read", Counter, "bytes", GroupMirror, "bytes read from the mirror",
		"Bytes those mirror reads returned.",
		"mirror_bytes_read_total"},
	{"mirror_bytes_written", Counter, "bytes", GroupMirror, "bytes written to the mirror, durably",
		"Bytes written to the mirror, made durable (fdatasync) and marked as mirrored.",
		"mirror_bytes_written_total"},
	{"mirror_evictions", Counter, "extents", GroupMirror, "2 MiB extents punched out for the budget",
		"2 MiB extents evicted from the mirror (pages unmarked, then bytes punched out) to keep it within its budget (--s3-mirror-size).",
		"mirror_evictions_total"},
	{"mirror_checksum_failures", Counter, "pages", GroupMirror, "mirrored pages whose bytes failed their checksum",
		"Mirrored pages whose bytes did not match the CRC32C recorded when they were written (a damaged or punched mirror file): each is read from the object instead, unmarked, and mirrored again.",
		"mirror_checksum_failures_total"},
	{"mirror_write_errors", Counter, "writes", GroupMirror, "mirror writes that failed",
		"Writes or fdatasyncs of mirror files that failed (ENOSPC, EIO): their pages are not marked mirrored; on ENOSPC the mirror's budget is lowered and extents evicted to make room.",
		"mirror_write_errors_total"},
	{"mirror_budget_bytes", Gauge, "bytes", GroupMirror, "bytes the mirror may hold now",
		"The mirror's budget in force: --s3-mirror-size, lowered at mount to what the mirror's filesystem can hold and again on each ENOSPC.",
		"mirror_budget_bytes"},

	{"cache_capacity_bytes", Gauge, "bytes", GroupHot, "budget of pinned pages",
		"Budget of the hot tier: --cache-size rounded down to whole 4 KiB pages (0: no tier).",
		"cache_capacity_bytes"},
	{"cache_used_bytes", Gauge, "bytes", GroupHot, "pinned now",
		"Bytes of table pages the hot tier holds locked in the page cache now.",
		"cache_used_bytes"},
	{"cache_hits", Counter, "pages", GroupHot, "faulted or hinted pages found in the tier",
		"Faulted or hinted pages (warm restart included) that the hot tier's policy already held (pinned, or admitted and not yet pinned).",
		"cache_hits_total"},
	{"cache_misses", Counter, "pages", GroupHot, "... not found in the tier",
		"Faulted or hinted pages (warm restart included) that the hot tier's policy did not hold; hits/(hits+misses) is the hit ratio.",
		"cache_misses_total"},
	{"cache_evictions", Counter, "pages", GroupHot, "pages unpinned to stay within budget",
		"Pages that left the hot tier to keep it within its budget and were unpinned (with the tier unpinned: that its policy evicted).",
		"cache_evictions_total"},
	{"cache_pinned", Gauge, "bool", GroupHot, "false: the tier runs unpinned",
		"True while the hot tier locks its pages; false when locking is unavailable (no CAP_IPC_LOCK and RLIMIT_MEMLOCK below the table files' size, or refused later) or the tier is off.",
		"cache_pinned"},
	{"cache_mode", Info, "", GroupHot, "cache_pinned in words",
		"cache_pinned in words: pinned or unpinned.",
		""},
	{"cache_pin_dropped", Counter, "pages", GroupHot, "admitted but not pinned: pin queue full",
		"Pages admitted to the hot tier but removed from it unpinned because the pin queue (twice the tier's pages, at least 128Ki) was full.",
		"cache_pin_dropped_total"},
	{"memcg_limit_bytes", Gauge, "bytes", GroupHot, "the daemon's memory cgroup limit (0: none)",
		"The tightest memory limit on the daemon's own memory cgroup and its ancestors, read at start (v2 memory.max and memory.high, v1 memory.limit_in_bytes); 0 when there is none. The hot tier is fitted below it.",
		"memcg_limit_bytes"},
	{"cache_requested_bytes", Gauge, "bytes", GroupHot, "--cache-size asked",
		"--cache-size as asked; cache_capacity_bytes is less when the tier was clamped to fit memcg_limit_bytes with headroom.",
		"cache_requested_bytes"},
	{"cache_pages_recharged", Counter, "pages", GroupHot, "re-stored: the pin charged to the daemon",
		"Pages charged to another process's memory cgroup (a reader's fault brought them in) that the pinner dropped and stored again from the daemon before pinning them, so that the pin is charged to the daemon's cgroup, never a reader's.",
		"cache_pages_recharged_total"},
	{"cache_pin_foreign", Counter, "pages", GroupHot, "not pinned: stayed charged to a reader",
		"Pages the pinner did not pin because they were still charged to another memory cgroup after being stored again (a reader faulted them back in between): removed from the hot tier, left reclaimable.",
		"cache_pin_foreign_total"},

	{"hint_frames", Counter, "frames", GroupHints, "frames accepted",
		"Hint frames decoded whole from the control file and handed to the prefetcher.",
		"hint_frames_total"},
	{"hint_rows", Counter, "rows", GroupHints, "rows named by them",
		"Rows named by hint frames, counted as they are decoded (the rows of a bad frame before its first bad field included).",
		"hint_rows_total"},
	{"hint_rejected", Counter, "writes", GroupHints, "writes refused: bad frame (EINVAL)",
		"Control file writes failed with EINVAL because they delivered a bad frame field (the handle's stream is reset); also steps with a bad frame (their status line says why) or that begin or end inside a frame (EINVAL).",
		"hint_rejected_total"},
	{"hint_refused", Counter, "writes", GroupHints, "writes refused: decode backlog full (EAGAIN)",
		"Control file writes that start a decode frame refused with EAGAIN, before decoding, because the handle's queued decode work was at its limit (prefill frames are never refused).",
		"hint_refused_total"},
	{"hint_steps", Counter, "steps", GroupHints, "steps (frames and barrier in one ioctl)",
		"Decode steps answered through the control file's step ioctl: a step's frames and its barrier in one request, the status line in the answer. Their frames count in hint_frames too.",
		"hint_steps_total"},
	{"control_handles", Gauge, "handles", GroupHints, "control-file handles open",
		"Handles of .engramfs/control open now; at most --control-handles.",
		"control_handles"},
	{"control_handles_refused", Counter, "opens", GroupHints, "control-file opens refused: too many open",
		"Opens of .engramfs/control refused with ENFILE because --control-handles handles were open already.",
		"control_handles_refused_total"},

	{"prefetch_pages_queued", Counter, "pages", GroupPrefill, "pages queued by hints and warm restart",
		"Pages put on a prefetch queue by hints and the warm restart (a page already pinned, queued or being fetched is not queued again, unless a decode hint moves a queued prefill page up).",
		"prefetch_pages_queued_total"},
	{"prefetch_pages_stored", Counter, "pages", GroupPrefill, "pages pushed into the page cache",
		"Prefetched pages pushed into the page cache (NOTIFY_STORE).",
		"prefetch_pages_stored_total"},
	{"prefetch_pages_cached", Counter, "pages", GroupPrefill, "hinted pages already cached: not fetched",
		"Hinted pages that were in the page cache already (mincore on the daemon's own mapping) and not pinned: not read or stored again, counted as resident by the barrier.",
		"prefetch_pages_cached_total"},
	{"prefetch_pages_dropped", Counter, "pages", GroupPrefill, "prefill pages dropped from a full queue",
		"Prefill pages dropped unfetched, oldest first, because the prefill queue (--prefetch-queue) was full.",
		"prefetch_pages_dropped_total"},
	{"prefetch_store_errors", Counter, "pages", GroupPrefill, "pages whose push into the page cache failed",
		"Prefetched pages whose push into the page cache (NOTIFY_STORE) failed: the mount was not serving (before Serve or after Close) or the kernel refused the store; they settle as failed and are read on first touch instead.",
		"prefetch_store_errors_total"},
	{"prefetch_late", Counter, "pages", GroupPrefill, "hinted pages a fault read before the push",
		"Hinted pages that a FUSE read asked for before their push landed (still queued, being read, or read and waiting for the push; the last are prefetch_late_served): the hint came too late.",
		"prefetch_late_total"},
	{"prefetch_late_served", Counter, "pages", GroupPrefill, "late pages faults got from the prefetch's read",
		"Pages a FUSE read got from a prefetch whose backing read had finished but whose push had not landed yet: served from that read's data, not read from backing again.",
		"prefetch_late_served_total"},
	{"prefetch_pages_failed", Counter, "pages", GroupPrefill, "hinted pages that settled as failed",
		"Hinted pages that settled as failed: their backing read or their push failed, or a page a fault served could not be confirmed in the page cache.",
		"prefetch_pages_failed_total"},
	{"prefetch_pages_released", Counter, "pages", GroupPrefill, "queued pages dropped: their handle closed",
		"Queued hinted pages (prefill or decode) dropped unfetched because every control-file handle that asked for them was closed (its process ended or was killed).",
		"prefetch_pages_released_total"},

	{"prefetch_decode_pages_cached", Counter, "pages", GroupPrefill, "decode-hinted pages already cached: not fetched",
		"Of prefetch_pages_cached, the pages decode hints named: in the page cache already (a reader faulted them, or an earlier hint pushed them), not pinned, so neither read nor stored again.",
		"prefetch_decode_pages_cached_total"},
	{"prefetch_pushed_evicted", Counter, "pages", GroupPrefill, "pushed pages evicted before their reader came",
		"Pages a hint pushed into the page cache that a FUSE read then asked for before any new hint named them: the page cache evicted them before their reader got there (or after it had read them once, and it came back unhinted). Each is a second backing read of a page the prefetch read.",
		"prefetch_pushed_evicted_total"},
	{"prefetch_pages_throttled", Counter, "pages", GroupPrefill, "prefill dropped: the handle's pushes evicted",
		"Of prefetch_pages_dropped, the prefill pages dropped unfetched because the first page pushed for their handle since its last barrier had left the page cache before that barrier returned, so the handle's prefill work was more than the page cache holds and its reader faults these pages instead (one read each, not a push evicted and a read again).",
		"prefetch_pages_throttled_total"},
	{"prefetch_residency_lookups", Counter, "lookups", GroupPrefill, "residency lookups of hinted pages",
		"Residency lookups of hinted pages not pinned (a window of pages close together each): whether they are in the page cache already, so that they are not read and stored again.",
		"prefetch_residency_lookups_total"},
	{"prefetch_residency_skipped", Counter, "lookups", GroupPrefill, "of those, answered without a system call",
		"Of prefetch_residency_lookups, those answered without a mincore call: none of their pages was ever served or stored by this daemon (cache.Seen), so none is cached. A daemon that took a live mount over asks mincore every time.",
		"prefetch_residency_skipped_total"},

	{"warm_pages_total", Gauge, "pages", GroupWarm, "saved hot pages to fetch again",
		"Pages of the saved hot set that the warm restart fetches again (0 without a state file).",
		"warm_pages"},
	{"warm_pages_done", Gauge, "pages", GroupWarm, "of them settled",
		"Pages of the warm restart whose batch has settled (resident, failed or dropped) and had its pins applied; it reaches warm_pages_total when the warm restart is done.",
		"warm_pages_done"},

	{"goroutines", Gauge, "goroutines", GroupDaemon, "daemon goroutines",
		"The daemon's goroutine count when the snapshot was taken: a leak shows as a count that never comes back down.",
		"goroutines"},
	{"pid", Info, "", GroupDaemon, "daemon process id",
		"The daemon's process id: engramfs unmount and umount.fuse.engramfs wait for it to exit, and a second mount on the mountpoint is refused naming it.",
		""},

	{LayerPrefix + "pushed", Counter, "pages", GroupLayers, "pages pushed",
		"Hinted pages of layer L pushed into the page cache (warm restart included).",
		"hint_pages_pushed_total"},
	{LayerPrefix + "refaulted", Counter, "pages", GroupLayers, "pages FUSE read anyway",
		"Hinted pages of layer L that a FUSE read still asked for, at most once per hint: the push came late or failed, or the page was evicted before the reader touched it.",
		"hint_pages_refaulted_total"},
	{LayerPrefix + "dropped", Counter, "pages", GroupLayers, "prefill pages dropped",
		"Hinted prefill pages of layer L dropped unfetched from a full prefill queue.",
		"hint_pages_dropped_total"},
}

// FieldByName returns the Field named name (a Field.Name), or false.
func FieldByName(name string) (Field, bool) {
	for _, f := range Fields {
		if f.Name == name {
			return f, true
		}
	}
	return Field{}, false
}

var (
	snapshotIndex = jsonIndex(reflect.TypeFor[Snapshot]())
	layerIndex    = jsonIndex(reflect.TypeFor[LayerSnapshot]())
)

// jsonIndex maps the JSON names of struct type t to field indexes.
func jsonIndex(t reflect.Type) map[string]int {
	m := make(map[string]int, t.NumField())
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		m[name] = i
	}
	return m
}

// Value is the value of field f in s (for a per-layer f, in layer's
// LayerSnapshot): a uint64, int64, int, bool or string; nil when s has no
// such field or layer.
func (s Snapshot) Value(f Field, layer int) any {
	if f.PerLayer() {
		ls, ok := s.Layers[layer]
		i, known := layerIndex[f.JSONKey()]
		if !ok || !known {
			return nil
		}
		return reflect.ValueOf(ls).Field(i).Interface()
	}
	i, ok := snapshotIndex[f.Name]
	if !ok {
		return nil
	}
	return reflect.ValueOf(s).Field(i).Interface()
}

package metrics

// The names of the metrics that are not a field of `.engramfs/stats`: labels
// and histograms. The counters and gauges take their name, type and help
// from stats.Fields, the one description of every stat.

const namespace = "engramfs"

// Labels. Cardinality stays bounded by the model: one value per engram layer
// (plus "several" and "none" for barriers).
const (
	labelLayer = "layer"

	barrierSeveralLayers = "several" // a barrier whose frames named more than one layer
	barrierNoLayer       = "none"    // a barrier with no frame since the previous one
)

// Histograms (seconds).
const (
	faultSecondsName   = "fault_seconds"
	faultSecondsHelp   = "Service time of READ requests on table files (the FUSE side of a page fault), by layer."
	backingSecondsName = "backing_read_seconds"
	backingSecondsHelp = "Time of one backing read of a coalesced run, from its submission to its answer (time waiting in the read engine's queue included)."
	barrierSecondsName = "barrier_wait_seconds"
	barrierSecondsHelp = "Time a barrier (read(2) or fsync) on a control file handle waited for its hinted pages, by the one layer its frames named since the previous barrier (several, none)."
)

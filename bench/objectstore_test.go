package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing/s3source/s3test"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
)

// fakeObjectStore is an object-store run in round numbers on fakeReport's
// big geometry (whose path 5 decodes in 2.5 ms): every target met.
func fakeObjectStore() *ObjectStoreReport {
	dec := func(p50 time.Duration, st stats.Snapshot, pages int64) *ObjectStoreDecode {
		return &ObjectStoreDecode{
			Phase:         &Phase{Times: Summary{N: 10, P50: p50, P99: 2 * p50}, Hint: &Summary{N: 10, P50: p50 / 2}, Stats: &st},
			DistinctPages: pages, GetsPerStep: float64(st.S3Gets) / 10, BytesPerPage: float64(st.S3GetBytes) / float64(pages*4096),
		}
	}
	return &ObjectStoreReport{
		Geometry: "big", URL: "s3://models/bench/big", UploadBytes: 1 << 30, Upload: 10 * time.Second,
		FirstByte: 20 * time.Millisecond, SlowFirstByte: 200 * time.Millisecond, SlowFraction: 0.01,
		Cold:    dec(45*time.Millisecond, stats.Snapshot{S3Gets: 1000, S3GetBytes: 1000 * 4096 * 6 / 5}, 1000), // 1.2 bytes a page byte
		Misses:  &ColdMisses{Times: Summary{N: 200, P50: 21 * time.Millisecond, P99: 40 * time.Millisecond, Max: 60 * time.Millisecond}, P95: 25 * time.Millisecond, Gets: 200, Hedges: 3},
		Prefill: &PrefillDeadline{Lead: 2 * time.Second, Pages: 4000, Resident: 3980, Late: 20, Fraction: 0.995, Settled: 2100 * time.Millisecond},
		Filling: dec(45*time.Millisecond, stats.Snapshot{S3Gets: 1000, S3GetBytes: 1000 * 4096}, 1000),
		Mirror:  dec(2600*time.Microsecond, stats.Snapshot{MirrorHits: 1000}, 1000), // 1.04× path 5
	}
}

func objectStoreTarget(t *testing.T, r *Report, id string) Target {
	t.Helper()
	for _, tg := range r.Targets {
		if tg.ID == id {
			return tg
		}
	}
	t.Fatalf("no target %s in %+v", id, r.Targets)
	return Target{}
}

// Each object-store target is the ratio of this run's figures it names,
// judged against its bound; the mirror's needs 0 GETs and path 5's decode
// on the local shards.
func TestObjectStoreTargets(t *testing.T) {
	r := fakeReport()
	r.ObjectStore = fakeObjectStore()
	r.finish(64)
	for _, c := range []struct {
		id    string
		value float64
	}{
		{TargetS3BytesPerPage, 1.2},
		{TargetS3Prefill, 0.995},
		{TargetS3Mirror, 2.6 / 2.5},
		{TargetS3MissP50, 21.0 / 22},
		{TargetS3MissTail, 40.0 / 25},
	} {
		tg := objectStoreTarget(t, r, c.id)
		if math.Abs(tg.Value-c.value) > 1e-9 || !tg.Met || tg.Geometry != "big s3" {
			t.Errorf("%s: value %v met %v geometry %q, want %v, met, \"big s3\"", c.id, tg.Value, tg.Met, tg.Geometry, c.value)
		}
	}
	if r.ObjectStore.LocalHints != 2500*time.Microsecond {
		t.Errorf("local reference %v, want path 5's decode p50 2.5ms", r.ObjectStore.LocalHints)
	}

	// Each one missed.
	o := r.ObjectStore
	o.Cold.BytesPerPage = 1.3
	o.Prefill.Fraction = 0.98
	o.Mirror.Phase.Stats.S3Gets = 1 // fast, but one GET
	o.Misses.Times.P50 = 23 * time.Millisecond
	o.Misses.Times.P99 = 51 * time.Millisecond
	r.finish(64)
	for _, id := range []string{TargetS3BytesPerPage, TargetS3Prefill, TargetS3Mirror, TargetS3MissP50, TargetS3MissTail} {
		if tg := objectStoreTarget(t, r, id); tg.Met {
			t.Errorf("%s met at %v: %s", id, tg.Value, tg.Detail)
		}
	}
	o.Mirror.Phase.Stats.S3Gets = 0
	o.Mirror.Phase.Times.P50 = 2800 * time.Microsecond // 1.12×
	r.finish(64)
	if tg := objectStoreTarget(t, r, TargetS3Mirror); tg.Met {
		t.Errorf("mirror met at %v× local", tg.Value)
	}

	// Without path 5 the mirror's target is not judged.
	r.Geometries[0].Paths = r.Geometries[0].Paths[:len(r.Geometries[0].Paths)-2]
	o.LocalHints = 0
	r.finish(64)
	if tg := objectStoreTarget(t, r, TargetS3Mirror); tg.Met || tg.Unmet == "" {
		t.Errorf("mirror target without path 5: met %v, unmet %q", tg.Met, tg.Unmet)
	}

	// A skipped run judges nothing.
	r.ObjectStore = &ObjectStoreReport{Skipped: "--no-s3"}
	r.finish(64)
	for _, tg := range r.Targets {
		if strings.HasPrefix(tg.ID, "s3-") {
			t.Errorf("skipped run judged %s", tg.ID)
		}
	}
}

// The report prints the object-store section (or why it was skipped) and
// its targets.
func TestObjectStoreSection(t *testing.T) {
	r := fakeReport()
	r.ObjectStore = fakeObjectStore()
	r.finish(64)
	var b bytes.Buffer
	r.WriteTable(&b)
	out := b.String()
	for _, want := range []string{
		"object store (big): versitygw on loopback, 1.0 GiB uploaded in 10s, behind a proxy delaying each response's first byte 20ms (1% of them 200ms",
		"6 decode+hints, cold:        step p50 45.0ms",
		"1.20 object-store bytes per page byte (1000 distinct pages)",
		"200 single faults: p50 21.0ms, p95 25.0ms, p99 40.0ms",
		"4000 pages (0 resident before): 3980 resident at the deadline (99.5%), 20 late",
		"local shards (path 5) decode p50 2.50ms: mirror warm ×1.04",
		"met    big s3 mirror warm: hinted decode p50 ≤ 1.1× local engramfs+hints, 0 GETs",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}

	r.ObjectStore = &ObjectStoreReport{Skipped: "--no-s3"}
	b.Reset()
	r.WriteTable(&b)
	if !strings.Contains(b.String(), "\nobject store: skipped (--no-s3)\n") {
		t.Errorf("skipped run not said:\n%s", b.String())
	}
}

func TestNoObjectStore(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ObjectStore.Skip = true
	if rep := noObjectStore(&cfg); rep == nil || rep.Skipped != "--no-s3" {
		t.Errorf("--no-s3: %+v", rep)
	}
}

// The object-store run end to end on a tiny model: every measurement
// reads through the proxy (misses no faster than the injected first byte),
// the mirror is filled and then read, and the run's targets are judged.
func TestObjectStoreRunTiny(t *testing.T) {
	testenv.RequireFUSE(t)
	s3test.Binary(t)
	cfg := tinyConfig(t)
	cfg.Geometries = cfg.Geometries[:1] // big
	cfg.Paths = []PathID{PathHints}
	cfg.ObjectStore = ObjectStoreConfig{FirstByte: 5 * time.Millisecond, SlowFirstByte: 50 * time.Millisecond, SlowFraction: 0.05,
		PrefillLead: 300 * time.Millisecond, QueueDepth: 64, Misses: 30}
	rep := runTiny(t, cfg)
	o := rep.ObjectStore
	if o == nil || o.Skipped != "" || o.Failed != "" {
		t.Fatalf("object-store run: %+v", o)
	}
	for name, c := range map[string]*ObjectStoreDecode{"cold": o.Cold, "filling": o.Filling} {
		if c == nil || c.Phase.Stats == nil || c.Phase.Stats.S3Gets == 0 || c.BytesPerPage <= 0 || c.DistinctPages == 0 || c.Phase.Hint == nil {
			t.Errorf("%s decode: %+v", name, c)
		}
	}
	if m := o.Mirror; m == nil || m.Phase.Stats == nil || m.Phase.Stats.MirrorHits == 0 {
		t.Errorf("mirror warm decode: no mirror hits: %+v", m)
	}
	if ms := o.Misses; ms == nil || ms.Times.N != 30 || ms.Gets < 30 || ms.Times.P50 < cfg.ObjectStore.FirstByte {
		t.Errorf("cold misses: %+v; want 30, a GET each, none before the first byte (%v)", ms, cfg.ObjectStore.FirstByte)
	}
	if p := o.Prefill; p == nil || p.Pages == 0 || p.Resident+p.Late != p.Pages || p.Gets == 0 || p.Failed != "" || p.Settled <= 0 {
		t.Errorf("prefill deadline: %+v", p)
	}
	if o.Responses == 0 || o.LocalHints == 0 {
		t.Errorf("proxy responses %d, local path 5 reference %v", o.Responses, o.LocalHints)
	}
	ids := map[string]bool{}
	for _, tg := range rep.Targets {
		ids[tg.ID] = true
	}
	for _, id := range []string{TargetS3BytesPerPage, TargetS3Prefill, TargetS3Mirror, TargetS3MissP50, TargetS3MissTail} {
		if !ids[id] {
			t.Errorf("target %s not judged", id)
		}
	}
}

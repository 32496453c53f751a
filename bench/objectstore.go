package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/engramfs/engramfs/backing/s3source/s3serve"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/pagecache"
)

// ObjectStoreConfig is the object-store run: the big geometry's model
// uploaded to versitygw on loopback, served through a proxy that delays
// every response's first byte as an object store does, and mounted as
// s3://. Every field's default is in DefaultObjectStore.
type ObjectStoreConfig struct {
	// Skip turns the run off (--no-s3). Without versitygw it is skipped
	// anyway, with a note.
	Skip bool
	// FirstByte is the injected time to first byte (20 ms, S3 Standard's
	// typical); SlowFraction of the responses (1%) get SlowFirstByte
	// (200 ms) instead: the tail that hedged GETs exist for.
	FirstByte     time.Duration
	SlowFirstByte time.Duration
	SlowFraction  float64
	// PrefillLead is how long before its deadline the prefill chunk is
	// hinted (2 s).
	PrefillLead time.Duration
	// PrefillRows bounds the rows of each layer of that chunk (2,048: about
	// 4,700 pages with the big geometry, the size the target names; a
	// whole 8,192-token chunk is ~64K pages, which no queue depth an object
	// store allows one prefix fetches in 2 s). 0: the whole chunk.
	PrefillRows int
	// QueueDepth is the daemon's --queue-depth on the object store (256,
	// the daemon's own default for s3://); the local paths keep theirs.
	QueueDepth int
	// Misses is how many cold decode misses (single faults, no hint) are
	// timed (200).
	Misses int
}

// DefaultObjectStore is the object store: 20 ms to first byte, 1%
// at 200 ms, a prefill chunk hinted 2 s ahead.
func DefaultObjectStore() ObjectStoreConfig {
	return ObjectStoreConfig{FirstByte: 20 * time.Millisecond, SlowFirstByte: 200 * time.Millisecond, SlowFraction: 0.01,
		PrefillLead: 2 * time.Second, PrefillRows: 2048, QueueDepth: 256, Misses: 200}
}

// ObjectStoreReport is what the object-store run measured on the big
// geometry.
type ObjectStoreReport struct {
	Skipped string `json:"skipped,omitempty"`
	Failed  string `json:"failed,omitempty"` // the error that stopped the run (the bench goes on)

	Geometry      string        `json:"geometry"`
	URL           string        `json:"url"`
	Versitygw     string        `json:"versitygw"`
	UploadBytes   int64         `json:"upload_bytes"`
	Upload        time.Duration `json:"upload_ns"`
	FirstByte     time.Duration `json:"first_byte_ns"`
	SlowFirstByte time.Duration `json:"slow_first_byte_ns"`
	SlowFraction  float64       `json:"slow_fraction"`
	// Responses the proxy delayed over the whole run, and of them the slow.
	Responses     uint64 `json:"proxy_responses"`
	SlowResponses uint64 `json:"proxy_slow_responses"`

	Cold    *ObjectStoreDecode `json:"decode_cold,omitempty"`      // 6: decode with hints + read barrier, cold
	Misses  *ColdMisses        `json:"cold_misses,omitempty"`      // single cold faults, no hints
	Prefill *PrefillDeadline   `json:"prefill_deadline,omitempty"` // 8: one chunk hinted ahead of its deadline
	Filling *ObjectStoreDecode `json:"mirror_fill,omitempty"`      // 7: the pass that fills the mirror
	Mirror  *ObjectStoreDecode `json:"decode_mirror,omitempty"`    // 7: decode again, remounted over that mirror
	// LocalHints is the decode p50 of path 5 (local shards) in the same
	// run: the mirror's reference (0: path 5 did not run).
	LocalHints time.Duration `json:"local_hints_decode_p50_ns,omitempty"`
}

// ObjectStoreDecode is the decode workload with hints on the s3:// mount.
type ObjectStoreDecode struct {
	Phase         *Phase  `json:"phase"`
	DistinctPages int64   `json:"distinct_pages"` // 4 KiB pages the decode rows need, all steps
	GetsPerStep   float64 `json:"gets_per_step"`
	// BytesPerPage is s3_get_bytes over DistinctPages × 4 KiB: what the
	// store sent per byte of page the workload needed.
	BytesPerPage float64 `json:"s3_bytes_per_page_byte"`
}

// ColdMisses is the time of single cold page faults on the s3:// mount:
// decode rows that were not hinted.
type ColdMisses struct {
	Times  Summary       `json:"times"`
	P95    time.Duration `json:"p95_ns"`
	Gets   uint64        `json:"gets"`
	Hedges uint64        `json:"hedges"`
}

// PrefillDeadline is one prefill chunk hinted Lead before its deadline:
// which of its pages were in the page cache at the deadline (mincore).
type PrefillDeadline struct {
	Lead           time.Duration `json:"lead_ns"`
	Pages          int           `json:"pages"`           // distinct 4 KiB pages of the chunk (all tables)
	ResidentBefore int           `json:"resident_before"` // already in the page cache when hinted (0 when cold)
	Resident       int           `json:"resident"`        // at the deadline
	Late           int           `json:"late"`            // not resident at the deadline
	Fraction       float64       `json:"fraction_resident"`
	Settled        time.Duration `json:"settled_ns"` // hints sent -> the read barrier returned
	Gets           uint64        `json:"gets"`
	GetBytes       uint64        `json:"get_bytes"`
	BytesPerPage   float64       `json:"s3_bytes_per_page_byte"`
	Dropped        uint64        `json:"prefetch_pages_dropped"`
	// GetFloor is the least time those GETs take at the daemon's queue depth
	// (its most GETs in flight), each waiting one first byte.
	GetFloor time.Duration `json:"get_floor_ns"`
	Failed   string        `json:"barrier_failed,omitempty"`
}

// noObjectStore says why the object-store run did not happen, or nil when
// it may.
func noObjectStore(cfg *Config) *ObjectStoreReport {
	if cfg.ObjectStore.Skip {
		return &ObjectStoreReport{Skipped: "--no-s3"}
	}
	if _, err := s3serve.Binary(); err != nil {
		return &ObjectStoreReport{Skipped: err.Error()}
	}
	if err := daemonproc.CanMount(); err != nil {
		return &ObjectStoreReport{Skipped: fmt.Sprintf("no FUSE: %v", err)}
	}
	if cfg.Binary == "" {
		return &ObjectStoreReport{Skipped: "no engramfs binary for the daemon"}
	}
	return nil
}

// objectStore runs the object-store measurements on this geometry. It
// returns an error only when ctx ends; any other failure is in the
// report's Failed.
func (r *geomRun) objectStore(ctx context.Context) (*ObjectStoreReport, error) {
	if rep := noObjectStore(r.cfg); rep != nil {
		return rep, nil
	}
	oc := r.cfg.ObjectStore
	rep := &ObjectStoreReport{Geometry: r.g.Name, FirstByte: oc.FirstByte, SlowFirstByte: oc.SlowFirstByte, SlowFraction: oc.SlowFraction}
	err := r.objectStoreRun(ctx, rep)
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	if err != nil {
		rep.Failed = err.Error()
		r.prog.printf("%s object store FAILED: %v", r.g.Name, err)
	}
	return rep, nil
}

func (r *geomRun) objectStoreRun(ctx context.Context, rep *ObjectStoreReport) (err error) {
	oc := r.cfg.ObjectStore
	bin, err := s3serve.Binary()
	if err != nil {
		return err
	}
	rep.Versitygw = bin
	// Beside the models: the upload is as big as the model, too big for a
	// small /tmp.
	tmp, err := os.MkdirTemp(r.cfg.ModelRoot, "s3-run-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	root := filepath.Join(tmp, "store")
	if err := os.Mkdir(root, 0o700); err != nil {
		return err
	}
	r.prog.setPhase("%s object store: starting versitygw", r.g.Name)
	srv, err := s3serve.Start(bin, root)
	if err != nil {
		return err
	}
	defer srv.Stop()
	if err := srv.Bucket(ctx, "models"); err != nil {
		return err
	}
	r.prog.setPhase("%s object store: uploading the model", r.g.Name)
	t0 := time.Now()
	rep.URL, rep.UploadBytes, err = srv.Upload(ctx, r.modelDir, "models", "bench/"+filepath.Base(r.modelDir), func(name string) bool {
		return strings.HasSuffix(name, ".safetensors") || strings.HasSuffix(name, ".safetensors.index.json")
	})
	if err != nil {
		return err
	}
	rep.Upload = time.Since(t0)
	r.prog.printf("uploaded %s to versitygw in %v", fmtBytes(float64(rep.UploadBytes)), rep.Upload.Round(100*time.Millisecond))

	// In a child process: this one faults pages whose GETs go through the
	// proxy (see s3serve.StartLatencyProxy).
	proxy, err := s3serve.StartLatencyProxy(srv.Endpoint, s3serve.Latency{
		FirstByte: oc.FirstByte, SlowFirstByte: oc.SlowFirstByte, SlowFraction: oc.SlowFraction, Seed: r.cfg.Seed})
	if err != nil {
		return err
	}
	defer func() {
		var cerr error
		rep.Responses, rep.SlowResponses, cerr = proxy.Responses()
		err = errors.Join(err, cerr, proxy.Close())
	}()
	env := slices.Concat(r.env, s3serve.Env())
	// withDaemon runs body on a fresh mount and stops it after.
	withDaemon := func(extra []string, body func(d *daemonproc.Daemon) error) (err error) {
		// A later --queue-depth overrides the local paths' one.
		flags := slices.Concat(r.flags, []string{"--s3-endpoint", proxy.URL, "--queue-depth", strconv.Itoa(max(oc.QueueDepth, 1))}, extra)
		d, err := startDaemon(ctx, r.cfg.Binary, r.cfg.MountDir, flags, env, rep.URL)
		if err != nil {
			return err
		}
		defer func() {
			if serr := d.Stop(); serr != nil {
				err = errors.Join(err, fmt.Errorf("object store: stopping the daemon: %w", serr))
			}
		}()
		if err := body(d); err != nil {
			return fmt.Errorf("%w\n%s", err, d.Log())
		}
		return nil
	}

	// 6: decode with hints, cold; then single cold faults on the same mount.
	if err := withDaemon(nil, func(d *daemonproc.Daemon) (err error) {
		if rep.Cold, err = r.objectStoreDecode(ctx, d, "decode, cold"); err != nil {
			return err
		}
		rep.Misses, err = r.coldMisses(ctx, d)
		return err
	}); err != nil {
		return err
	}

	// 8: a prefill chunk hinted ahead of its deadline, on a fresh mount.
	if err := withDaemon(nil, func(d *daemonproc.Daemon) (err error) {
		rep.Prefill, err = r.prefillDeadline(ctx, d)
		return err
	}); err != nil {
		return err
	}

	// 7: a pass fills the mirror; remounted over it, the same decode.
	mirror := []string{"--s3-mirror", filepath.Join(tmp, "mirror"), "--s3-mirror-size", fmt.Sprintf("%dMiB", rep.UploadBytes>>20+64)}
	if err := withDaemon(mirror, func(d *daemonproc.Daemon) (err error) {
		rep.Filling, err = r.objectStoreDecode(ctx, d, "decode, filling the mirror")
		return err
	}); err != nil {
		return err
	}
	return withDaemon(mirror, func(d *daemonproc.Daemon) (err error) {
		rep.Mirror, err = r.objectStoreDecode(ctx, d, "decode, mirror warm")
		return err
	})
}

// objectStoreDecode runs path 5's decode phase on the s3:// mount d.
func (r *geomRun) objectStoreDecode(ctx context.Context, d *daemonproc.Daemon, name string) (*ObjectStoreDecode, error) {
	open := func() (*gatherSet, error) { return openMount(r.model, d.Mountpoint, r.cfg.Seed) }
	ph, err := r.phase(ctx, PathHints, "object store: "+name, d, open, func(gs *gatherSet, ph *Phase) error {
		return r.decodeBody(ctx, PathHints, d, gs, ph, nil, open)
	})
	if err != nil {
		return nil, err
	}
	pc := NewPageCounter(r.model)
	var pages int64
	for _, step := range r.decode {
		for j, rows := range step {
			pages += int64(pc.Add(r.model.Layers[j], rows))
		}
	}
	out := &ObjectStoreDecode{Phase: ph, DistinctPages: pages}
	if ph.Stats != nil {
		out.GetsPerStep = float64(ph.Stats.S3Gets) / float64(len(r.decode))
		out.BytesPerPage = float64(ph.Stats.S3GetBytes) / float64(pages*4096)
	}
	return out, nil
}

// coldMisses times single faults on cold pages of layer 0's widest table
// (a page a row in the big geometry) that the decode did not touch: one
// GET each, on the demand path, hedged after the recent p97.
func (r *geomRun) coldMisses(ctx context.Context, d *daemonproc.Daemon) (_ *ColdMisses, err error) {
	defer guardFaults(&err)()
	n := r.cfg.ObjectStore.Misses
	if n <= 0 {
		return nil, nil
	}
	r.prog.setPhase("%s object store: %d cold decode misses", r.g.Name, n)
	gs, err := openMount(r.model, d.Mountpoint, r.cfg.Seed)
	if err != nil {
		return nil, err
	}
	defer gs.close()
	src := gs.layers[0][0]
	for _, s := range gs.layers[0] {
		if s.t.RowBytes > src.t.RowBytes {
			src = s
		}
	}
	touched := NewPageCounter(r.model)
	for _, step := range r.decode {
		touched.Add(r.model.Layers[0], step[0])
	}
	before, err := d.Stats()
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(r.cfg.Seed, 0x5e3))
	vec := make([]byte, 1)
	times := make([]time.Duration, 0, n)
	for tries := 0; len(times) < n && tries < 100*n; tries++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		row := rng.Uint64N(src.t.Rows)
		page, _ := src.t.RowPages(row)
		if _, seen := touched.seen[pageKey{src.t.ID, page}]; seen {
			continue
		}
		touched.seen[pageKey{src.t.ID, page}] = struct{}{}
		p := src.data[page*4096 : page*4096+4096]
		if err := pagecache.Mincore(p, vec); err != nil {
			return nil, fmt.Errorf("mincore: %w", err)
		}
		if vec[0]&1 != 0 {
			continue // in the page cache already: not a miss
		}
		start := time.Now()
		missSink ^= p[src.rowOff(row)-int64(page*4096)]
		times = append(times, time.Since(start))
	}
	after, err := d.Stats()
	if err != nil {
		return nil, err
	}
	return &ColdMisses{Times: Summarize(times), P95: Percentile(times, 95),
		Gets: after.S3Gets - before.S3Gets, Hedges: after.S3Hedges - before.S3Hedges}, nil
}

// missSink keeps the compiler from dropping the loads that fault a miss in
// (a load whose value no one uses is dead code).
var missSink byte

// prefillDeadline hints the first prefill chunk on the cold mount d, waits
// until PrefillLead after the hints went out, and counts the chunk's pages
// that are in the page cache then; then it waits for the barrier.
func (r *geomRun) prefillDeadline(ctx context.Context, d *daemonproc.Daemon) (*PrefillDeadline, error) {
	lead := r.cfg.ObjectStore.PrefillLead
	r.prog.setPhase("%s object store: prefill chunk hinted %v ahead: dropping caches", r.g.Name, lead)
	files := r.shardFiles()
	for _, t := range r.model.Tables {
		files = append(files, filepath.Join(d.Mountpoint, t.Path()))
	}
	if _, err := r.drop.drop(files); err != nil {
		return nil, err
	}
	gs, err := openMount(r.model, d.Mountpoint, r.cfg.Seed)
	if err != nil {
		return nil, err
	}
	defer gs.close()
	chunk := r.prefill[0]
	if n := r.cfg.ObjectStore.PrefillRows; n > 0 {
		chunk = slices.Clone(chunk)
		for j := range chunk {
			chunk[j] = chunk[j][:min(n, len(chunk[j]))]
		}
	}
	// The chunk's pages, per mapping.
	type want struct {
		src   *rowSource
		pages map[int64]struct{}
	}
	var wants []want
	total := 0
	for j, rows := range chunk {
		for _, src := range gs.layers[j] {
			w := want{src, map[int64]struct{}{}}
			for _, row := range rows {
				off := src.rowOff(row)
				for p := off / 4096; p <= (off+src.t.RowBytes-1)/4096; p++ {
					w.pages[p] = struct{}{}
				}
			}
			total += len(w.pages)
			wants = append(wants, w)
		}
	}
	resident := func() (int, error) {
		n := 0
		for _, w := range wants {
			res, err := pagecache.Resident(w.src.data)
			if err != nil {
				return 0, fmt.Errorf("mincore: %w", err)
			}
			for p := range w.pages {
				if res[p] {
					n++
				}
			}
		}
		return n, nil
	}
	out := &PrefillDeadline{Lead: lead, Pages: total}
	if out.ResidentBefore, err = resident(); err != nil {
		return nil, err
	}
	h, err := openHinter(d.Mountpoint)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	before, err := d.Stats()
	if err != nil {
		return nil, err
	}
	r.prog.setPhase("%s object store: prefill chunk of %d pages hinted %v ahead", r.g.Name, total, lead)
	start := time.Now()
	for j, rows := range chunk {
		if err := h.Prefill(r.model.Layers[j], rows); err != nil {
			return nil, err
		}
	}
	select {
	case <-time.After(time.Until(start.Add(lead))):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if out.Resident, err = resident(); err != nil {
		return nil, err
	}
	out.Late = total - out.Resident
	out.Fraction = float64(out.Resident) / float64(total)
	if err := h.Wait(); err != nil {
		out.Failed = err.Error()
	}
	out.Settled = time.Since(start)
	after, err := d.Stats()
	if err != nil {
		return nil, err
	}
	out.Gets, out.GetBytes = after.S3Gets-before.S3Gets, after.S3GetBytes-before.S3GetBytes
	out.BytesPerPage = float64(out.GetBytes) / float64(total*4096)
	out.Dropped = after.PrefetchPagesDropped - before.PrefetchPagesDropped
	if qd := uint64(max(r.cfg.ObjectStore.QueueDepth, 1)); out.Gets > 0 {
		out.GetFloor = time.Duration((out.Gets+qd-1)/qd) * r.cfg.ObjectStore.FirstByte
	}
	return out, nil
}

// The object-store targets' IDs.
const (
	TargetS3BytesPerPage = "s3-bytes-per-page"   // object-store bytes per distinct cold 4 KiB page ≤ 1.25
	TargetS3Prefill      = "s3-prefill-deadline" // a chunk hinted 2 s ahead ≥ 99% resident by its deadline
	TargetS3Mirror       = "s3-mirror-vs-local"  // mirror warm: hinted decode p50 ≤ 1.1× local shards, 0 GETs
	TargetS3MissP50      = "s3-miss-p50"         // a cold decode miss p50 ≤ first byte + 2 ms
	TargetS3MissTail     = "s3-miss-p99-vs-p95"  // its p99 ≤ 2× its p95
)

// The object-store targets' bounds.
const (
	s3BytesBound   = 1.25
	s3PrefillBound = 0.99
	s3MirrorBound  = 1.1
	missOverhead   = 2 * time.Millisecond // what a miss may cost beyond the first byte
	s3TailBound    = 2.0
)

// objectStoreTargets judges the object-store targets: what ran. The
// mirror's reference is path 5's decode p50 on the same geometry.
func (r *Report) objectStoreTargets() []Target {
	o := r.ObjectStore
	if o == nil || o.Skipped != "" {
		return nil
	}
	for _, g := range r.Geometries {
		if g.Geometry.Name == o.Geometry {
			if p := g.path(PathHints); p != nil && p.Decode != nil {
				o.LocalHints = p.Decode.Times.P50
			}
		}
	}
	var out []Target
	add := func(t Target, met bool) {
		t.Geometry = o.Geometry + " s3"
		t.Met = met && t.Value > 0 && t.Unmet == ""
		out = append(out, t)
	}
	if c := o.Cold; c != nil && c.Phase.Stats != nil {
		add(Target{ID: TargetS3BytesPerPage, Name: "object-store bytes / distinct cold 4 KiB page (decode, hints)",
			Value: c.BytesPerPage, Bound: s3BytesBound,
			Detail: fmt.Sprintf("%s for %d pages, %.1f GETs a step", fmtBytes(float64(c.Phase.Stats.S3GetBytes)), c.DistinctPages, c.GetsPerStep)},
			c.BytesPerPage <= s3BytesBound)
	}
	if p := o.Prefill; p != nil {
		add(Target{ID: TargetS3Prefill, Name: fmt.Sprintf("prefill chunk hinted %v ahead: resident by its deadline", p.Lead), AtLeast: true,
			Value: p.Fraction, Bound: s3PrefillBound,
			Detail: fmt.Sprintf("%d of %d pages, %d late; all settled after %s (its %d GETs need %s at the least)", p.Resident, p.Pages, p.Late, fmtDur(p.Settled), p.Gets, fmtDur(p.GetFloor))},
			p.Fraction >= s3PrefillBound)
	}
	if m := o.Mirror; m != nil && m.Phase.Stats != nil {
		t := Target{ID: TargetS3Mirror, Name: fmt.Sprintf("mirror warm: hinted decode p50 ≤ %.1f× local engramfs+hints, 0 GETs", s3MirrorBound),
			Bound: s3MirrorBound}
		gets := m.Phase.Stats.S3Gets
		if o.LocalHints > 0 {
			t.Value = ratio(float64(m.Phase.Times.P50), float64(o.LocalHints))
			t.Detail = fmt.Sprintf("%s vs %s; %d GETs, %d mirror hits", fmtDur(m.Phase.Times.P50), fmtDur(o.LocalHints), gets, m.Phase.Stats.MirrorHits)
		} else {
			t.Unmet = "path 5 (engramfs-hints) did not run on the local shards"
			t.Detail = fmt.Sprintf("%s; %d GETs", fmtDur(m.Phase.Times.P50), gets)
		}
		add(t, t.Value <= s3MirrorBound && gets == 0)
	}
	if ms := o.Misses; ms != nil && ms.Times.N > 0 {
		add(Target{ID: TargetS3MissP50, Name: fmt.Sprintf("cold decode miss p50 ≤ first byte + %v", missOverhead),
			Value: ratio(float64(ms.Times.P50), float64(o.FirstByte+missOverhead)), Bound: 1,
			Detail: fmt.Sprintf("%s vs %s (%d misses, %d GETs, %d hedges)", fmtDur(ms.Times.P50), fmtDur(o.FirstByte+missOverhead), ms.Times.N, ms.Gets, ms.Hedges)},
			ms.Times.P50 <= o.FirstByte+missOverhead)
		tail := ratio(float64(ms.Times.P99), float64(ms.P95))
		add(Target{ID: TargetS3MissTail, Name: "cold decode miss p99 ≤ 2× its p95",
			Value: tail, Bound: s3TailBound,
			Detail: fmt.Sprintf("p99 %s, p95 %s, max %s", fmtDur(ms.Times.P99), fmtDur(ms.P95), fmtDur(ms.Times.Max))},
			tail <= s3TailBound)
	}
	return out
}

// writeObjectStore prints the object-store section of the report.
func (r *Report) writeObjectStore(w io.Writer) {
	o := r.ObjectStore
	if o == nil {
		return
	}
	fmt.Fprintf(w, "\nobject store")
	switch {
	case o.Skipped != "":
		fmt.Fprintf(w, ": skipped (%s)\n", o.Skipped)
		return
	case o.URL == "" && o.Failed != "":
		first, _, _ := strings.Cut(o.Failed, "\n")
		fmt.Fprintf(w, ": FAILED: %s\n", first)
		return
	}
	fmt.Fprintf(w, " (%s): versitygw on loopback, %s uploaded in %v, behind a proxy delaying each response's first byte %v (%.3g%% of them %v; %d responses, %d slow)\n",
		o.Geometry, fmtBytes(float64(o.UploadBytes)), o.Upload.Round(100*time.Millisecond), o.FirstByte, 100*o.SlowFraction, o.SlowFirstByte, o.Responses, o.SlowResponses)
	dec := func(label string, c *ObjectStoreDecode) {
		if c == nil {
			return
		}
		ph := c.Phase
		fmt.Fprintf(w, "  %-28s step p50 %s, p99 %s (hints + barrier p50 %s)", label, fmtDur(ph.Times.P50), fmtDur(ph.Times.P99), fmtDur(ph.Hint.P50))
		if s := ph.Stats; s != nil {
			fmt.Fprintf(w, "; %.1f GETs a step (%d hedges, %d retries), %.2f object-store bytes per page byte (%d distinct pages); %d mirror hits",
				c.GetsPerStep, s.S3Hedges, s.S3Retries, c.BytesPerPage, c.DistinctPages, s.MirrorHits)
		}
		fmt.Fprintln(w)
	}
	dec("6 decode+hints, cold:", o.Cold)
	if ms := o.Misses; ms != nil && ms.Times.N > 0 {
		fmt.Fprintf(w, "  %-28s %d single faults: p50 %s, p95 %s, p99 %s, max %s; %d GETs, %d hedges\n", "  cold decode misses:",
			ms.Times.N, fmtDur(ms.Times.P50), fmtDur(ms.P95), fmtDur(ms.Times.P99), fmtDur(ms.Times.Max), ms.Gets, ms.Hedges)
	}
	if p := o.Prefill; p != nil {
		fmt.Fprintf(w, "  %-28s %d pages (%d resident before): %d resident at the deadline (%.1f%%), %d late; barrier after %s; %d GETs (%s at the least, one first byte per queue depth of them), %.2f object-store bytes per page byte, %d dropped",
			fmt.Sprintf("8 prefill hinted %v ahead:", p.Lead), p.Pages, p.ResidentBefore, p.Resident, 100*p.Fraction, p.Late, fmtDur(p.Settled), p.Gets, fmtDur(p.GetFloor), p.BytesPerPage, p.Dropped)
		if p.Failed != "" {
			fmt.Fprintf(w, "; barrier FAILED: %s", p.Failed)
		}
		fmt.Fprintln(w)
	}
	dec("7 mirror: filling pass:", o.Filling)
	dec("  remounted, mirror warm:", o.Mirror)
	if o.Mirror != nil && o.LocalHints > 0 {
		fmt.Fprintf(w, "  %-28s local shards (path 5) decode p50 %s: mirror warm ×%.2f\n", "", fmtDur(o.LocalHints),
			ratio(float64(o.Mirror.Phase.Times.P50), float64(o.LocalHints)))
	}
	if o.Failed != "" {
		first, _, _ := strings.Cut(o.Failed, "\n")
		fmt.Fprintf(w, "  FAILED: %s\n", first)
	}
}

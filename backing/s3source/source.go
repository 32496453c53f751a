// Package s3source serves a model's files from an object store (S3, Ceph
// RGW, MinIO, SeaweedFS, versitygw): s3://bucket/prefix.
//
// It asks for the bytes the loader asks for and no more (no readahead: a
// 4 KiB page costs one ranged GET of 4 KiB, where object-store filesystems
// move 1-4 MiB per random read), merges reads submitted together that lie
// within MergeGap of each other into one GET, serves demand reads (faults)
// before queued prefetch reads, hedges demand GETs that have no first byte
// after the recent p97, and retries what a store fails transiently.
// Every GET is conditional on the ETag seen at mount (If-Match): an object
// rewritten under a live mount fails with backing.ErrShardChanged, never
// with new or mixed bytes.
package s3source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// Config is how the source reads. DefaultConfig holds the defaults.
type Config struct {
	Client ClientConfig
	// Concurrency is the most GETs in flight, hedges included (default 64).
	Concurrency int
	// MergeGap: reads submitted together at most this far apart are one GET
	// (default 64 KiB); MaxGet bounds a merged GET (default 1 MiB).
	MergeGap, MaxGet int64
	// MergeWaste bounds the bytes a merge fetches that no read asked for
	// (the gaps), as a fraction of the bytes the GET's reads want (default
	// 0.25: at most 1.25 bytes fetched per byte wanted; negative: no gap is
	// fetched, only adjacent and overlapping reads are merged).
	MergeWaste float64
	// Attempts bounds the GETs of one read: the first and its retries
	// (default 4). Backoff is the first retry's wait, doubled each time
	// (default 20 ms), with jitter.
	Attempts int
	Backoff  time.Duration
	// AttemptTimeout bounds one GET, body included (default 30 s).
	AttemptTimeout time.Duration
	// StallTimeout bounds the wait for a GET's headers, and then for each
	// next byte of its body (default 2 s): a GET that makes no progress
	// for that long is given up and retried. A body that stalled after its
	// headers was never hedged (a hedge waits for a first byte only) and
	// cost the whole attempt timeout: one mount took 30 s, 600 serial
	// reads 200 s.
	StallTimeout time.Duration
	// HedgeFloor is the least wait for a first byte before a hedge
	// (default 5 ms); HedgePercent bounds hedges to this percentage of GETs
	// (default 5). HedgePercent 0 turns hedging off.
	HedgeFloor   time.Duration
	HedgePercent uint64
	// Mirror is the local SSD mirror of fetched pages (off by default).
	Mirror MirrorConfig
}

// DefaultConfig returns the defaults of Config.
func DefaultConfig() Config {
	return Config{
		Concurrency: 64, MergeGap: 64 << 10, MaxGet: 1 << 20, MergeWaste: 0.25,
		Attempts: 4, Backoff: 20 * time.Millisecond, AttemptTimeout: 30 * time.Second, StallTimeout: 2 * time.Second,
		HedgeFloor: 5 * time.Millisecond, HedgePercent: 5,
	}
}

// Source is a model directory in an object store: the objects directly
// under s3://bucket/prefix/.
type Source struct {
	url    string // s3://bucket/prefix, for messages; no credentials
	prefix string // "" or ending in "/"
	c      objectClient
	cfg    Config
	st     *stats.Counters

	slots  *slots // a slot per GET in flight; demand GETs first
	lat    latency
	budget hedgeBudget

	mir    *mirror  // nil: no mirror
	fill   *filler  // nil: no fill lane
	opened shardSet // the open shards with a mirror
}

var _ backing.Source = (*Source)(nil)

// IsURL reports whether a MODEL_DIR argument names an object store.
func IsURL(s string) bool { return strings.HasPrefix(s, "s3://") }

// ParseURL splits s3://bucket/prefix.
func ParseURL(s string) (bucket, prefix string, err error) {
	rest, ok := strings.CutPrefix(s, "s3://")
	if !ok {
		return "", "", fmt.Errorf("%q: not an s3://bucket/prefix URL", s)
	}
	bucket, prefix, _ = strings.Cut(rest, "/")
	if bucket == "" {
		return "", "", fmt.Errorf("%q: no bucket", s)
	}
	prefix = strings.Trim(prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	return bucket, prefix, nil
}

// New opens the source named by url (s3://bucket/prefix). st counts its
// requests; it may be nil.
func New(ctx context.Context, url string, cfg Config, st *stats.Counters) (*Source, error) {
	bucket, prefix, err := ParseURL(url)
	if err != nil {
		return nil, err
	}
	cfg = withDefaults(cfg)
	cfg.Client.Conns = cfg.Concurrency
	c, err := newSDKClient(ctx, bucket, cfg.Client)
	if err != nil {
		return nil, err
	}
	return newSource(c, bucket, prefix, cfg, st)
}

func withDefaults(cfg Config) Config {
	d := DefaultConfig()
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = d.Concurrency
	}
	if cfg.MaxGet <= 0 {
		cfg.MaxGet = d.MaxGet
	}
	if cfg.MergeGap < 0 {
		cfg.MergeGap = 0
	}
	switch {
	case cfg.MergeWaste == 0:
		cfg.MergeWaste = d.MergeWaste
	case cfg.MergeWaste < 0:
		cfg.MergeWaste = 0
	}
	if cfg.Attempts <= 0 {
		cfg.Attempts = d.Attempts
	}
	if cfg.Backoff <= 0 {
		cfg.Backoff = d.Backoff
	}
	if cfg.AttemptTimeout <= 0 {
		cfg.AttemptTimeout = d.AttemptTimeout
	}
	if cfg.StallTimeout <= 0 {
		cfg.StallTimeout = d.StallTimeout
	}
	if cfg.HedgeFloor <= 0 {
		cfg.HedgeFloor = d.HedgeFloor
	}
	return cfg
}

func newSource(c objectClient, bucket, prefix string, cfg Config, st *stats.Counters) (*Source, error) {
	if st == nil {
		st = &stats.Counters{}
	}
	cfg = withDefaults(cfg)
	s := &Source{
		url: "s3://" + bucket + "/" + strings.TrimSuffix(prefix, "/"), prefix: prefix,
		c: c, cfg: cfg, st: st, slots: newSlots(cfg.Concurrency),
	}
	s.lat.floor = cfg.HedgeFloor
	if cfg.Mirror.Dir != "" {
		m, err := openMirror(cfg.Mirror, st)
		if err != nil {
			return nil, err
		}
		s.mir = m
		if cfg.Mirror.FillRate > 0 {
			s.fill = newFiller(s, cfg.Mirror.FillRate)
		}
	}
	return s, nil
}

// Close stops the mirror's writer once the pages queued are written, and
// releases the mirror directory. Shards must be closed first.
func (s *Source) Close() error {
	if s.mir == nil {
		return nil
	}
	if s.fill != nil {
		s.fill.stop()
	}
	return s.mir.close()
}

func (s *Source) String() string { return strings.TrimSuffix(s.url, "/") }

// Config is how the source reads, its defaults filled in.
func (s *Source) Config() Config { return s.cfg }

// List lists the objects directly under the prefix whose names end in
// suffix, sorted.
func (s *Source) List(suffix string) ([]string, error) {
	keys, err := s.c.List(context.Background(), s.prefix)
	if err != nil {
		return nil, fmt.Errorf("model %s: %w", s, err)
	}
	var names []string
	for _, k := range keys {
		name, ok := strings.CutPrefix(k, s.prefix)
		if ok && name != "" && !strings.Contains(name, "/") && strings.HasSuffix(name, suffix) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names, nil
}

// ReadFile reads a small object whole: a HEAD, then one GET conditional on
// the ETag the HEAD saw.
func (s *Source) ReadFile(name string, limit int64) ([]byte, error) {
	sh, err := s.open(name, false)
	if err != nil {
		return nil, err
	}
	defer sh.Close()
	if sh.id.Size > limit {
		return nil, fmt.Errorf("%s: %d bytes, over the limit of %d", sh.url(), sh.id.Size, limit)
	}
	if sh.id.Size == 0 {
		return []byte{}, nil
	}
	return sh.fetch(0, sh.id.Size, true, false)
}

// Open opens shard name: one HEAD for its size and ETag; and its mirror,
// discarded if it mirrors other bytes.
func (s *Source) Open(name string) (backing.ShardFile, error) {
	return s.open(name, true)
}

func (s *Source) open(name string, mirrored bool) (*shard, error) {
	if !validName(name) {
		return nil, fmt.Errorf("%s/%s: not a name inside the model", s, name)
	}
	key := s.prefix + name
	size, etag, err := s.c.Head(context.Background(), key)
	if err != nil {
		return nil, fmt.Errorf("%s/%s: %w", s, name, err) // fs.ErrNotExist stays visible
	}
	var mf *mirrorFile
	if mirrored && s.mir != nil && size > 0 {
		if mf, err = s.mir.open(name, size, etag); err != nil {
			return nil, fmt.Errorf("%s/%s: %w", s, name, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	sh := &shard{src: s, name: name, key: key, id: backing.Identity{Size: size, ETag: etag}, mir: mf, ctx: ctx, cancel: cancel}
	if mf != nil {
		s.opened.add(sh)
		if s.fill != nil {
			s.fill.opened()
		}
	}
	return sh, nil
}

// validName accepts names with directories that stay inside the model.
func validName(name string) bool {
	for _, part := range strings.Split(name, "/") {
		if part == "" || part == "." || part == ".." {
			return false
		}
	}
	return true
}

// shard is one open object.
type shard struct {
	src  *Source
	name string
	key  string
	id   backing.Identity
	mir  *mirrorFile // nil: no mirror

	ctx    context.Context // canceled by Close: GETs in flight stop
	cancel context.CancelFunc

	// Close waits for the reads in flight, so none outlives the shard.
	mu       sync.RWMutex
	closed   bool // GUARDED_BY(mu)
	inflight sync.WaitGroup
}

var _ backing.ShardFile = (*shard)(nil)

func (sh *shard) url() string                { return sh.src.String() + "/" + sh.name }
func (sh *shard) Identity() backing.Identity { return sh.id }

// ReadAt reads synchronously (headers): from the mirror, or one GET in the
// demand lane (a caller waits), retried, not hedged.
func (sh *shard) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%s: negative offset %d", sh.url(), off)
	}
	if off >= sh.id.Size {
		return 0, io.EOF
	}
	n := min(int64(len(p)), sh.id.Size-off)
	if n == 0 {
		return 0, nil
	}
	if !sh.enter(1) {
		return 0, fmt.Errorf("%s: %w", sh.url(), backing.ErrClosed)
	}
	defer sh.inflight.Done()
	var data []byte
	if sh.mir != nil {
		data, _ = sh.mir.read(sh.id.ETag, off, int(n))
	}
	if data == nil {
		lo, hi := off, off+n
		if sh.mir != nil {
			lo, hi = sh.mirrorAligned(lo, hi)
		}
		buf, err := sh.fetch(lo, hi-lo, true, false)
		if err != nil {
			return 0, err
		}
		if sh.mir != nil {
			sh.mir.put(sh.id.ETag, lo, buf)
		}
		data = buf[off-lo : off-lo+n]
	}
	copy(p, data)
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// enter counts k reads in flight, unless the shard is closed.
func (sh *shard) enter(k int) bool {
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	if sh.closed {
		return false
	}
	sh.inflight.Add(k)
	return true
}

// Submit merges the reads into spans and starts a goroutine per span; it
// never waits for a GET (the spans wait for a slot).
func (sh *shard) Submit(reads ...*backing.ShardRead) {
	valid := make([]*backing.ShardRead, 0, len(reads))
	for _, r := range reads {
		switch {
		case r.Off < 0 || r.Len < 0 || r.Off > sh.id.Size || int64(r.Len) > sh.id.Size-r.Off:
			r.Done(nil, fmt.Errorf("%s: read [%d, +%d) outside its %d bytes", sh.url(), r.Off, r.Len, sh.id.Size))
		case r.Len == 0:
			r.Done([]byte{}, nil)
		default:
			valid = append(valid, r)
		}
	}
	if sh.mir != nil && len(valid) > 0 {
		valid = sh.submitMirrored(valid)
	}
	sh.submitGETs(valid)
}

// submitMirrored reads the reads wholly inside mirrored pages from the
// mirror, through the read engine local shards use (O_DIRECT where the
// mirror's filesystem allows); it returns the others. A read whose pages
// were evicted meanwhile, or whose read failed, gets a GET. Read one after
// another by a goroutine, a hinted decode step's ~100-150 hits took 10-15
// ms: the mirror-warm decode p50 was 15.7 ms against 5.9 ms over local
// shards, whose reads run 64 at a time; so do these.
func (sh *shard) submitMirrored(reads []*backing.ShardRead) []*backing.ShardRead {
	if !sh.enter(1) {
		return reads // submitGETs fails them
	}
	return sh.mir.submit(sh.id.ETag, reads,
		func(r *backing.ShardRead, data []byte) { r.Done(data, nil) },
		func(r *backing.ShardRead) { sh.submitGETs([]*backing.ShardRead{r}) },
		sh.inflight.Done)
}

// submitGETs merges reads into spans and starts a goroutine per span.
func (sh *shard) submitGETs(valid []*backing.ShardRead) {
	if len(valid) == 0 {
		return
	}
	spans := plan(valid, sh.src.cfg.MergeGap, sh.src.cfg.MaxGet, sh.src.cfg.MergeWaste)
	if sh.mir != nil {
		for i := range spans {
			lo, hi := sh.mirrorAligned(spans[i].off, spans[i].off+spans[i].n)
			spans[i].off, spans[i].n = lo, hi-lo
		}
	}
	if !sh.enter(len(spans)) {
		err := fmt.Errorf("%s: %w", sh.url(), backing.ErrClosed)
		for _, sp := range spans {
			sp.fail(err)
		}
		return
	}
	var bytes int64
	for _, sp := range spans {
		bytes += sp.n
	}
	sh.src.st.BackingReads.Add(uint64(len(spans)))
	sh.src.st.BackingBytes.Add(uint64(bytes))
	for _, sp := range spans {
		go sh.serve(sp)
	}
}

// mirrorAligned widens [lo, hi) to whole mirror pages of the object. The
// mirror keeps whole pages only, and a table's pages sit at offsets of the
// shard that are not page-aligned (its data starts after a header of any
// length): unwidened, a 4 KiB read of a table page covers no whole mirror
// page and is never mirrored (measured: 149 of 149 pages fetched again on
// the next mount). The cost is up to a page more per GET, with a mirror only.
func (sh *shard) mirrorAligned(lo, hi int64) (int64, int64) {
	return lo / mirrorPage * mirrorPage, min((hi+mirrorPage-1)/mirrorPage*mirrorPage, sh.id.Size)
}

// serve answers one span with one retried GET; a demand span (a reader
// is blocked on one of its reads) goes in the demand lane and is hedged.
func (sh *shard) serve(sp span) {
	defer sh.inflight.Done()
	buf, err := sh.fetch(sp.off, sp.n, sp.demand, sp.demand)
	if err != nil {
		sp.fail(err)
		return
	}
	if sh.mir != nil {
		sh.mir.put(sh.id.ETag, sp.off, buf)
	}
	sp.answer(buf)
}

// fetch GETs bytes [off, off+n), retrying what may succeed another time.
// demand picks the lane; hedge allows a hedged GET.
func (sh *shard) fetch(off, n int64, demand, hedge bool) ([]byte, error) {
	cfg := &sh.src.cfg
	for attempt := 1; ; attempt++ {
		buf, err := sh.get(off, n, demand, hedge)
		if err == nil {
			return buf, nil
		}
		switch {
		case sh.ctx.Err() != nil:
			return nil, fmt.Errorf("%s: %w", sh.url(), backing.ErrClosed)
		case errors.Is(err, errPrecondition):
			sh.src.st.S3ETagFailures.Add(1)
			if sh.mir != nil {
				sh.mir.invalidate(sh.id.ETag) // never old bytes from here on
			}
			return nil, fmt.Errorf("%s: offset %d: %w: %v (ETag at mount %s)", sh.url(), off, backing.ErrShardChanged, err, sh.id.ETag)
		case errors.Is(err, fs.ErrNotExist):
			if sh.mir != nil {
				sh.mir.invalidate(sh.id.ETag)
			}
			return nil, fmt.Errorf("%s: offset %d: %w: the object is gone: %v", sh.url(), off, backing.ErrShardChanged, err)
		case !errors.Is(err, errRetryable) || attempt >= cfg.Attempts:
			return nil, fmt.Errorf("%s: offset %d: %d attempts: %w", sh.url(), off, attempt, err)
		}
		sh.src.st.S3Retries.Add(1)
		wait := cfg.Backoff << (attempt - 1)
		wait = wait/2 + rand.N(wait/2+1)
		select {
		case <-time.After(wait):
		case <-sh.ctx.Done():
		}
	}
}

// attemptResult is the outcome of one GET.
type attemptResult struct {
	buf []byte
	err error
}

// errNoHedge: the hedge timer fired but the hedge budget or the slots
// allowed no hedge.
var errNoHedge = errors.New("no hedge")

// Hedge states of one get.
const (
	hedgeWaiting = iota // the GET has no answer yet: a hedge may start
	hedgeNever          // the GET is answering, or done: no hedge
	hedgeStarted        // the timer fired: a result (errNoHedge at least) will come
)

// get is one try at bytes [off, off+n): a GET in this goroutine and, when
// hedge is set and it has no answer after the adaptive p97, a second GET;
// the first to deliver the whole body wins and the other is canceled. A
// GET that is not hedged costs no goroutine, channel or timer.
func (sh *shard) get(off, n int64, demand, hedge bool) ([]byte, error) {
	s := sh.src
	crowds := s.slots.crowds.Load()
	inFlight, err := s.slots.acquire(sh.ctx, demand)
	if err != nil {
		return nil, err
	}
	tm := timing{class: -1} // prefetch GETs are never hedged: not sampled
	if demand {
		tm = timing{latencyClass(inFlight), crowds}
	}
	var delay time.Duration
	if hedge && s.cfg.HedgePercent > 0 {
		s.budget.earn(s.cfg.HedgePercent)
		delay = s.lat.delay(tm.class)
	}
	if delay == 0 {
		r := sh.attempt(sh.ctx, off, n, tm, nil)
		return r.buf, r.err
	}
	ctx, cancel := context.WithCancel(sh.ctx)
	defer cancel() // stops the loser
	var state atomic.Int32
	hedged := make(chan attemptResult, 1)
	timer := time.AfterFunc(delay, func() {
		if !state.CompareAndSwap(hedgeWaiting, hedgeStarted) {
			return
		}
		crowds := s.slots.crowds.Load()
		inFlight, ok := s.slots.tryAcquire()
		if !ok {
			hedged <- attemptResult{err: errNoHedge}
			return
		}
		if !s.budget.spend() {
			s.slots.release()
			hedged <- attemptResult{err: errNoHedge}
			return
		}
		s.st.S3Hedges.Add(1)
		sh.inflight.Add(1)
		go func() {
			defer sh.inflight.Done()
			r := sh.attempt(ctx, off, n, timing{latencyClass(inFlight), crowds}, nil)
			hedged <- r
			if r.err == nil {
				cancel() // the primary lost
			}
		}()
	})
	r := sh.attempt(ctx, off, n, tm, func() { state.CompareAndSwap(hedgeWaiting, hedgeNever) })
	timer.Stop()
	if state.CompareAndSwap(hedgeWaiting, hedgeNever) || state.Load() == hedgeNever || r.err == nil {
		return r.buf, r.err
	}
	// A hedge was tried and the primary failed.
	if sh.ctx.Err() == nil && ctx.Err() != nil { // canceled by the hedge, which won
		h := <-hedged
		return h.buf, h.err
	}
	if !errors.Is(r.err, errRetryable) {
		return nil, r.err // a changed object does not get better
	}
	h := <-hedged
	switch {
	case h.err == nil:
		return h.buf, nil
	case errors.Is(h.err, errPrecondition):
		return nil, h.err
	}
	return nil, r.err
}

// attempt runs one GET holding a slot (taken by the caller, released here)
// and reads the whole body; headers, when set, is called when the answer's
// headers arrived. The time to its first byte is a sample of tm's class.
func (sh *shard) attempt(ctx context.Context, off, n int64, tm timing, headers func()) attemptResult {
	s := sh.src
	defer s.slots.release()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.AttemptTimeout)
	defer cancel()
	stall := watchProgress(s.cfg.StallTimeout, cancel)
	defer stall.stop()
	s.st.S3Gets.Add(1)
	start := time.Now()
	body, err := s.c.GetRange(ctx, sh.key, off, n, sh.id.ETag)
	if err != nil {
		if ctx.Err() != nil && sh.ctx.Err() == nil {
			// Stopped by a hedge that won, or by its timeout: it had no
			// first byte for this long at least. Left out, the slowest
			// GETs would never be counted and the p97 would sink.
			s.sample(tm, start)
		}
		if stall.stalled() {
			return attemptResult{err: retryablef("GET %s: range [%d, +%d): no answer within %v", sh.key, off, n, s.cfg.StallTimeout)}
		}
		return attemptResult{err: timedOut(ctx, err)}
	}
	stall.progress()
	s.sample(tm, start)
	if headers != nil {
		headers()
	}
	buf := make([]byte, n)
	got, err := io.ReadFull(progressReader{body, stall}, buf)
	body.Close()
	s.st.S3GetBytes.Add(uint64(got))
	switch {
	case err != nil && stall.stalled():
		return attemptResult{err: retryablef("GET %s: range [%d, +%d): the body stalled at %d bytes: no byte for %v", sh.key, off, n, got, s.cfg.StallTimeout)}
	case err != nil:
		return attemptResult{err: timedOut(ctx, retryablef("GET %s: range [%d, +%d): body cut short at %d bytes: %v", sh.key, off, n, got, err))}
	}
	return attemptResult{buf: buf}
}

// progressWatch cancels a GET that makes no progress (headers, then body
// bytes) for its timeout.
type progressWatch struct {
	t       *time.Timer
	d       time.Duration
	expired atomic.Bool
}

func watchProgress(d time.Duration, cancel context.CancelFunc) *progressWatch {
	w := &progressWatch{d: d}
	w.t = time.AfterFunc(d, func() { w.expired.Store(true); cancel() })
	return w
}

// progress restarts the wait: something arrived.
func (w *progressWatch) progress() { w.t.Reset(w.d) }

func (w *progressWatch) stalled() bool { return w.expired.Load() }

func (w *progressWatch) stop() { w.t.Stop() }

// progressReader reports every read that brought bytes to its watch.
type progressReader struct {
	r io.Reader
	w *progressWatch
}

func (p progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		p.w.progress()
	}
	return n, err
}

// timing is how a GET's first byte is sampled: the latency class it
// started in (-1: not sampled) and the slots' crowds count before it.
type timing struct {
	class  int
	crowds uint64
}

// sample records the time since start to a GET's first byte (or to its
// end without one). A GET that started alone but saw a crowd form before
// its first byte counts as busy: a decode step's first GETs start with
// few in flight and wait as long as the rest of the step's.
func (s *Source) sample(tm timing, start time.Time) {
	if tm.class < 0 {
		return
	}
	c := tm.class
	if s.slots.crowds.Load() != tm.crowds {
		c = latencyBusy
	}
	now := time.Now()
	s.lat.add(c, now.Sub(start), now)
}

// timedOut makes a GET that hit its own deadline retryable.
func timedOut(ctx context.Context, err error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) && !errors.Is(err, errRetryable) {
		return retryable(err)
	}
	return err
}

// Close fails later reads with ErrClosed, cancels the GETs in flight and
// waits for them.
func (sh *shard) Close() error {
	sh.mu.Lock()
	if sh.closed {
		sh.mu.Unlock()
		return nil
	}
	sh.closed = true
	sh.mu.Unlock()
	sh.src.opened.remove(sh)
	sh.cancel()
	sh.inflight.Wait()
	return nil
}

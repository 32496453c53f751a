package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"time"

	units "github.com/docker/go-units"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/internal/sdnotify"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/metrics"
	"github.com/engramfs/engramfs/prefetch"
	"github.com/engramfs/engramfs/warm"
)

// mountFlags are the settings of a mount, with their defaults.
type mountFlags struct {
	tablePattern string
	queueDepth   int
	backingIO    string
	readEngine   string
	prefillQueue int
	decodeQueue  int
	cacheSize    string
	injectFaults string
	metricsAddr  string
	stateFile    string
	allowOther   bool
	debugFUSE    bool
	s3Flags
	logFlags
}

func (f *mountFlags) register(fl interface {
	StringVar(*string, string, string, string)
	IntVar(*int, string, int, string)
	BoolVar(*bool, string, bool, string)
	Var(flag.Value, string, string)
}) {
	fl.StringVar(&f.tablePattern, "table-pattern", backing.DefaultTablePattern,
		"regular expression that picks the engram tables among the tensors; named groups `layer` and `table` say which layer and table a tensor is")
	fl.IntVar(&f.queueDepth, "queue-depth", 64, "backing reads in flight at most, across all shards")
	fl.StringVar(&f.backingIO, "backing-io", "auto",
		"how shards are read: direct (O_DIRECT, no backing page cache), buffered (FADV_RANDOM, FADV_DONTNEED after each read), or auto (direct where the filesystem accepts it)")
	fl.StringVar(&f.readEngine, "read-engine", "auto",
		"how backing reads are issued: io_uring (many reads per system call, many completions per wake-up), pread (a pool of --queue-depth threads), or auto (io_uring where the kernel and sandbox allow it, else pread; the choice is logged and shown as read_engine in stats)")
	fl.StringVar(&f.cacheSize, "cache-size", "1GiB",
		"budget of the pinned hot tier (pages mlock'd in the page cache), e.g. 512MiB, 4G; 0 turns it off")
	fl.IntVar(&f.prefillQueue, "prefetch-queue", prefetch.DefaultConfig(1).PrefillQueuePages,
		"prefill pages queued at most; past it the oldest prefill hints are dropped (decode hints are never dropped)")
	fl.IntVar(&f.decodeQueue, "decode-queue", prefetch.DefaultConfig(1).DecodeQueuePages,
		"decode pages one control handle may have queued; past it its next frame is refused with EAGAIN (min 256)")
	fl.BoolVar(&f.allowOther, "allow-other", false,
		"let users other than the daemon's read the mount (the control file stays owner-only)")
	fl.BoolVar(&f.debugFUSE, "debug-fuse", false, "log every FUSE request (very verbose)")
	fl.StringVar(&f.metricsAddr, "metrics-addr", "",
		"serve Prometheus metrics on this host:port at /metrics, e.g. 127.0.0.1:9464 (off when empty)")
	fl.StringVar(&f.stateFile, "state-file", "",
		"warm restart: save the hot tier's page keys here on a clean stop, and fetch and pin them again on mount (off when empty)")
	fl.StringVar(&f.injectFaults, "inject-faults", "",
		"TESTING ONLY: inject backing faults, e.g. eio=0.01,short=0.01,latency=2ms,seed=7 (see README)")
	f.s3Flags.register(fl)
}

func init() {
	register("mount", "mount a model directory's engram tables (foreground)", runMount)
}

func runMount(args []string) error {
	fl := newFlagSet("mount", "[flags] MODEL_DIR MOUNTPOINT", `
Mounts the engram tables of MODEL_DIR on MOUNTPOINT and serves them in the
foreground until SIGINT or SIGTERM, which unmount (lazily when a reader still
maps a file). The tree:

  manifest.json                     layers, tables, dtype, shape, row_bytes, data_offset, file
  model.safetensors.index.json      weight_map: tensor name -> table file
  layers/<L>/<table>.safetensors    one single-tensor safetensors file per table, data page-aligned
  .engramfs/stats                   JSON counters
  .engramfs/control                 hints: write frames, read(2) on the handle waits for them (owner only)

MODEL_DIR holds model.safetensors.index.json and its shards, or *.safetensors
files, in a directory or under an object store prefix s3://bucket/prefix
(see the --s3-* flags; credentials come from the AWS environment variables).
From an object store, every GET is a ranged GET of the bytes asked,
conditional on the ETag seen at mount: a shard rewritten under the mount
gives EIO, never other bytes. Must run as root (or with the right to mount
FUSE directly).`)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 2 {
		return usagef("want MODEL_DIR and MOUNTPOINT, got %d arguments", fl.NArg())
	}
	log, err := mf.logger()
	if err != nil {
		return err
	}
	defer log.Sync() //nolint:errcheck
	sig := make(chan os.Signal, 2)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	d, err := startDaemon(fl.Arg(0), fl.Arg(1), mf, log)
	if err != nil {
		return err
	}
	ready := "READY=1\nSTATUS=" + d.status()
	if len(d.warmKeys) > 0 {
		ready += fmt.Sprintf("; warming %d saved pages", len(d.warmKeys))
	}
	d.notify(ready)
	if os.Getenv(readyOnlyEnv) == "1" {
		os.Unsetenv(sdnotify.SocketEnv)
	}
	d.startWarmUp()
	gone := make(chan struct{})
	go func() { d.srv.Wait(); close(gone) }()
	detached := watchMountpoint(fl.Arg(1))
	select {
	case s := <-sig:
		log.Info("unmounting", zap.String("signal", s.String()))
		d.notify("STOPPING=1\nSTATUS=unmounting (" + s.String() + ")")
		return d.stop(true)
	case <-gone:
		log.Info("unmounted from outside", zap.String("mountpoint", d.srv.Mountpoint()))
		d.notify("STOPPING=1\nSTATUS=unmounted from outside")
		return d.stop(false)
	case <-detached:
		// A lazy unmount from outside (engramfs unmount on a busy mount)
		// hides the mount but keeps the connection alive while anything maps
		// a file, the daemon's own pinned mappings included: let go of them.
		log.Info("mount detached from outside", zap.String("mountpoint", d.srv.Mountpoint()))
		d.notify("STOPPING=1\nSTATUS=detached from outside")
		return d.stop(false)
	}
}

// watchMountpoint closes the returned channel once mountpoint no longer
// shows the mount (it was detached from outside). The root's attributes are
// cached by the kernel, so the check rarely reaches FUSE.
func watchMountpoint(mountpoint string) <-chan struct{} {
	out := make(chan struct{})
	var st unix.Stat_t
	if err := unix.Stat(mountpoint, &st); err != nil {
		return out
	}
	dev := st.Dev
	go func() {
		for {
			time.Sleep(500 * time.Millisecond)
			if err := unix.Stat(mountpoint, &st); err != nil || st.Dev != dev {
				close(out)
				return
			}
		}
	}()
	return out
}

// daemon is a running mount and everything it owns.
type daemon struct {
	srv     *fs.Server
	store   *backing.Store
	engine  ioengine.Engine
	pf      *prefetch.Prefetcher
	files   *tableFiles // the daemon's own opens of the table files
	hot     *cache.HotCache
	st      *stats.Counters
	model   *backing.Model
	metrics *metrics.Server // nil: --metrics-addr off
	log     *zap.Logger

	prefillQueue int             // --prefetch-queue
	stateFile    string          // "": no warm restart
	warmKeys     []cache.PageKey // the saved hot set to fetch again
	warm         *warm.Warmer    // nil: no warm-up started
}

func startDaemon(modelDir, mountpoint string, mf mountFlags, log *zap.Logger) (*daemon, error) {
	if mf.queueDepth < 1 || mf.queueDepth > 4096 {
		return nil, usagef("--queue-depth %d: want 1 to 4096", mf.queueDepth)
	}
	engine, why, err := ioengine.New(mf.readEngine, mf.queueDepth)
	if err != nil {
		return nil, usageError{fmt.Errorf("--read-engine %s: %w", mf.readEngine, err)}
	}
	st := &stats.Counters{}
	st.ReadEngine = engine.Name()
	source, err := openSource(modelDir, mf, engine, st)
	if err != nil {
		engine.Close()
		return nil, err
	}
	model, err := backing.LoadSource(source, mf.tablePattern)
	if err != nil {
		engine.Close()
		return nil, err
	}
	if why != "" && !s3source.IsURL(modelDir) {
		log.Warn("io_uring unavailable: reading shards with a pread worker pool", zap.String("reason", why))
	}
	st.SetLayers(model.Layers)
	var reg *metrics.Server
	if mf.metricsAddr != "" {
		// The histograms' hook goes in before anything shares st.
		timings := metrics.NewTimings(model)
		st.Timings = timings
		r, err := metrics.Registry(st, timings)
		if err != nil {
			engine.Close()
			return nil, err
		}
		if reg, err = metrics.Serve(mf.metricsAddr, r, log); err != nil {
			engine.Close()
			return nil, usageError{fmt.Errorf("--metrics-addr %q: %w", mf.metricsAddr, err)}
		}
		log.Info("serving metrics", zap.String("addr", "http://"+reg.Addr()+"/metrics"))
	}
	closeMetrics := func() {
		if reg != nil {
			_ = reg.Close()
		}
	}
	store, err := backing.Open(model, source, st)
	if err != nil {
		engine.Close()
		closeMetrics()
		return nil, err
	}
	closeStore := func() {
		store.Close()
		engine.Close()
	}
	var src backing.Reader = store
	if mf.injectFaults != "" {
		spec, err := backing.ParseFaultSpec(mf.injectFaults)
		if err != nil {
			closeStore()
			closeMetrics()
			return nil, usageError{err}
		}
		src = backing.NewFaultReader(store, spec, st)
		log.Warn("injecting backing faults (testing only)", zap.String("faults", spec.String()))
	}
	loader := cache.NewLoader(src, model.Tables, st)
	hot, err := newHotCache(model, mountpoint, mf.cacheSize, st, log)
	if err != nil {
		closeStore()
		closeMetrics()
		return nil, err
	}
	// The prefetcher needs the mount to push into, and the mount needs the
	// prefetcher to take hints: the pusher is bound once the mount is live.
	pusher := &latePusher{}
	pcfg := prefetch.DefaultConfig(mf.queueDepth)
	pcfg.PrefillQueuePages = mf.prefillQueue
	pcfg.DecodeQueuePages = mf.decodeQueue
	pf := prefetch.New(pcfg, model, loader, pusher, hot, st, log)
	srv, err := fs.Mount(mountpoint, fs.Options{
		Model: model, Loader: loader, Stats: st, Log: log,
		Faults: faultFanout{pf: pf, hot: hot, st: st}, Hints: pf,
		AllowOther: mf.allowOther, Debug: mf.debugFUSE,
	})
	if err != nil {
		pf.Close()
		hot.Close()
		closeStore()
		closeMetrics()
		return nil, err
	}
	pusher.bind(srv)
	spareProcs(log)
	d := &daemon{srv: srv, store: store, engine: engine, pf: pf, hot: hot, st: st, model: model, metrics: reg, log: log,
		prefillQueue: mf.prefillQueue, stateFile: mf.stateFile}
	// Ready means a reader can use the tree: check it answers, through the
	// kernel, before saying so (to the log, the service manager and the
	// mount helper).
	if _, err := os.ReadFile(filepath.Join(mountpoint, fs.ManifestFile)); err != nil {
		d.log.Error("the new mount does not answer", zap.Error(err))
		_ = d.stop(true)
		return nil, fmt.Errorf("mount %s: the new mount does not answer: %w", mountpoint, err)
	}
	if d.files, err = openTableFiles(srv, len(model.Tables)); err != nil {
		_ = d.stop(true)
		return nil, fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	pusher.bindFiles(d.files)
	if mf.stateFile != "" {
		d.warmKeys = loadWarmState(mf.stateFile, model, tierPages(st), log)
	}
	direct := 0
	for _, sh := range model.Shards {
		if store.Direct(sh) {
			direct++
		}
	}
	log.Info("mounted",
		zap.String("model", modelDir), zap.String("mountpoint", mountpoint),
		zap.Int("tables", len(model.Tables)), zap.Int("layers", len(model.Layers)),
		zap.Int("shards", len(model.Shards)), zap.Int("shards_direct_io", direct),
		zap.Int("queue_depth", mf.queueDepth), zap.String("read_engine", engine.Name()),
		zap.Int64("cache_bytes", st.CacheCapacityBytes.Load()), zap.Bool("cache_pinned", st.CachePinned.Load()),
		zap.Int("pid", os.Getpid()))
	return d, nil
}

// status is the one-line state for the service manager.
func (d *daemon) status() string {
	return fmt.Sprintf("serving %d tables of %d layers from %s", len(d.model.Tables), len(d.model.Layers), d.model.Dir)
}

// notify tells the service manager (or the mount helper) about the daemon's
// state, when one listens ($NOTIFY_SOCKET).
func (d *daemon) notify(state string) {
	if err := sdnotify.Notify(state); err != nil {
		d.log.Warn("sd_notify failed", zap.Error(err))
	}
}

// startWarmUp fetches and pins the saved hot set in the background.
func (d *daemon) startWarmUp() {
	if len(d.warmKeys) == 0 {
		return
	}
	files := make([]string, len(d.model.Tables))
	for i := range d.model.Tables {
		files[i] = d.srv.TablePath(uint32(i))
	}
	d.warm = warm.Start(warm.Config{
		Keys: d.warmKeys, TableFiles: files, Prefetch: d.pf, Hot: d.hot, Stats: d.st, Log: d.log,
		BatchPages: min(warm.DefaultBatchPages, d.prefillQueue/2),
		Done: func(r warm.Result) {
			d.notify(fmt.Sprintf("STATUS=%s; warm: %d of %d saved pages pinned in %.1fs",
				d.status(), r.Pinned, r.Pages, r.Duration.Seconds()))
		},
	})
	d.log.Info("warm restart: fetching the saved hot set", zap.Int("pages", len(d.warmKeys)))
}

// loadWarmState reads the saved hot set, at most what the tier holds. Every
// reason to ignore the file is logged; none stops the mount.
func loadWarmState(path string, m *backing.Model, capacity int, log *zap.Logger) []cache.PageKey {
	keys, hdr, err := warm.Load(path, m, capacity)
	switch {
	case errors.Is(err, os.ErrNotExist):
		log.Info("warm restart: no state file yet; starting cold", zap.String("state_file", path))
		return nil
	case errors.Is(err, warm.ErrOtherModel):
		log.Warn("warm restart: ignoring the state file: it was saved for another model", zap.Error(err))
		return nil
	case err != nil:
		log.Warn("warm restart: ignoring an unreadable state file", zap.Error(err))
		return nil
	}
	log.Info("warm restart: state file loaded", zap.String("state_file", path), zap.Int("pages_saved", hdr.Pages),
		zap.Int("pages_to_fetch", len(keys)), zap.Time("saved", hdr.Saved))
	return keys
}

// tierPages is the hot tier's capacity in pages, after clamping.
func tierPages(st *stats.Counters) int { return int(st.CacheCapacityBytes.Load() / cache.PageSize) }

// saveWarmState saves the hot set: the tier's pages, then those a warm-up
// still in progress had not settled (they were hot before this run too).
func (d *daemon) saveWarmState() {
	keys := d.hot.Keys()
	if d.warm != nil {
		seen := make(map[cache.PageKey]struct{}, len(keys))
		for _, k := range keys {
			seen[k] = struct{}{}
		}
		for _, k := range d.warm.Pending() {
			if _, ok := seen[k]; !ok && len(keys) < tierPages(d.st) {
				keys = append(keys, k)
			}
		}
	}
	start := time.Now()
	if err := warm.Save(d.stateFile, d.model, keys); err != nil {
		d.log.Error("warm restart: saving the hot set failed; the next mount starts cold", zap.Error(err))
		return
	}
	d.log.Info("warm restart: hot set saved", zap.String("state_file", d.stateFile), zap.Int("pages", len(keys)),
		zap.Duration("took", time.Since(start)))
}

// stop unmounts (unless the mount is already gone) and releases
// everything, in the order the kernel needs.
func (d *daemon) stop(unmount bool) error {
	// Stop pushing, then unlock and unmap the daemon's own mappings of the
	// table files: while they exist the mount is busy. The hot set is saved
	// in between: no hint adds to it any more, and it is still there.
	if d.warm != nil {
		d.warm.Stop()
	}
	d.pf.Close()
	if d.files != nil {
		d.files.close()
	}
	if d.stateFile != "" {
		d.saveWarmState()
	}
	if err := d.hot.Close(); err != nil {
		d.log.Warn("closing the hot tier", zap.Error(err))
	}
	var err error
	if unmount {
		err = d.srv.Unmount()
	}
	if cerr := d.store.Close(); cerr != nil {
		d.log.Warn("closing shards", zap.Error(cerr))
	}
	_ = d.engine.Close()
	if d.metrics != nil {
		_ = d.metrics.Close()
	}
	if err != nil {
		return err
	}
	if unmount {
		d.log.Info("unmounted", zap.String("mountpoint", d.srv.Mountpoint()))
	}
	return nil
}

// latePusher forwards stores to the mount once it exists.
type latePusher struct {
	mu    sync.RWMutex
	srv   *fs.Server
	files *tableFiles // tablefiles.go
}

func (p *latePusher) bind(s *fs.Server) { p.mu.Lock(); p.srv = s; p.mu.Unlock() }

func (p *latePusher) Store(table uint32, off int64, data []byte) error {
	p.mu.RLock()
	srv := p.srv
	p.mu.RUnlock()
	if srv == nil {
		return prefetch.ErrNotLookedUp
	}
	return srv.Store(table, off, data)
}

// faultFanout tells the prefetcher's late counter (and the hot tier) about
// demand faults.
type faultFanout struct {
	pf  *prefetch.Prefetcher
	hot *cache.HotCache
	st  *stats.Counters
}

func (f faultFanout) Faulted(keys []cache.PageKey) {
	// The pin worker's own populate faults are no demand: they must not
	// count as late prefetches or refaults.
	keys = slices.DeleteFunc(slices.Clone(keys), f.hot.OwnFault)
	if len(keys) == 0 {
		return
	}
	f.st.PrefetchLate.Add(uint64(f.pf.ServedByFault(keys)))
	f.pf.Refaulted(keys)
	f.hot.Admit(keys, cache.SignalFault)
}

// newHotCache builds the pinned hot tier over the daemon's own view of the
// table files (through the mount, mapped lazily once it is live).
func newHotCache(m *backing.Model, mountpoint, size string, st *stats.Counters, log *zap.Logger) (*cache.HotCache, error) {
	capacity, err := units.RAMInBytes(size)
	if err != nil || capacity < 0 {
		return nil, usagef("--cache-size %q: want a size such as 512MiB or 4G, or 0", size)
	}
	abs, err := filepath.Abs(mountpoint)
	if err != nil {
		return nil, err
	}
	files := make([]cache.TableFile, len(m.Tables))
	for i, t := range m.Tables {
		files[i] = cache.TableFile{Path: filepath.Join(abs, t.Path()), Size: t.FileSize}
	}
	return cache.NewHotCache(capacity, cache.NewPinner(files, log), st, log), nil
}

// spareProcs gives the Go scheduler two Ps more than the CPUs, once the
// mount is up (unless GOMAXPROCS is set). go-fuse sizes its pool of
// /dev/fuse readers by GOMAXPROCS when it mounts (2 to 16 readers), and each
// reader waits in read(2) holding its P; with no P idle, sysmon retakes them
// on a 20 µs cadence and the runtime wakes threads to run the hand-offs.
// Measured on 2 vCPUs, cold 4 KiB faults from one reader thread: 4.1
// context switches and 135 µs of daemon CPU per fault at GOMAXPROCS 2; 2.9
// and 112 µs with 4 Ps after a mount at 2. A few spare Ps, not one per read
// in flight: reads no longer block a goroutine each.
func spareProcs(log *zap.Logger) {
	if os.Getenv("GOMAXPROCS") != "" {
		return
	}
	n := runtime.NumCPU() + 2
	runtime.GOMAXPROCS(n)
	log.Debug("GOMAXPROCS set past the CPU count, after the mount sized its readers", zap.Int("gomaxprocs", n))
}

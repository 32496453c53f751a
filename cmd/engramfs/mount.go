package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/cache"
	"github.com/engramfs/engramfs/fs"
	"github.com/engramfs/engramfs/fs/uring"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/sdnotify"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/sysmon"
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
	fuseTrans    string
	prefillQueue int
	decodeQueue  int
	ctlHandles   int
	cacheSize    string
	injectFaults string
	metricsAddr  string
	stateFile    string
	allowOther   bool
	debugFUSE    bool
	passthrough  bool
	takeover     bool
	stopWait     time.Duration
	monitorSlack time.Duration
	s3Flags
	logFlags
}

func (f *mountFlags) register(fl interface {
	StringVar(*string, string, string, string)
	IntVar(*int, string, int, string)
	BoolVar(*bool, string, bool, string)
	Var(flag.Value, string, string)
	DurationVar(*time.Duration, string, time.Duration, string)
}) {
	fl.StringVar(&f.tablePattern, "table-pattern", backing.DefaultTablePattern,
		"regular expression that picks the engram tables among the tensors; its named groups (?P<layer>...) and (?P<table>...) say which layer and table a tensor is")
	fl.IntVar(&f.queueDepth, "queue-depth", 0, "backing reads in flight at most, across all shards (default 64; 256 for an object store, where a read is a GET with ~20 ms to its first byte)")
	fl.StringVar(&f.backingIO, "backing-io", "auto",
		"how shards are read: direct (O_DIRECT, no backing page cache), buffered (FADV_RANDOM, FADV_DONTNEED after each read), or auto (direct where the filesystem accepts it)")
	fl.StringVar(&f.readEngine, "read-engine", "auto",
		"how backing reads are issued: io_uring (many reads per system call, many completions per wake-up), pread (a pool of --queue-depth threads), or auto (io_uring where the kernel and sandbox allow it, else pread; the choice is logged and shown as read_engine in stats)")
	fl.StringVar(&f.fuseTrans, "fuse-transport", string(uring.Dev),
		"how FUSE requests reach the daemon: dev (/dev/fuse), uring (per-CPU io_uring queues; needs Linux 6.14+ with the fuse module's enable_uring=Y; faster faults, slower WILLNEED bursts: see docs/design.md), or auto (uring where the kernel offers it and every queue registers, else dev; the choice is logged and shown as fuse_transport in stats)")
	fl.StringVar(&f.cacheSize, "cache-size", "1GiB",
		"budget of the pinned hot tier (pages mlock'd in the page cache), e.g. 512MiB, 4G; 0 turns it off; in a memory cgroup it is lowered to fit the cgroup's limit with headroom")
	fl.IntVar(&f.prefillQueue, "prefetch-queue", prefetch.DefaultPrefillQueuePages,
		"prefill pages queued at most; past it the oldest prefill hints are dropped (decode hints are never dropped)")
	fl.IntVar(&f.decodeQueue, "decode-queue", prefetch.DefaultDecodeQueuePages,
		"decode pages one control handle may have queued; past it its next decode frame is refused with EAGAIN, and a decode frame already begun waits for room a write at a time (min 256)")
	fl.IntVar(&f.ctlHandles, "control-handles", fs.DefaultControlHandles,
		"control-file handles open at once at most; past it an open fails with ENFILE")
	fl.BoolVar(&f.allowOther, "allow-other", false,
		"let users other than the daemon's read the mount (the control file stays owner-only)")
	fl.BoolVar(&f.debugFUSE, "debug-fuse", false, "log every FUSE request (very verbose)")
	fl.BoolVar(&f.passthrough, "passthrough", true,
		"serve MODEL_DIR's other files (config, tokenizer, shards) with FUSE passthrough where the kernel allows (6.9+, CAP_SYS_ADMIN); false: the daemon reads them, with readahead for sequential readers")
	fl.BoolVar(&f.takeover, "takeover", false,
		"take the live mount at MOUNTPOINT over from the daemon serving it, instead of mounting (what engramfs restart runs): readers see no error")
	fl.StringVar(&f.metricsAddr, "metrics-addr", "",
		"serve Prometheus metrics on this host:port at /metrics, e.g. 127.0.0.1:9464 (off when empty)")
	fl.StringVar(&f.stateFile, "state-file", "",
		"warm restart: save the hot tier's page keys here on a clean stop, and fetch and pin them again on mount (off when empty)")
	fl.DurationVar(&f.stopWait, "stop-wait", defaultStopWait,
		"on SIGINT or SIGTERM while processes map table files, wait this long for the last mapping to go (logging their pids) before unmounting; a second signal stops at once")
	fl.DurationVar(&f.monitorSlack, "monitor-slack", defaultMonitorSlack,
		"timer slack of the Go runtime's monitor thread (sysmon), which otherwise wakes every 20 µs for a millisecond or more each time the daemon wakes from idle: with 1ms a serving loop's daemon switched 33-45% less and spent 7-20% less CPU a page; 0 leaves the kernel's 50 µs (needs CAP_SYS_NICE; see docs/design.md)")
	fl.StringVar(&f.injectFaults, "inject-faults", "",
		"TESTING ONLY: inject backing faults, e.g. eio=0.01,short=0.01,latency=2ms,seed=7 (see README)")
	f.s3Flags.register(fl)
}

func init() {
	register("mount", "mount a model directory's engram tables (foreground)", runMount)
}

func runMount(args []string) error {
	fl := newFlagSet("mount", "[flags] MODEL_DIR MOUNTPOINT", `
Mounts MODEL_DIR on MOUNTPOINT with its engram tables served by engramfs, and
serves it in the foreground until SIGINT or SIGTERM, which wait (--stop-wait)
for processes mapping a table to let go, then unmount (lazily when a reader
still uses a file). To restart or upgrade the daemon under live readers, use
'engramfs restart MOUNTPOINT' (it runs this command line with --takeover).
The tree:

  manifest.json                     layers, tables, dtype, shape, row_bytes, data_offset, file
  model.safetensors.index.json      weight_map: every tensor -> its table file, or its shard
  layers/<L>/<table>.safetensors    one single-tensor safetensors file per table, data page-aligned
  .engramfs/stats                   JSON counters
  .engramfs/control                 hints: write frames, read(2) on the handle waits for them (owner only)
  every other file of MODEL_DIR     at its own path, same bytes (config, tokenizer, shards, subdirectories);
                                    where a name is taken twice the mount's entry wins (a warning names it)

MODEL_DIR holds model.safetensors.index.json and its shards, or *.safetensors
files, in a directory or under an object store prefix s3://bucket/prefix
(see the --s3-* flags; credentials come from the AWS environment variables).
From an object store, every GET is a ranged GET of the bytes asked,
conditional on the ETag seen at mount: a shard rewritten under the mount
gives EIO, never other bytes. Must run as root (or with CAP_SYS_ADMIN and
/dev/fuse: FUSE is mounted directly). A MOUNTPOINT with a live engramfs
mount is refused, naming its daemon's pid; one left dead by a killed daemon
is cleaned up. Counts must be positive and sizes need a unit (0 excepted).`)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 2 {
		return usagef("want MODEL_DIR and MOUNTPOINT, got %d arguments", fl.NArg())
	}
	if err := checkMountFlags(fl, &mf); err != nil {
		return err
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
	if mf.takeover {
		ready = notifyMainPID() + ready
	}
	d.notify(ready)
	if os.Getenv(readyOnlyEnv) == "1" {
		os.Unsetenv(sdnotify.SocketEnv)
	} else {
		d.storeConnection()
	}
	d.tellServing()
	if mf.takeover && d.registry != nil {
		if err := d.bindMetrics(10 * time.Second); err != nil {
			log.Error("no metrics after the takeover", zap.Error(err))
		}
	}
	d.startWarmUp()
	detached := d.srv.Detached()
	for {
		if d.handover, err = d.listenHandover(fl.Arg(1)); err != nil {
			log.Warn("no restart without readers noticing: the handover socket failed", zap.Error(err))
		}
		var handovers <-chan *net.UnixConn
		if d.handover != nil {
			handovers = d.handover.reqs
		}
		gone := make(chan struct{})
		go func() { d.srv.Wait(); close(gone) }()
		select {
		case s := <-sig:
			log.Info("unmounting", zap.String("signal", s.String()))
			d.notify("STOPPING=1\nSTATUS=unmounting (" + s.String() + ")")
			d.waitForMappers(mf.stopWait, sig)
			return d.stop(true)
		case conn := <-handovers:
			log.Info("handing the mount over to a successor")
			if err := d.handOver(conn); err != nil {
				log.Error("handover failed", zap.Error(err))
			}
			if d.handedOver {
				return d.stop(false)
			}
			// Still ours (resumed, or never stopped): serve on.
		case <-gone:
			log.Info("unmounted from outside", zap.String("mountpoint", d.srv.Mountpoint()))
			d.notify("STOPPING=1\nSTATUS=unmounted from outside")
			return d.stop(false)
		case <-detached:
			// A lazy unmount from outside (engramfs unmount on a busy mount)
			// hides the mount but keeps the connection alive while anything maps
			// a file, the daemon's own pinned mappings included: let go of them.
			// (A mount stacked on ours is no detach: fs.Server.Detached.)
			log.Info("mount detached from outside", zap.String("mountpoint", d.srv.Mountpoint()))
			d.notify("STOPPING=1\nSTATUS=detached from outside")
			return d.stop(false)
		}
	}
}

// The default --stop-wait: systemd's TimeoutStopSec is 60 s in the unit;
// the unpin and the state save need a few of them.
const defaultStopWait = 30 * time.Second

// waitForMappers holds a stop while processes other than this one map a
// file of the mount: their next cold page would be SIGBUS once the daemon
// is gone. It waits at most limit, logging who maps every few seconds; a
// second signal on sig, or limit 0, stops at once.
func (d *daemon) waitForMappers(limit time.Duration, sig <-chan os.Signal) {
	mp := d.srv.Mountpoint()
	if mp == "" || limit <= 0 {
		return
	}
	start := time.Now()
	var logged time.Time
	type answer struct {
		pids []int
		err  error
	}
	for {
		// Reading a process's maps takes its memory map lock: a process
		// stuck in the kernel holding it (seen: a test process in D state
		// on another FUSE mount) would hold the stop forever. Bounded by
		// limit like the wait itself; the read left behind ends with us.
		ch := make(chan answer, 1)
		go func() { pids, err := mapperPids(mp); ch <- answer{pids, err} }()
		var a answer
		select {
		case a = <-ch:
		case <-time.After(listWait(limit, start)):
			d.log.Warn("listing the processes that map table files hangs (a process stuck in the kernel?); unmounting anyway",
				zap.Duration("waited", time.Since(start)))
			return
		case s := <-sig:
			d.log.Warn("second signal: stopping while processes that map table files are listed", zap.String("signal", s.String()))
			return
		}
		pids, err := a.pids, a.err
		if err != nil || len(pids) == 0 {
			if !logged.IsZero() {
				d.log.Info("the last mapping of the mount is gone", zap.Duration("waited", time.Since(start)))
			}
			return
		}
		if time.Since(start) >= limit {
			d.log.Warn("processes still map table files; unmounting anyway (their next cold page is SIGBUS)",
				zap.Ints("pids", pids), zap.Duration("waited", limit))
			return
		}
		if time.Since(logged) >= 5*time.Second {
			d.log.Warn("waiting for processes that map table files to let go (a second signal stops at once)",
				zap.Ints("pids", pids), zap.Duration("at_most", limit))
			d.notify(fmt.Sprintf("STATUS=stopping: waiting for pids %v to unmap table files", pids))
			logged = time.Now()
		}
		select {
		case s := <-sig:
			d.log.Warn("second signal: stopping although processes map table files", zap.String("signal", s.String()), zap.Ints("pids", pids))
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// listWait is how long one listing of the mappers may take: what is left
// of limit since start, at least a second.
func listWait(limit time.Duration, start time.Time) time.Duration {
	return max(time.Second, limit-time.Since(start))
}

// mapperPids is procfs.Mappers without this process (the hot tier maps
// every table).
func mapperPids(mp string) ([]int, error) {
	abs, err := filepath.Abs(mp)
	if err != nil {
		return nil, err
	}
	ms, err := procfs.Mappers(abs)
	var pids []int
	for _, m := range ms {
		if m.Pid != os.Getpid() {
			pids = append(pids, m.Pid)
		}
	}
	return pids, err
}

// daemon is a running mount and everything it owns. Fields are nil until
// startDaemon has built them; stop releases whatever is there.
type daemon struct {
	engine  ioengine.Engine
	source  backing.Source
	model   *backing.Model
	st      *stats.Counters
	metrics *metrics.Server // nil: --metrics-addr off
	store   *backing.Store
	hot     *cache.HotCache
	srv     *fs.Server
	seen    *cache.Seen // the pages this daemon put in the page cache
	pf      *prefetch.Prefetcher
	log     *zap.Logger

	prefillQueue int             // --prefetch-queue
	stateFile    string          // "": no warm restart (set once the mount serves)
	warmKeys     []cache.PageKey // the saved hot set to fetch again
	warm         *warm.Warmer    // nil: no warm-up started

	handover   *handoverListener // nil: no socket (restart.go)
	handedOver bool              // the mount is the successor's: never unmount it
	pred       *predecessor      // the daemon taken over from, until this one serves
	inherited  bool              // the mount was taken over and is not served yet: never unmount it
	takeoverMS float64           // how long the takeover took (status)

	registry    *prometheus.Registry // nil: --metrics-addr off
	metricsAddr string
}

// bindMetrics serves the metrics on --metrics-addr, retrying for up to
// patience while the address is in use (a predecessor letting it go).
func (d *daemon) bindMetrics(patience time.Duration) error {
	deadline := time.Now().Add(patience)
	for {
		reg, err := metrics.Serve(d.metricsAddr, d.registry, d.log)
		if err == nil {
			d.metrics = reg
			d.log.Info("serving metrics", zap.String("addr", "http://"+reg.Addr()+"/metrics"))
			return nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) || time.Now().After(deadline) {
			return usageError{Err: fmt.Errorf("--metrics-addr %q: %w", d.metricsAddr, err)}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The default --queue-depth: a local disk does ~126K 4 KiB reads a second at
// QD64 here; an object store needs more in flight, since each GET waits
// ~20 ms for its first byte (64 GETs in flight fetch ~3,200 pages a second;
// 256, ~12,800: a 4,000-page prefill chunk in about a third of a second).
const (
	defaultQueueDepth            = 64
	defaultObjectStoreQueueDepth = 256
)

// queueDepthFor is --queue-depth for modelDir: set, unless 0 (the flag's
// default), which means the default for the kind of source.
func queueDepthFor(modelDir string, set int) int {
	switch {
	case set != 0:
		return set
	case s3source.IsURL(modelDir):
		return defaultObjectStoreQueueDepth
	}
	return defaultQueueDepth
}

// startDaemon builds the daemon bottom up (shards, loader, hot tier, tree,
// prefetcher), wires the tree to the prefetcher and mounts. The tree is
// built before the mount exists, so nothing needs to be bound late. On
// error everything built so far is released, and nothing is left mounted.
func startDaemon(modelDir, mountpoint string, mf mountFlags, log *zap.Logger) (_ *daemon, err error) {
	mf.queueDepth = queueDepthFor(modelDir, mf.queueDepth)
	if mf.queueDepth < 1 || mf.queueDepth > 4096 {
		return nil, usagef("--queue-depth %d: want 1 to 4096", mf.queueDepth)
	}
	d := &daemon{log: log, prefillQueue: mf.prefillQueue}
	defer func() {
		if err != nil {
			_ = d.stop(true)
		}
	}()
	engine, why, err := ioengine.New(mf.readEngine, mf.queueDepth)
	if err != nil {
		return nil, usageError{Err: fmt.Errorf("--read-engine %s: %w", mf.readEngine, err)}
	}
	d.engine = engine
	st := &stats.Counters{}
	st.ReadEngine = engine.Name()
	d.st = st
	source, err := openSource(modelDir, mf, engine, st, log)
	if err != nil {
		return nil, err // (a nil *s3source.Source in a Source is not nil: keep it out of d)
	}
	d.source = source
	model, err := backing.LoadSourceChecked(d.source, mf.tablePattern, func(tables, shards int) error {
		return checkDescriptors(modelDir, mf, tables, shards)
	})
	if err != nil {
		return nil, err
	}
	d.model = model
	if why != "" && !s3source.IsURL(modelDir) {
		log.Warn("io_uring unavailable: reading shards with a pread worker pool", zap.String("reason", why))
	}
	st.SetLayers(model.Layers)
	var registry *prometheus.Registry
	if mf.metricsAddr != "" {
		// The histograms' hook goes in before anything shares st: the tree
		// picks its timed nodes by it.
		timings := metrics.NewTimings(model)
		st.Timings = timings
		if registry, err = metrics.Registry(st, timings); err != nil {
			return nil, err
		}
	}
	if d.store, err = backing.Open(model, d.source, st); err != nil {
		return nil, err
	}
	logSource(d.source, log)
	// Backing reads are timed as the store answers them: injected latency
	// is not the disk's.
	src := backing.Timed(d.store, st.Timings)
	if mf.injectFaults != "" {
		spec, err := backing.ParseFaultSpec(mf.injectFaults)
		if err != nil {
			return nil, usageError{Err: err}
		}
		src = backing.NewFaultReader(src, spec, st)
		log.Warn("injecting backing faults (testing only)", zap.String("faults", spec.String()))
	}
	loader := cache.NewLoader(src, model.Tables, st)
	var readInto backing.IntoReader = d.store // the readahead's reads: no faults injected
	if mf.injectFaults != "" {
		readInto = nil
	}
	transport, err := uring.ParseMode(mf.fuseTrans)
	if err != nil {
		return nil, usageError{Err: fmt.Errorf("--fuse-transport: %w", err)}
	}
	// The pages this daemon puts in the page cache: the residency lookups
	// of hints skip the others. A successor did not see its predecessor's.
	pages := make([]uint64, len(model.Tables))
	for i, t := range model.Tables {
		pages[i] = t.Pages()
	}
	seen := cache.NewSeen(pages)
	if mf.takeover || os.Getenv("LISTEN_FDS") != "" {
		seen.SetUnknown() // until a handover's state says better (restart.go)
	}
	d.seen = seen
	loader.SetSeen(seen)
	if d.srv, err = fs.New(fs.Options{
		Model: model, Loader: loader, ReadInto: readInto, Stats: st, Log: log, Seen: seen,
		AllowOther: mf.allowOther, Debug: mf.debugFUSE, ControlHandles: mf.ctlHandles,
		NoPassthrough: !mf.passthrough,
		Transport:     uring.New(transport, st, log),
	}); err != nil {
		return nil, err
	}
	if d.hot, err = newHotCache(model, mountpoint, mf.cacheSize, d.srv, seen, st, log); err != nil {
		return nil, err
	}
	pcfg := prefetch.DefaultConfig(mf.queueDepth)
	pcfg.PrefillQueuePages = mf.prefillQueue
	pcfg.DecodeQueuePages = mf.decodeQueue
	d.pf = prefetch.New(pcfg, model, loader, d.srv, d.hot, st, log)
	if d.hot != nil {
		d.hot.SetDemand(d.pf.DecodeBusy)
	}
	d.srv.Connect(d.pf, d.pf)
	// Ready means a reader can use the tree: Serve checks it answers,
	// through the kernel, before it returns (and so before the log, the
	// service manager and the mount helper hear of it). A takeover checks
	// the same.
	if mf.takeover {
		if err := d.takeOver(mountpoint); err != nil {
			log.Error("takeover failed", zap.Error(err))
			return nil, err
		}
	} else if dev := storedConnection(mountpoint, log); dev != nil {
		if err := d.srv.TakeOver(mountpoint, func() (*os.File, fs.Session, error) { return dev, fs.Session{}, nil }, true); err != nil {
			log.Error("taking the mount over from the file descriptor store failed", zap.Error(err))
			return nil, err
		}
		d.inherited = true
		log.Warn("took the mount over from the service manager's file descriptor store: the previous daemon died; "+
			"requests it read were sent again, handles it had opened are reopened on first use (control-file handles answer EBADF; the clients reopen)", zap.String("mountpoint", mountpoint))
	} else if err := d.srv.Serve(mountpoint); err != nil {
		log.Error("mount failed", zap.Error(err))
		return nil, err
	}
	// Bound once the mount serves; after a takeover once the predecessor
	// has let the address go (bindMetrics, after it heard "serving").
	d.registry, d.metricsAddr = registry, mf.metricsAddr
	if registry != nil && !mf.takeover {
		if err := d.bindMetrics(0); err != nil {
			return nil, err
		}
	}
	spareProcs(log)
	quietMonitor(mf.monitorSlack, log)
	if mf.stateFile != "" {
		d.stateFile = mf.stateFile
		if !mf.takeover {
			d.warmKeys = loadWarmState(mf.stateFile, model, tierPages(st), log)
		}
	}
	direct := 0
	for _, sh := range model.Shards {
		if d.store.Direct(sh) {
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
	d.warm = warm.Start(warm.Config{
		Keys: d.warmKeys, Prefetch: d.pf, Hot: d.hot, Stats: d.st, Log: d.log,
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

// saveWarmState saves the hot set (hotSet).
func (d *daemon) saveWarmState() {
	keys := d.hotSet()
	start := time.Now()
	if err := warm.Save(d.stateFile, d.model, keys); err != nil {
		d.log.Error("warm restart: saving the hot set failed; the next mount starts cold", zap.Error(err))
		return
	}
	d.log.Info("warm restart: hot set saved", zap.String("state_file", d.stateFile), zap.Int("pages", len(keys)),
		zap.Duration("took", time.Since(start)))
}

// stop unmounts (unless the mount is already gone) and releases
// everything the daemon holds, whatever startDaemon got to build, in the
// order the kernel and the owners need:
//
//  1. the warm-up and the prefetcher stop: nothing is pushed any more, and
//     no hint adds to the hot set, which is saved while it is still there;
//  2. the hot tier unlocks and unmaps the daemon's own mappings of the
//     table files: while they exist the mount is busy (docs/design.md,
//     "Kernel facts and what the code does about them": unmounting), and
//     unmounting first would detach it lazily on every stop;
//  3. the unmount (the server closes its own opens of the table files
//     first, for the same reason);
//  4. the shards, then the source (an object store's mirror writes the
//     pages still queued), then the read engine that served them.
func (d *daemon) stop(unmount bool) error {
	d.handover.close()
	if d.pred != nil {
		d.pred.conn.Close() // the predecessor hears the takeover failed
	}
	if d.warm != nil {
		d.warm.Stop()
	}
	if d.pf != nil {
		d.pf.Close()
	}
	if d.stateFile != "" {
		d.saveWarmState()
	}
	if d.hot != nil {
		if err := d.hot.Close(); err != nil {
			d.log.Warn("closing the hot tier", zap.Error(err))
		}
	}
	var err error
	switch {
	case d.srv == nil:
	case d.handedOver:
		d.srv.Release() // the successor serves the mount
	case unmount && d.inherited:
		// A takeover that failed: the mount is the predecessor's readers'.
		d.srv.Release()
	case unmount:
		err = d.srv.Unmount()
	default:
		d.srv.Close()
	}
	if d.store != nil {
		if cerr := d.store.Close(); cerr != nil {
			d.log.Warn("closing shards", zap.Error(cerr))
		}
	}
	if c, ok := d.source.(io.Closer); ok {
		if cerr := c.Close(); cerr != nil {
			d.log.Warn("closing the model source", zap.String("source", d.source.String()), zap.Error(cerr))
		}
	}
	if d.engine != nil {
		_ = d.engine.Close()
	}
	if d.metrics != nil {
		_ = d.metrics.Close()
	}
	if err != nil {
		return err
	}
	if unmount && !d.handedOver && d.srv != nil && d.srv.Mountpoint() != "" {
		d.log.Info("unmounted", zap.String("mountpoint", d.srv.Mountpoint()))
	}
	return nil
}

// newHotCache builds the pinned hot tier over the daemon's own view of the
// table files (through the mount, mapped lazily once it is live), fitted to
// the daemon's memory cgroup; srv stores again the pages a reader's fault
// charged to the reader's cgroup before they are pinned (cache/charge.go).
func newHotCache(m *backing.Model, mountpoint, size string, srv cache.Recharger, seen *cache.Seen, st *stats.Counters, log *zap.Logger) (*cache.HotCache, error) {
	capacity, err := parseSize(size)
	if err != nil {
		return nil, usagef("--cache-size %q: %v", size, err)
	}
	if capacity, err = fitTierToMemcg(capacity, st, log); err != nil {
		return nil, err
	}
	warnCacheSize(capacity, log) // the budget in force, once fitted
	abs, err := filepath.Abs(mountpoint)
	if err != nil {
		return nil, err
	}
	files := make([]cache.TableFile, len(m.Tables))
	for i, t := range m.Tables {
		files[i] = cache.TableFile{Path: filepath.Join(abs, t.Path()), Size: t.FileSize}
	}
	p := cache.NewPinner(files, log)
	p.SetRecharger(srv)
	p.SetSeen(seen)
	return cache.NewHotCache(capacity, p, st, log), nil
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

// defaultMonitorSlack is --monitor-slack's default.
const defaultMonitorSlack = time.Millisecond

// quietMonitor gives the runtime's monitor thread a timer slack (package
// sysmon says why). Measured in the serving loop (engramfs bench --serve,
// big and flash, 1 and 4 ranks, 2026-12-06, interleaved pairs): daemon
// context switches a backing page 0.34-0.35 → 0.19-0.20 (1 rank) and
// 0.26-0.28 → 0.17-0.19 (4 ranks), its CPU a page 15.3-17.3 → 12.8-13.7 µs
// and 14.5-17.0 → 13.8-14.9 µs; decode p50 and p99 within the runs' noise
// (docs/design.md, "The runtime's monitor thread", has the table).
// Without CAP_SYS_NICE it logs why and the daemon runs as it would without.
func quietMonitor(slack time.Duration, log *zap.Logger) {
	if slack <= 0 {
		return
	}
	tid, err := sysmon.Quiet(slack)
	if err != nil {
		log.Info("the runtime's monitor thread keeps its 50 µs timer slack (--monitor-slack)", zap.Error(err))
		return
	}
	log.Debug("the runtime's monitor thread given a timer slack", zap.Int("tid", tid), zap.Duration("slack", slack))
}

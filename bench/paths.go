package bench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
)

// geomRun measures the paths on one geometry's model.
type geomRun struct {
	cfg      *Config
	g        Geometry
	modelDir string
	model    *backing.Model
	drop     *dropper
	prog     *progress
	flags    []string // daemon flags
	env      []string // added to the daemon's environment

	decode     [][][]uint64 // step -> layer index -> rows (lookups)
	prefill    [][][]uint64 // chunk -> layer index -> unique rows
	chunkRows  []int
	chunkPages []int // pages each chunk needs that earlier chunks did not
	// alone is one more prefill chunk (another seed: rows the measured
	// phases did not read), path 5 prefetches it with nothing else running.
	alone [][]uint64
}

func newGeomRun(cfg *Config, g Geometry, dir string, drop *dropper, prog *progress, flags []string) (*geomRun, error) {
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		return nil, err
	}
	r := &geomRun{cfg: cfg, g: g, modelDir: dir, model: m, drop: drop, prog: prog, flags: flags, env: daemonEnv(cfg)}
	var layerRows []uint64
	for _, l := range m.Layers {
		n, _ := m.LayerRows(l)
		layerRows = append(layerRows, n)
	}
	r.decode = DecodeWorkload(cfg.Seed, layerRows, cfg.Decode)
	r.prefill = PrefillWorkload(cfg.Seed, layerRows, cfg.Prefill)
	one := cfg.Prefill
	one.Chunks = 1
	r.alone = PrefillWorkload(cfg.Seed+1, layerRows, one)[0]
	pc := NewPageCounter(m)
	for _, ch := range r.prefill {
		rows, pages := 0, 0
		for j, rs := range ch {
			rows += len(rs)
			pages += pc.Add(m.Layers[j], rs)
		}
		r.chunkRows = append(r.chunkRows, rows)
		r.chunkPages = append(r.chunkPages, pages)
	}
	return r, nil
}

func (r *geomRun) shardFiles() []string {
	var out []string
	for _, sh := range r.model.Shards {
		out = append(out, sh.Path)
	}
	return out
}

// run measures path p: decode then prefill, each from cold caches. For
// PathEngramfs it also returns the warm reference.
func (r *geomRun) run(ctx context.Context, p PathID) (res, warm *PathResult, err error) {
	res = &PathResult{Path: p, Label: p.Label()}
	var d *daemonproc.Daemon
	open := func() (*gatherSet, error) {
		advice := unix.MADV_RANDOM
		switch p {
		case PathPread:
			advice = -1
		case PathMmapRA:
			advice = unix.MADV_NORMAL
		}
		return openShards(r.model, r.cfg.Seed, advice)
	}
	if p.mounts() {
		d, err = startDaemon(ctx, r.cfg.Binary, r.cfg.MountDir, r.flags, r.env, r.modelDir)
		if err != nil {
			return nil, nil, err
		}
		defer func() {
			// Keep both: when a phase failed because the daemon did, its
			// exit status and log (in Stop's error) say why.
			if serr := d.Stop(); serr != nil {
				err = errors.Join(err, fmt.Errorf("%s: stopping the daemon: %w", p, serr))
			}
		}()
		open = func() (*gatherSet, error) { return openMount(r.model, d.Mountpoint, r.cfg.Seed) }
		res.Daemon = &DaemonUsage{}
	}
	if p == PathEngramfs {
		warm = &PathResult{Path: PathWarm, Label: PathWarm.Label(), Decode: &Phase{}, Prefill: &Phase{}}
	}
	var warmDec, warmPre *Phase
	if warm != nil {
		warmDec, warmPre = warm.Decode, warm.Prefill
	}
	res.Decode, err = r.phase(ctx, p, "decode", d, open, func(gs *gatherSet, ph *Phase) error {
		return r.decodeBody(ctx, p, d, gs, ph, warmDec, open)
	})
	if err != nil {
		return nil, nil, err
	}
	res.Prefill, err = r.phase(ctx, p, "prefill", d, open, func(gs *gatherSet, ph *Phase) error {
		return r.prefillBody(ctx, p, d, gs, ph, warmPre, open)
	})
	if err != nil {
		return nil, nil, err
	}
	if p == PathHints {
		res.PrefetchAlone, err = r.phase(ctx, p, "prefetch alone", d, open, func(_ *gatherSet, ph *Phase) error {
			return r.prefetchAloneBody(d, ph)
		})
		if err != nil {
			return nil, nil, err
		}
	}
	if d != nil {
		res.Daemon.CPU = res.Decode.DaemonCPU + res.Prefill.DaemonCPU
		if res.PrefetchAlone != nil {
			res.Daemon.CPU += res.PrefetchAlone.DaemonCPU
		}
		res.Daemon.ReadEngine = res.Prefill.Stats.ReadEngine
		res.Daemon.FuseTransport = res.Prefill.Stats.FuseTransport
		if res.Daemon.ReadEngine == "" {
			res.Daemon.ReadEngine = ReadEngineUnknown
		}
		if res.Daemon.Mem, err = d.Mem(); err != nil {
			return nil, nil, fmt.Errorf("daemon memory: %w", err)
		}
	}
	return res, warm, nil
}

// phase drops caches, opens the path's files, runs body and accounts for
// the backing I/O and CPU time it cost.
func (r *geomRun) phase(ctx context.Context, p PathID, name string, d *daemonproc.Daemon, open func() (*gatherSet, error), body func(*gatherSet, *Phase) error) (*Phase, error) {
	ph := &Phase{}
	r.prog.setPhase("%s %s: %s: dropping caches", r.g.Name, p.Label(), name)
	files := r.shardFiles()
	if d != nil {
		for _, t := range r.model.Tables {
			files = append(files, filepath.Join(d.Mountpoint, t.Path()))
		}
	}
	how, err := r.drop.drop(files)
	if err != nil {
		return nil, err
	}
	ph.Cold = how
	gs, err := open()
	if err != nil {
		return nil, err
	}
	defer gs.close()

	r.prog.setPhase("%s %s: %s", r.g.Name, p.Label(), name)
	readBefore, err := procfs.SelfReadBytes()
	if err != nil {
		return nil, err
	}
	mark, err := markDaemon(d)
	if err != nil {
		return nil, err
	}
	clientBefore := selfCPU()

	if err := body(gs, ph); err != nil {
		return nil, fmt.Errorf("%s %s %s: %w", r.g.Name, p, name, err)
	}

	ph.ClientCPU = selfCPU() - clientBefore
	if d != nil {
		use, err := mark.since(d)
		if err != nil {
			return nil, err
		}
		ph.DaemonCPU, ph.DaemonSwitches, ph.Stats = use.cpu, use.switches, &use.stats
		ph.BackingBytes, ph.BackingFrom = use.stats.BackingBytes, ".engramfs/stats backing_bytes"
		ph.DaemonCPUPerPage, ph.DaemonSwitchesPerPage = use.cpuPerPage(), use.switchesPerPage()
	} else {
		readAfter, err := procfs.SelfReadBytes()
		if err != nil {
			return nil, err
		}
		ph.BackingBytes, ph.BackingFrom = readAfter-readBefore, "/proc/self/io read_bytes"
	}
	if ph.Rows > 0 {
		ph.BytesPerRow = float64(ph.BackingBytes) / float64(ph.Rows)
	}
	if err := gs.close(); err != nil {
		return nil, err
	}
	return ph, nil
}

// decodeBody runs the decode steps: each gathers RowsPerStep rows of every
// layer (every table) and is timed whole, hints and barrier included.
//
// With warm set (path 4), each step is gathered again, timed, through a
// fresh mapping (open): every row is in the page cache then, but not in the
// new mapping's page tables, so the reference pays a minor fault per page,
// as a gather of prefetched rows does. Gathering again through the same
// mapping would pay none, a floor no page-cache scheme can reach.
func (r *geomRun) decodeBody(ctx context.Context, p PathID, d *daemonproc.Daemon, gs *gatherSet, ph *Phase, warm *Phase, open func() (*gatherSet, error)) error {
	var h *hinter
	if p == PathHints {
		var err error
		if h, err = openHinter(d.Mountpoint); err != nil {
			return err
		}
		defer h.Close()
		ph.Barrier, ph.BarrierHow = h.barrier, h.why
	}
	buf := make([]byte, maxRowBytes(gs))
	times := make([]time.Duration, 0, len(r.decode))
	var hintTimes, warmTimes []time.Duration
	procs := 1
	if p == PathPread {
		procs = r.cfg.PreadWorkers + 2
	}
	err := withProcs(procs, func() error {
		for i, step := range r.decode {
			if err := ctx.Err(); err != nil {
				return err
			}
			start := time.Now()
			switch p {
			case PathPread:
				if err := gs.gatherPool(step, r.cfg.PreadWorkers, r.cfg.PreadTaskRows, true, nil); err != nil {
					return err
				}
			case PathMmapWillneed, PathEngramfsWillneed:
				if _, err := gs.gatherV3(step, buf, nil); err != nil {
					return err
				}
			case PathHints:
				for j, rows := range step {
					if err := h.Decode(r.model.Layers[j], rows); err != nil {
						return err
					}
				}
				if err := h.Wait(); err != nil {
					return err
				}
				hintTimes = append(hintTimes, time.Since(start))
				if err := gs.gatherSerial(step, buf, nil); err != nil {
					return err
				}
			default:
				if err := gs.gatherSerial(step, buf, nil); err != nil {
					return err
				}
			}
			times = append(times, time.Since(start))
			if warm != nil {
				t, err := warmGather(open, func(fresh *gatherSet) error { return fresh.gatherSerial(step, buf, nil) })
				if err != nil {
					return err
				}
				warmTimes = append(warmTimes, t)
			}
			if err := gs.verify(step); err != nil {
				return err
			}
			r.prog.update("step %d/%d, p50 %s", i+1, len(r.decode), fmtDur(Percentile(times, 50)))
		}
		return nil
	})
	if err != nil {
		return err
	}
	rows := int64(len(r.decode) * len(r.model.Layers) * r.cfg.Decode.RowsPerStep)
	ph.Times, ph.Rows = Summarize(times), rows
	if hintTimes != nil {
		s := Summarize(hintTimes)
		ph.Hint = &s
	}
	if warm != nil {
		warm.Cold = "none: each step gathered again, through a fresh mapping, right after its timed gather"
		warm.Times, warm.Rows = Summarize(warmTimes), rows
	}
	return nil
}

// prefetchRec is one chunk's prefill hints: sent, then waited for.
type prefetchRec struct {
	dur          time.Duration
	pages, reads uint64
	err          error // the barrier's
	statsErr     error // reading the stats after it (pages and reads are 0)
}

// sendPrefill sends one chunk's prefill hints, a frame per layer, and
// returns wait: it blocks on the barrier and accounts the chunk's prefetch,
// its time from the first hint, the pages it stored and its backing reads.
func (r *geomRun) sendPrefill(d *daemonproc.Daemon, h *hinter, chunk [][]uint64) (wait func() prefetchRec, err error) {
	before, err := d.Stats()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	for j, rows := range chunk {
		if err := h.Prefill(r.model.Layers[j], rows); err != nil {
			return nil, err
		}
	}
	return func() prefetchRec {
		rec := prefetchRec{err: h.Wait()}
		rec.dur = time.Since(start)
		after, err := d.Stats()
		if err != nil {
			rec.statsErr = err
			return rec
		}
		rec.pages = after.PrefetchPagesStored - before.PrefetchPagesStored
		rec.reads = after.BackingReads - before.BackingReads
		return rec
	}, nil
}

// prefillBody gathers every chunk's unique rows. Path 5 hints chunk k+1
// right after chunk k's gather, then "computes" for cfg.Compute, so the
// prefetch overlaps the compute, as an engine that hashes ahead would.
//
// warm is as in decodeBody.
func (r *geomRun) prefillBody(ctx context.Context, p PathID, d *daemonproc.Daemon, gs *gatherSet, ph *Phase, warm *Phase, open func() (*gatherSet, error)) error {
	var h *hinter
	var pf *Prefetch
	var pfTimes []time.Duration
	var pending <-chan prefetchRec
	sendHints := func(k int) error {
		wait, err := r.sendPrefill(d, h, r.prefill[k])
		if err != nil {
			return err
		}
		ch := make(chan prefetchRec, 1)
		go func() { ch <- wait() }()
		pending = ch
		return nil
	}
	collect := func() {
		if pending == nil {
			return
		}
		rec := <-pending
		pending = nil
		pfTimes = append(pfTimes, rec.dur)
		pf.Pages += rec.pages
		pf.Reads += rec.reads
		if rec.err != nil {
			pf.Failed++
		}
		if rec.dur <= r.cfg.Compute {
			pf.WithinCompute++
		}
	}
	compute := func() error {
		select {
		case <-time.After(r.cfg.Compute):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if p == PathHints {
		var err error
		if h, err = openHinter(d.Mountpoint); err != nil {
			return err
		}
		defer h.Close()
		ph.Barrier, ph.BarrierHow = h.barrier, h.why
		pf = &Prefetch{}
		// The first chunk's hints go out during the compute before it (the
		// previous chunk's, or the prompt's embedding).
		if err := sendHints(0); err != nil {
			return err
		}
		if err := compute(); err != nil {
			collect()
			return err
		}
	}
	defer collect()

	buf := make([]byte, maxRowBytes(gs))
	times := make([]time.Duration, 0, len(r.prefill))
	var warmTimes []time.Duration
	workers := r.cfg.MmapWorkers
	if p == PathPread {
		workers = r.cfg.PreadWorkers
	}
	err := withProcs(workers+2, func() error {
		for k, chunk := range r.prefill {
			if err := ctx.Err(); err != nil {
				return err
			}
			start := time.Now()
			var err error
			switch p {
			case PathPread:
				err = gs.gatherPool(chunk, workers, r.cfg.PreadTaskRows, true, nil)
			case PathMmapWillneed, PathEngramfsWillneed:
				_, err = gs.gatherV3(chunk, buf, nil)
			default:
				err = gs.gatherPool(chunk, workers, r.cfg.PreadTaskRows, false, nil)
			}
			if err != nil {
				return err
			}
			times = append(times, time.Since(start))
			if warm != nil {
				t, err := warmGather(open, func(fresh *gatherSet) error {
					return fresh.gatherPool(chunk, workers, r.cfg.PreadTaskRows, false, nil)
				})
				if err != nil {
					return err
				}
				warmTimes = append(warmTimes, t)
			}
			if err := gs.verify(chunk); err != nil {
				return err
			}
			r.prog.update("chunk %d/%d: %d rows in %s", k+1, len(r.prefill), r.chunkRows[k], fmtDur(times[k]))
			if p == PathHints {
				collect()
				if k+1 < len(r.prefill) {
					if err := sendHints(k + 1); err != nil {
						return err
					}
				}
				if err := compute(); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	var rows, pages int64
	for k := range r.prefill {
		rows += int64(r.chunkRows[k])
		pages += int64(r.chunkPages[k])
	}
	ph.Times, ph.Rows, ph.Pages = Summarize(times), rows, pages
	ph.RowsPerSec = float64(rows) / ph.Times.Sum.Seconds()
	if pf != nil {
		collect()
		pf.setTimes(pfTimes)
		ph.Prefetch = pf
	}
	if warm != nil {
		warm.Cold = "none: each chunk gathered again, through a fresh mapping, right after its timed gather"
		warm.Times, warm.Rows, warm.Pages = Summarize(warmTimes), rows, pages
		warm.RowsPerSec = float64(rows) / warm.Times.Sum.Seconds()
	}
	return nil
}

// prefetchAloneBody sends the prefill hints of one chunk (r.alone) into a
// cold page cache and waits for its barrier, with no gather running: the
// prefetch's own rate, which the prefill phase cannot show (there the
// gather's faults compete for the CPUs and jump the queue).
func (r *geomRun) prefetchAloneBody(d *daemonproc.Daemon, ph *Phase) error {
	h, err := openHinter(d.Mountpoint)
	if err != nil {
		return err
	}
	defer h.Close()
	ph.Barrier, ph.BarrierHow = h.barrier, h.why
	wait, err := r.sendPrefill(d, h, r.alone)
	if err != nil {
		return err
	}
	rec := wait()
	if err := errors.Join(rec.err, rec.statsErr); err != nil {
		return err
	}
	for _, rows := range r.alone {
		ph.Rows += int64(len(rows))
	}
	pf := &Prefetch{Pages: rec.pages, Reads: rec.reads}
	pf.setTimes([]time.Duration{rec.dur})
	ph.Times, ph.Prefetch = pf.Times, pf
	return nil
}

// daemonMark is a daemon's counters at one moment; what a phase cost the
// daemon is the difference of two (daemonMark.since).
type daemonMark struct {
	stats    stats.Snapshot
	cpu      time.Duration
	switches uint64
}

// markDaemon marks d now (nil: no daemon, a zero mark).
func markDaemon(d *daemonproc.Daemon) (daemonMark, error) {
	var m daemonMark
	if d == nil {
		return m, nil
	}
	var err error
	if m.stats, err = d.Stats(); err != nil {
		return m, err
	}
	if m.cpu, err = d.CPU(); err != nil {
		return m, err
	}
	m.switches, err = d.Switches()
	return m, err
}

// since is what the daemon did from m until now: its counters' deltas
// (gauges as they are now), CPU time and context switches.
func (m daemonMark) since(d *daemonproc.Daemon) (daemonMark, error) {
	now, err := markDaemon(d)
	if err != nil {
		return now, err
	}
	return daemonMark{stats: statsDelta(m.stats, now.stats), cpu: now.cpu - m.cpu, switches: now.switches - min(now.switches, m.switches)}, nil
}

// cpuPerPage and switchesPerPage are a difference's CPU (µs) and context
// switches per 4 KiB page of backing reads.
func (m daemonMark) cpuPerPage() float64 { return cpuPerPage(m.cpu, m.stats.BackingBytes) }

func (m daemonMark) switchesPerPage() float64 {
	if m.stats.BackingBytes == 0 {
		return 0
	}
	return float64(m.switches) / (float64(m.stats.BackingBytes) / 4096)
}

// cpuPerPage is cpu in µs per 4 KiB page of backing bytes (0 when no
// backing bytes were read).
func cpuPerPage(cpu time.Duration, backingBytes uint64) float64 {
	if backingBytes == 0 {
		return 0
	}
	return float64(cpu) / 1e3 / (float64(backingBytes) / 4096)
}

// warmGather times gather through a fresh mapping of the same files.
func warmGather(open func() (*gatherSet, error), gather func(*gatherSet) error) (time.Duration, error) {
	fresh, err := open()
	if err != nil {
		return 0, err
	}
	defer fresh.close()
	start := time.Now()
	err = gather(fresh)
	return time.Since(start), err
}

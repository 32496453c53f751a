package bench

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/internal/pagecache"
)

// A rank of the serving loop is a process of its own, as an engine's TP
// ranks are: its own mappings, faults, fadvise calls and control handles.
// The bench runs its own executable again with serveRankEnv set, which
// this package's init turns into a rank (the pattern of s3serve's latency
// proxy: it works for engramfs-bench and for a test binary alike). The
// coordinator sends one JSON line of rankConfig on stdin, then one command
// a line; the rank answers each with one JSON line on stdout. The ranks
// step in lockstep: the coordinator sends a command to every rank and
// waits for every answer before the next, so the block device's counters
// around a decode step hold that step's reads and nothing else of ours.
const serveRankEnv = "ENGRAMFS_BENCH_SERVE_RANK"

func init() {
	if os.Getenv(serveRankEnv) != "" {
		os.Exit(rankMain(os.Stdin, os.Stdout))
	}
}

// rankConfig is what a rank is told before its first command.
type rankConfig struct {
	ModelDir   string    `json:"model_dir"`
	Mountpoint string    `json:"mountpoint,omitempty"` // the mount, for the paths that read it
	Path       PathID    `json:"path"`
	Rank       int       `json:"rank"`
	Seed       uint64    `json:"seed"`
	Spec       ServeSpec `json:"spec"`
	// GatherWorkers gather a prefill chunk (the seed's 96 mmap threads);
	// PrefetchThreads take the v3 prefetch's tasks of PrefetchTaskRows rows
	// (its pool of 32 threads, tasks of 512 rows).
	GatherWorkers    int `json:"gather_workers"`
	PrefetchThreads  int `json:"prefetch_threads"`
	PrefetchTaskRows int `json:"prefetch_task_rows"`
	// VerifySample rows of each layer of a chunk are checked against the
	// model (0: every row); every row of every step is.
	VerifySample int `json:"verify_sample"`
	// DecodeOverlap: gather a decode step before its barrier (ServeConfig).
	DecodeOverlap bool `json:"decode_overlap,omitempty"`
	// DecodePerLayer: a decode handle per layer, a barrier per layer
	// (ServeConfig).
	DecodePerLayer bool `json:"decode_per_layer,omitempty"`
	// DecodeWrites: a write a layer and a barrier read a step, not the
	// step ioctl (ServeConfig).
	DecodeWrites bool `json:"decode_writes,omitempty"`
	// PrefillGatherFirst: gather a chunk, then read the prefill barrier
	// (ServeConfig).
	PrefillGatherFirst bool `json:"prefill_gather_first,omitempty"`
}

// rankCmd is one command: start the prefetch of a chunk, wait for it and
// gather the chunk, run a decode step, or end.
type rankCmd struct {
	Op    string `json:"op"` // "prefetch", "chunk", "step", "end"
	Req   int    `json:"req"`
	Chunk int    `json:"chunk,omitempty"`
	Step  int    `json:"step,omitempty"`
}

// rankReply answers a command (and the config, with Pid).
type rankReply struct {
	Err string `json:"error,omitempty"`
	Pid int    `json:"pid,omitempty"`

	// chunk: waiting for its prefetch, then the gather.
	Wait   time.Duration `json:"wait_ns,omitempty"`
	Gather time.Duration `json:"gather_ns,omitempty"`
	// step: the whole step (hints and barrier included), and of it the
	// hints and barrier (v3: the fadvise calls).
	Step time.Duration `json:"step_ns,omitempty"`
	Hint time.Duration `json:"hint_ns,omitempty"`
	// The barrier's counts (engramfs+hints): a step's decode barrier, a
	// chunk's prefill barrier.
	Status *hints.Status `json:"status,omitempty"`
	// A step's distinct pages, and of them those mincore found resident
	// before the step began.
	Pages    int `json:"pages,omitempty"`
	Resident int `json:"resident,omitempty"`
	// Faults are the rank's page faults during the step (minor and
	// major: getrusage), each an entry to the kernel for a mapped page.
	Faults   int64 `json:"faults,omitempty"`
	Verified int   `json:"verified,omitempty"` // rows checked against the model

	CPU time.Duration `json:"cpu_ns,omitempty"` // end: the rank's CPU time
}

// rankMain serves one rank's commands until "end" or the end of in.
func rankMain(in io.Reader, out io.Writer) int {
	dec := json.NewDecoder(bufio.NewReader(in))
	enc := json.NewEncoder(out)
	var cfg rankConfig
	if err := dec.Decode(&cfg); err != nil {
		enc.Encode(rankReply{Err: fmt.Sprintf("rank: config: %v", err)})
		return 2
	}
	rk, err := newRank(cfg)
	if err != nil {
		enc.Encode(rankReply{Err: fmt.Sprintf("rank %d: %v", cfg.Rank, err)})
		return 1
	}
	defer rk.close()
	if err := enc.Encode(rankReply{Pid: os.Getpid()}); err != nil {
		return 1
	}
	for {
		var c rankCmd
		if err := dec.Decode(&c); err != nil {
			return 0 // the coordinator is gone or done
		}
		if c.Op == "end" {
			enc.Encode(rankReply{CPU: selfCPU()})
			return 0
		}
		rep, err := rk.do(c)
		if err != nil {
			rep.Err = fmt.Sprintf("rank %d %s %d/%d/%d: %v", cfg.Rank, c.Op, c.Req, c.Chunk, c.Step, err)
		}
		if err := enc.Encode(rep); err != nil {
			return 1
		}
	}
}

// rank is one rank's state: its plan, mappings, output buffers, and its
// prefetch in flight.
type rank struct {
	cfg   rankConfig
	model *backing.Model
	plan  []ServeRequest
	gs    *gatherSet
	out   *rowsOut
	buf   []byte
	// The hint handles of engramfs+hints: one for prefill, one for decode,
	// so a decode barrier never waits for a prefill (README, "Hints").
	prefill, decode *hinter
	// layerDecode, with DecodePerLayer, is a decode handle per layer
	// index (layerDecode[0] is decode): a step waits for each layer's
	// rows right before that layer's gather.
	layerDecode []*hinter

	tasks   chan prefetchTask // the v3 prefetch pool's queue
	pending *prefetchWait     // the chunk prefetch started and not waited for
}

// prefetchTask is rows of one layer for the v3 prefetch pool.
type prefetchTask struct {
	layer int
	rows  []uint64
	wait  *prefetchWait
}

// prefetchWait is one chunk's v3 prefetch: its tasks, and the first error.
type prefetchWait struct {
	req, chunk int
	wg         sync.WaitGroup
	mu         sync.Mutex
	err        error // GUARDED_BY(mu)
}

func newRank(cfg rankConfig) (*rank, error) {
	// A goroutine blocked in a page fault or a fadvise keeps its P: the
	// engine's threads are real threads (see gatherPool).
	runtime.GOMAXPROCS(cfg.GatherWorkers + cfg.PrefetchThreads + 4)
	m, err := backing.Load(cfg.ModelDir, backing.DefaultTablePattern)
	if err != nil {
		return nil, err
	}
	var layerRows []uint64
	for _, l := range m.Layers {
		n, _ := m.LayerRows(l)
		layerRows = append(layerRows, n)
	}
	plan, err := ServePlan(cfg.Seed, cfg.Rank, layerRows, cfg.Spec)
	if err != nil {
		return nil, err
	}
	r := &rank{cfg: cfg, model: m, plan: plan}
	if cfg.Path.mounts() {
		r.gs, err = openMount(m, cfg.Mountpoint, cfg.Seed)
	} else {
		r.gs, err = openShards(m, cfg.Seed, unix.MADV_RANDOM)
	}
	if err != nil {
		return nil, err
	}
	r.out = newRowsOut(r.gs, max(cfg.Spec.ChunkRows, cfg.Spec.StepRows))
	r.buf = make([]byte, maxRowBytes(r.gs))
	if cfg.Path == PathHints {
		if r.prefill, err = openHinter(cfg.Mountpoint); err != nil {
			r.close()
			return nil, err
		}
		if r.decode, err = openHinter(cfg.Mountpoint); err != nil {
			r.close()
			return nil, err
		}
		if cfg.DecodePerLayer {
			r.layerDecode = []*hinter{r.decode}
			for range m.Layers[1:] {
				h, err := openHinter(cfg.Mountpoint)
				if err != nil {
					r.close()
					return nil, err
				}
				r.layerDecode = append(r.layerDecode, h)
			}
		}
	}
	if cfg.Path.willneed() {
		r.tasks = make(chan prefetchTask)
		for range cfg.PrefetchThreads {
			go r.prefetchWorker()
		}
	}
	return r, nil
}

func (r *rank) close() {
	if r.tasks != nil {
		close(r.tasks)
	}
	for _, h := range append([]*hinter{r.prefill, r.decode}, r.layerDecode[min(1, len(r.layerDecode)):]...) {
		if h != nil {
			h.Close()
		}
	}
	if r.gs != nil {
		r.gs.close()
	}
}

func (r *rank) do(c rankCmd) (rankReply, error) {
	if c.Req < 0 || c.Req >= len(r.plan) {
		return rankReply{}, fmt.Errorf("no request %d", c.Req)
	}
	rq := r.plan[c.Req]
	switch c.Op {
	case "prefetch", "chunk":
		if c.Chunk < 0 || c.Chunk >= len(rq.Chunks) {
			return rankReply{}, fmt.Errorf("no chunk %d", c.Chunk)
		}
		if c.Op == "prefetch" {
			return rankReply{}, r.startPrefetch(c.Req, c.Chunk, rq.Chunks[c.Chunk])
		}
		return r.chunk(c.Req, c.Chunk, rq.Chunks[c.Chunk])
	case "step":
		if c.Step < 0 || c.Step >= len(rq.Steps) {
			return rankReply{}, fmt.Errorf("no step %d", c.Step)
		}
		return r.step(rq.Steps[c.Step])
	}
	return rankReply{}, fmt.Errorf("unknown command %q", c.Op)
}

// startPrefetch starts warming a chunk's rows and returns: the next
// chunk's prefetch while this one computes. engramfs+hints: a prefill hint
// per layer. v3 (the seed's _hash_ahead): tasks of PrefetchTaskRows rows
// for the pool's threads. mmap: nothing.
func (r *rank) startPrefetch(req, chunk int, rows [][]uint64) error {
	if r.pending != nil {
		return fmt.Errorf("the prefetch of request %d chunk %d was not waited for", r.pending.req, r.pending.chunk)
	}
	switch {
	case r.prefill != nil:
		for j, rs := range rows {
			if err := r.prefill.Prefill(r.model.Layers[j], rs); err != nil {
				return err
			}
		}
	case r.tasks != nil:
		w := &prefetchWait{req: req, chunk: chunk}
		for j, rs := range rows {
			for i := 0; i < len(rs); i += r.cfg.PrefetchTaskRows {
				w.wg.Add(1)
				r.tasks <- prefetchTask{layer: j, rows: rs[i:min(i+r.cfg.PrefetchTaskRows, len(rs))], wait: w}
			}
		}
		r.pending = w
		return nil
	}
	r.pending = &prefetchWait{req: req, chunk: chunk}
	return nil
}

// prefetchWorker is one thread of the v3 prefetch pool, _kai_prefetch_rows:
// weight rows by their exact byte range, smaller tables' rows (the scale
// rows, 32 to a page) once per 4 KiB page a task names.
func (r *rank) prefetchWorker() {
	for tk := range r.tasks {
		var err error
		for _, src := range r.gs.layers[tk.layer] {
			if src.t.Kind == "weight" {
				for _, row := range tk.rows {
					if e := unix.Fadvise(src.fd, src.rowOff(row), src.t.RowBytes, unix.FADV_WILLNEED); e != nil && err == nil {
						err = fmt.Errorf("fadvise willneed %s: %w", src.t.Name, e)
					}
				}
				continue
			}
			pages := map[int64]bool{}
			for _, row := range tk.rows {
				first, last := src.rowOff(row)/backing.PageSize, (src.rowOff(row)+src.t.RowBytes-1)/backing.PageSize
				for p := first; p <= last; p++ {
					if pages[p] {
						continue
					}
					pages[p] = true
					if e := unix.Fadvise(src.fd, p*backing.PageSize, backing.PageSize, unix.FADV_WILLNEED); e != nil && err == nil {
						err = fmt.Errorf("fadvise willneed %s: %w", src.t.Name, e)
					}
				}
			}
		}
		if err != nil {
			tk.wait.mu.Lock()
			tk.wait.err = cmp.Or(tk.wait.err, err)
			tk.wait.mu.Unlock()
		}
		tk.wait.wg.Done()
	}
}

// chunk waits for the chunk's prefetch (v3: its tasks; engramfs+hints: the
// prefill handle's barrier), then gathers its rows with GatherWorkers
// threads (the seed's pool gather of a chunk above its inline limit), then
// checks them.
func (r *rank) chunk(req, chunk int, rows [][]uint64) (rankReply, error) {
	var rep rankReply
	w := r.pending
	if w == nil || w.req != req || w.chunk != chunk {
		return rep, fmt.Errorf("request %d chunk %d: its prefetch was not started", req, chunk)
	}
	r.pending = nil
	start := time.Now()
	w.wg.Wait()
	w.mu.Lock()
	err := w.err
	w.mu.Unlock()
	if err != nil {
		return rep, err
	}
	if r.prefill != nil && !r.cfg.PrefillGatherFirst {
		st, err := r.prefill.WaitStatus()
		if err != nil {
			return rep, err
		}
		rep.Status = &st
	}
	rep.Wait = time.Since(start)
	total := 0
	for _, rs := range rows {
		total += len(rs)
	}
	per := max(1, (total+r.cfg.GatherWorkers-1)/r.cfg.GatherWorkers)
	t := time.Now()
	if err := r.gs.gatherPool(rows, r.cfg.GatherWorkers, per, false, r.out); err != nil {
		return rep, err
	}
	rep.Gather = time.Since(t)
	if r.prefill != nil && r.cfg.PrefillGatherFirst {
		// The counts, and the pages the gather did not fault settled:
		// timed as the chunk's wait.
		t := time.Now()
		st, err := r.prefill.WaitStatus()
		if err != nil {
			return rep, err
		}
		rep.Status = &st
		rep.Wait += time.Since(t)
	}
	rep.Verified, err = r.gs.verifyOut(rows, r.out, r.cfg.VerifySample)
	return rep, err
}

// step is one decode step, its rows known only now. mmap: the gather.
// v3: fadvise(WILLNEED) on every row's range, then the gather
// (DSV41_ENGRAM_MMAP_INLINE_ROWS). engramfs+hints: the step (a decode
// frame per layer and the barrier in one ioctl; with DecodeWrites a write
// per layer and a barrier read), then the gather. Before it, untimed, mincore counts
// the step's pages already resident.
func (r *rank) step(rows [][]uint64) (rankReply, error) {
	var rep rankReply
	var err error
	if rep.Pages, rep.Resident, err = r.resident(rows); err != nil {
		return rep, err
	}
	var ru0 unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru0); err != nil {
		return rep, err
	}
	start := time.Now()
	switch {
	case r.layerDecode != nil:
		// Every layer's hints first, each on its layer's handle; then
		// layer by layer its barrier and its gather, so the later
		// layers' reads and stores go on while the earlier layers are
		// gathered (an engine: while they are computed).
		for j, rs := range rows {
			if err := r.layerDecode[j].Decode(r.model.Layers[j], rs); err != nil {
				return rep, err
			}
		}
		var all hints.Status
		for j, rs := range rows {
			st, err := r.layerDecode[j].WaitStatus()
			if err != nil {
				return rep, err
			}
			all.Add(st)
			if j == 0 {
				rep.Hint = time.Since(start)
			}
			if err := r.gs.gatherLayer(j, rs, r.buf, r.out); err != nil {
				return rep, err
			}
		}
		rep.Status = &all
	case r.decode != nil && !r.cfg.DecodeOverlap && !r.cfg.DecodeWrites:
		// Every layer's frame and the barrier in one request (the step).
		st, err := r.decode.Step(r.model.Layers, rows)
		if err != nil {
			return rep, err
		}
		rep.Status = &st
		rep.Hint = time.Since(start)
		err = r.gs.gatherSerial(rows, r.buf, r.out)
	case r.decode != nil:
		for j, rs := range rows {
			if err := r.decode.Decode(r.model.Layers[j], rs); err != nil {
				return rep, err
			}
		}
		if r.cfg.DecodeOverlap {
			// The gather first: a page not pushed yet is a fault that
			// joins its read in flight (the loader's singleflight, or
			// its hold once read); the barrier then only collects the
			// counts.
			rep.Hint = time.Since(start)
			if err = r.gs.gatherSerial(rows, r.buf, r.out); err != nil {
				return rep, err
			}
		}
		st, err := r.decode.WaitStatus()
		if err != nil {
			return rep, err
		}
		rep.Status = &st
		if !r.cfg.DecodeOverlap {
			rep.Hint = time.Since(start)
			err = r.gs.gatherSerial(rows, r.buf, r.out)
		}
	case r.cfg.Path.willneed():
		rep.Hint, err = r.gs.gatherV3(rows, r.buf, r.out)
	default:
		err = r.gs.gatherSerial(rows, r.buf, r.out)
	}
	if err != nil {
		return rep, err
	}
	rep.Step = time.Since(start)
	var ru1 unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru1); err != nil {
		return rep, err
	}
	rep.Faults = (ru1.Minflt + ru1.Majflt) - (ru0.Minflt + ru0.Majflt)
	rep.Verified, err = r.gs.verifyOut(rows, r.out, 0)
	return rep, err
}

// resident counts the distinct pages of the step's rows, in the files this
// rank maps, and those of them in the page cache (mincore: nothing faulted).
func (r *rank) resident(rows [][]uint64) (pages, resident int, _ error) {
	seen := map[[2]int64]bool{}
	var vec [1]byte
	ps := int64(os.Getpagesize())
	for j, rs := range rows {
		for ti, src := range r.gs.layers[j] {
			for _, row := range rs {
				off := src.rowOff(row)
				for p := off / ps; p <= (off+src.t.RowBytes-1)/ps; p++ {
					k := [2]int64{int64(j<<8 | ti), p}
					if seen[k] {
						continue
					}
					seen[k] = true
					pages++
					if e := pagecache.Mincore(src.data[p*ps:min((p+1)*ps, int64(len(src.data)))], vec[:]); e != nil {
						return 0, 0, fmt.Errorf("mincore %s: %w", src.t.Name, e)
					}
					if vec[0]&1 != 0 {
						resident++
					}
				}
			}
		}
	}
	return pages, resident, nil
}

package bench

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/engramfs/engramfs/backing"
)

// The serving loop's targets (issue 21), judged per geometry and rank
// count: engramfs+hints against v3 on the shards (path 3's code) and
// against the disk and fio.
const (
	TargetServeDecodeP50   = "serve-decode-p50-vs-v3"          // decode step p50 ≤ 0.8× v3's
	TargetServeDecodeFloor = "serve-decode-p50-vs-floor"       // decode step p50 ≤ 1.25× the step's floor (its cold reads as one burst)
	TargetServeDecodeP99   = "serve-decode-p99-vs-v3"          // decode step p99 ≤ 0.6× v3's
	TargetServeColdReads   = "serve-cold-reads-vs-v3"          // device reads a decode step ≤ 0.75× v3's
	TargetServePrefill     = "serve-prefill-vs-v3"             // prefill chunk (wait + gather) mean ≤ 1.0× v3's
	TargetServeDiskBytes   = "serve-disk-bytes-vs-v3"          // disk bytes over the run ≤ 0.6× v3's
	TargetServeDistinct    = "serve-backing-per-distinct-page" // backing bytes per distinct page asked ≤ 1.1
	TargetServeCPU         = "serve-cpu-vs-fio"                // daemon CPU per backing page ≤ 2× fio's CPU per read
)

// serveTargets judges the serving loop's targets where engramfs+hints and
// their reference ran. Without a memory limit, or without the block
// device's counters, the targets that need them are reported, not judged.
func (r *Report) serveTargets() []Target {
	s := r.Serve
	if s == nil {
		return nil
	}
	var out []Target
	for _, run := range s.Runs {
		h, v3 := run.path(PathHints), run.path(PathMmapWillneed)
		if h == nil {
			continue
		}
		add := func(t Target, unmet string) {
			t.Geometry, t.Ranks = run.Geometry.Name, run.Ranks
			t.Name = fmt.Sprintf("serving ×%d: %s", run.Ranks, t.Name)
			if t.Unmet = unmet; t.Unmet == "" && s.NoCgroup != "" {
				t.Unmet = "no memory limit (" + s.NoCgroup + ")"
			}
			t.judge()
			if t.Unmet != "" {
				t.Met = false
			}
			out = append(out, t)
		}
		noDev := ""
		if s.Device == nil {
			noDev = "no block device counters (" + s.NoDevice + ")"
		}
		if v3 != nil {
			add(Target{ID: TargetServeDecodeP50, Name: "decode p50: engramfs+hints ≤ 0.8× v3 on the shards", Bound: 0.8,
				Value:  ratio(float64(h.Decode.P50), float64(v3.Decode.P50)),
				Detail: fmt.Sprintf("%s vs %s", fmtDur(h.Decode.P50), fmtDur(v3.Decode.P50))}, "")
			add(Target{ID: TargetServeDecodeP99, Name: "decode p99: engramfs+hints ≤ 0.6× v3 on the shards", Bound: 0.6,
				Value:  ratio(float64(h.Decode.P99), float64(v3.Decode.P99)),
				Detail: fmt.Sprintf("%s vs %s", fmtDur(h.Decode.P99), fmtDur(v3.Decode.P99))}, "")
			add(Target{ID: TargetServeColdReads, Name: "cold reads a decode step: engramfs+hints ≤ 0.75× v3's", Bound: 0.75,
				Value:  ratio(h.ColdReads, v3.ColdReads),
				Detail: fmt.Sprintf("%.1f vs %.1f device reads a step; of pages no earlier chunk or step named (no cache saves these), %.1f vs %.1f", h.ColdReads, v3.ColdReads, h.NewReads, v3.NewReads)}, noDev)
			add(Target{ID: TargetServePrefill, Name: "prefill chunk (wait + gather): engramfs+hints ≤ 1.0× v3", Bound: 1,
				Value: ratio(float64(h.Chunk.Mean), float64(v3.Chunk.Mean)),
				Detail: fmt.Sprintf("%s vs %s a chunk (mean; waits %s vs %s)", fmtDur(h.Chunk.Mean), fmtDur(v3.Chunk.Mean),
					fmtDur(h.ChunkWait.Mean), fmtDur(v3.ChunkWait.Mean))}, "")
			add(Target{ID: TargetServeDiskBytes, Name: "disk bytes: engramfs+hints ≤ 0.6× v3", Bound: 0.6,
				Value:  ratio(float64(h.Disk.Bytes), float64(v3.Disk.Bytes)),
				Detail: fmt.Sprintf("%s vs %s (%s vs %s reads)", fmtBytes(float64(h.Disk.Bytes)), fmtBytes(float64(v3.Disk.Bytes)), fmtCount(float64(h.Disk.Reads)), fmtCount(float64(v3.Disk.Reads)))}, noDev)
		}
		floorUnmet := noDev
		if floorUnmet == "" && h.Floor <= 0 {
			floorUnmet = "no cold reads in the median step: no floor"
		}
		add(Target{ID: TargetServeDecodeFloor, Name: "decode p50: engramfs+hints ≤ 1.25× the step's floor", Bound: 1.25,
			Value:  ratio(float64(h.Decode.P50), float64(h.Floor)),
			Detail: fmt.Sprintf("%s vs %s (a burst of its %.1f cold reads a step, p50 over steps)", fmtDur(h.Decode.P50), fmtDur(h.Floor), h.ColdReads)}, floorUnmet)
		if d := h.Daemon; d != nil {
			add(Target{ID: TargetServeDistinct, Name: "backing bytes / distinct page asked (engramfs+hints) ≤ 1.1", Bound: 1.1,
				Value: h.BytesPerDistinct,
				Detail: fmt.Sprintf("%s for %s distinct pages; reading each once would be %.3f (O_DIRECT's %d-byte alignment on unaligned shards): %.2f× that",
					fmtBytes(float64(d.Stats.BackingBytes)), fmtCount(float64(run.MountPages)),
					ratio(float64(run.MountReadOnce), float64(run.MountPages)*backing.PageSize), run.Align, h.ReadOnce)}, "")
			t := Target{ID: TargetServeCPU, Name: "daemon CPU/backing page (engramfs+hints) ≤ 2× fio's/read", Bound: 2}
			unmet := ""
			if f := r.Fio; f == nil || f.CPUPerRead <= 0 {
				unmet = "no fio floor"
				t.Detail = fmt.Sprintf("%.1f µs a backing page vs n/a", d.CPUPerPage)
			} else {
				t.Value = ratio(d.CPUPerPage, f.CPUPerRead)
				t.Detail = fmt.Sprintf("%.1f µs a backing page (%s CPU, %s read) vs %.1f µs a read", d.CPUPerPage, fmtDur(d.CPU), fmtBytes(float64(d.Stats.BackingBytes)), f.CPUPerRead)
			}
			add(t, unmet)
		}
	}
	return out
}

// writeServe prints the serving loop: the setup, the floor, then a table
// per geometry and rank count.
func (r *Report) writeServe(w io.Writer) {
	s := r.Serve
	if s == nil {
		return
	}
	sp := s.Spec
	fmt.Fprintf(w, "\nserving loop: %d requests, each %d prefill chunks of %d rows a layer (%.0f%% from the far tail) then %d decode steps of %d Zipf(s=%.2g) lookups a layer; compute %v a chunk (the next chunk prefetched meanwhile), %v a step\n",
		sp.Requests, sp.Chunks, sp.ChunkRows, 100*sp.RareFraction, sp.Steps, sp.StepRows, sp.S, s.Compute, s.DecodeCompute)
	if s.DecodeOverlap {
		fmt.Fprintln(w, "decode overlap: engramfs+hints gathers each step right after its hints and reads the barrier after the gather (hints + barrier: the hint writes alone)")
	}
	if s.PrefillGatherFirst {
		fmt.Fprintln(w, "prefill gather first: engramfs+hints gathers each chunk without waiting for its prefill hints, then reads the prefill barrier (its time is the chunk's wait)")
	}
	if s.DecodeWrites {
		fmt.Fprintln(w, "decode writes: engramfs+hints sends each step's hints as a write a layer, then reads the barrier (not the step ioctl)")
	}
	if s.DecodePerLayer {
		fmt.Fprintln(w, "decode per layer: engramfs+hints sends each layer's hints on a handle of its own and reads each layer's barrier right before its gather (hints + barrier: the hints and the first layer's barrier)")
	}
	if s.Cgroup != "" {
		fmt.Fprintf(w, "memory: the ranks and the daemon in a %s; daemon --cache-size %s\n", s.Cgroup, s.CacheSize)
	} else {
		fmt.Fprintf(w, "memory: NO LIMIT: %s; ran without a memory cgroup, so the tables may fit in RAM and the targets are not judged (daemon --cache-size %s)\n", s.NoCgroup, s.CacheSize)
	}
	switch {
	case s.Device != nil && s.IOFrom == ioFromCgroup:
		fmt.Fprintf(w, "disk: %s; disk bytes and reads are the serving processes' own (their cgroup's block-layer counts: readahead, fadvise and O_DIRECT reads of the ranks and the daemon); dev: the device's (%s), every process's\n", s.Device.Name, s.Device.StatPath)
	case s.Device != nil:
		fmt.Fprintf(w, "disk: %s; disk bytes and reads are the device's (%s), every process's: other work on the machine adds to them\n", s.Device.Name, s.Device.StatPath)
	default:
		fmt.Fprintf(w, "disk: no counters: %s\n", s.NoDevice)
	}
	if f := s.Floor; f != nil {
		var pts []string
		for _, p := range f.Points {
			pts = append(pts, fmt.Sprintf("%d %s", p.N, fmtDur(p.P50)))
		}
		fmt.Fprintf(w, "step floor: bursts of n random 4 KiB O_DIRECT reads (%s, p50, best of %d measurements): %s\n", f.Engine, len(s.FloorRuns), strings.Join(pts, ", "))
	}
	for _, run := range s.Runs {
		g := run.Geometry
		fmt.Fprintf(w, "\n%s, %d rank process", g, run.Ranks)
		if run.Ranks > 1 {
			fmt.Fprint(w, "es")
		}
		fmt.Fprintf(w, "  (%s)\n", run.ModelDir)
		sh := run.Shape
		fmt.Fprintf(w, "plan (a rank): %s rows a chunk, %.0f%% of them named by no other chunk or step; %d lookups a step, %.0f%% of rows named before; all ranks: %s distinct pages (mount layout), %s (shards)\n",
			fmtCount(float64(sh.ChunkRows)), 100*sh.ChunkSingletons, sh.StepLookups, 100*sh.StepSeenBefore, fmtCount(float64(run.MountPages)), fmtCount(float64(run.ShardPages)))
		fmt.Fprintf(w, "%-20s │ %34s │ %19s │ %24s │ %31s │ %17s │ %19s │ %16s\n", "", "decode step", "cold a step", "prefill chunk", "disk", "per distinct page", "daemon", "memory")
		fmt.Fprintf(w, "%-20s │ %6s %6s %6s %6s %6s │ %5s %5s %7s │ %7s %7s %8s │ %8s %6s %6s %8s │ %4s %4s %7s │ %5s %5s %7s │ %7s %8s\n",
			"path", "p50", "p99", "floor", "×v3", "×floor", "reads", "new", "cached", "mean", "wait", "×v3", "bytes", "reads", "×v3", "dev", "B", "once", "reread", "µs/pg", "sw/pg", "tier", "peak", "refaults")
		fmt.Fprintln(w, strings.Repeat("─", 21)+"┼"+strings.Repeat("─", 36)+"┼"+strings.Repeat("─", 21)+"┼"+strings.Repeat("─", 26)+"┼"+strings.Repeat("─", 33)+"┼"+strings.Repeat("─", 19)+"┼"+strings.Repeat("─", 21)+"┼"+strings.Repeat("─", 17))
		v3 := run.path(PathMmapWillneed)
		for _, p := range run.Paths {
			switch {
			case p.Skipped != "":
				fmt.Fprintf(w, "%-20s │ skipped: %s\n", p.Label, p.Skipped)
				continue
			case p.Failed != "":
				first, _, _ := strings.Cut(p.Failed, "\n")
				fmt.Fprintf(w, "%-20s │ FAILED: %s\n", p.Label, first)
				continue
			}
			vs := func(a, b float64) string { return fmtRatio(ratio(a, b)) }
			dec := [5]string{fmtDur(p.Decode.P50), fmtDur(p.Decode.P99), fmtDur(p.Floor), "-", fmtRatio(ratio(float64(p.Decode.P50), float64(p.Floor)))}
			chunk := [3]string{fmtDur(p.Chunk.Mean), fmtDur(p.ChunkWait.Mean), "-"}
			disk := [4]string{fmtBytes(float64(p.Disk.Bytes)), fmtCount(float64(p.Disk.Reads)), "-", fmtBytes(float64(p.Device.Bytes()))}
			if v3 != nil {
				dec[3] = vs(float64(p.Decode.P50), float64(v3.Decode.P50))
				chunk[2] = vs(float64(p.Chunk.Mean), float64(v3.Chunk.Mean))
				disk[2] = vs(float64(p.Disk.Bytes), float64(v3.Disk.Bytes))
			}
			cached := "-"
			if p.StepPages > 0 {
				cached = fmt.Sprintf("%.0f%%", 100*float64(p.StepResident)/float64(p.StepPages))
			}
			dm := [3]string{"-", "-", "-"}
			if d := p.Daemon; d != nil {
				dm = [3]string{sig3(d.CPUPerPage), fmt.Sprintf("%.2f", d.SwitchesPerPage), fmtMiB(d.Stats.CacheUsedBytes)}
			}
			mem := [2]string{"-", "-"}
			if m := p.Memory; m != nil {
				mem = [2]string{fmtMiB(m.Peak), fmtCount(float64(m.Refaults))}
			}
			reread := fmtCount(p.Reread)
			fmt.Fprintf(w, "%-20s │ %6s %6s %6s %6s %6s │ %5.1f %5.1f %7s │ %7s %7s %8s │ %8s %6s %6s %8s │ %4s %4s %7s │ %5s %5s %7s │ %7s %8s\n",
				p.Label, dec[0], dec[1], dec[2], dec[3], dec[4], p.ColdReads, p.NewReads, cached, chunk[0], chunk[1], chunk[2],
				disk[0], disk[1], disk[2], disk[3], fmtRatio(p.BytesPerDistinct), fmtRatio(p.ReadOnce), reread, dm[0], dm[1], dm[2], mem[0], mem[1])
		}
		for _, p := range run.Paths {
			if !p.measured() || p.DecodeBarrier == nil || p.Decode.N == 0 {
				continue
			}
			b, n := p.DecodeBarrier, float64(p.Decode.N)
			fmt.Fprintf(w, "%s decode barriers a step (all ranks): %.0f pages hinted, %.0f pinned, %.0f resident (%.0f of them found cached, %.0f fetched), %.0f failed; hints + barrier p50 %s of the step's %s",
				p.Label, float64(b.Pages)/n, float64(b.Pinned)/n, float64(b.Resident)/n, float64(b.Cached)/n, float64(b.Resident-b.Cached)/n, float64(b.Failed)/n, fmtDur(p.Hint.P50), fmtDur(p.Decode.P50))
			if pb := p.PrefillBarrier; pb != nil && p.Chunk.N > 0 {
				c := float64(p.Chunk.N)
				fmt.Fprintf(w, "; prefill barriers a chunk: %.0f pages, %.0f dropped, %.0f failed", float64(pb.Pages)/c, float64(pb.Dropped)/c, float64(pb.Failed)/c)
			}
			if d := p.Daemon; d != nil {
				fmt.Fprintf(w, "; %s hinted pages FUSE read anyway, %s pushed pages evicted before use", fmtCount(float64(d.Refaulted)), fmtCount(float64(d.Stats.PrefetchPushedEvicted)))
			}
			fmt.Fprintln(w)
		}
		for _, p := range run.Paths {
			if !p.measured() || p.Hint == nil || p.DecodeGather == nil || p.Decode.N == 0 {
				continue
			}
			before := "hints + barrier"
			if p.Path.willneed() {
				before = "fadvise calls"
			}
			fmt.Fprintf(w, "%s decode step, p50 (p99) of its parts: %s %s (%s), then the gather %s (%s); %.0f page faults a step (all ranks)\n",
				p.Label, before, fmtDur(p.Hint.P50), fmtDur(p.Hint.P99), fmtDur(p.DecodeGather.P50), fmtDur(p.DecodeGather.P99), float64(p.StepFaults)/float64(p.Decode.N))
		}
		var elapsed time.Duration
		for _, p := range run.Paths {
			elapsed += p.Elapsed
		}
		fmt.Fprintf(w, "decode and chunk times are the slowest rank's; floor: a burst of the step's device reads (p50 over steps); new: the reads a step needs for pages no earlier chunk or step named, in the path's layout (compulsory: no cache saves them); cached: the steps' pages resident before the step (mincore); per distinct page: backing bytes (the daemon's, else the disk's) per distinct page asked × 4096, the same per byte of reading each page once, and the pages read more than once (the shards': the cgroup's refaults; the mount's: the daemon's backing_pages_again); tier: cache_used_bytes at the end; memory: the cgroup's peak and its refaults (file pages read again after it evicted them); %v of serving\n", elapsed.Round(time.Second))
	}
}

package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	units "github.com/docker/go-units"

	"github.com/engramfs/engramfs/internal/stats"
)

func init() {
	register("stats", "show a mount's counters (once, as JSON, or refreshing with rates)", runStats)
}

// defaultWatchInterval is --watch without a value.
const defaultWatchInterval = time.Second

// watchFlag is --watch, --watch=2s, or --watch 2s (the value taken from the
// positional arguments).
type watchFlag struct {
	on       bool
	interval time.Duration
}

func (w *watchFlag) IsBoolFlag() bool { return true }

func (w *watchFlag) String() string {
	if w == nil || !w.on {
		return ""
	}
	return w.interval.String()
}

func (w *watchFlag) Set(s string) error {
	switch s {
	case "true":
		w.on, w.interval = true, defaultWatchInterval
		return nil
	case "false":
		w.on = false
		return nil
	}
	d, err := parseInterval(s)
	if err != nil {
		return err
	}
	w.on, w.interval = true, d
	return nil
}

// parseInterval takes a Go duration (500ms, 2s) or seconds (2, 0.5).
func parseInterval(s string) (time.Duration, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		f, ferr := strconv.ParseFloat(s, 64)
		if ferr != nil {
			return 0, fmt.Errorf("interval %q: want a duration such as 2s or 500ms, or seconds", s)
		}
		d = time.Duration(f * float64(time.Second))
	}
	if d < 10*time.Millisecond {
		return 0, fmt.Errorf("interval %q: want at least 10ms", s)
	}
	return d, nil
}

func runStats(args []string) error {
	fl := newFlagSet("stats", "[--json] [--watch [INTERVAL]] [--count N] MOUNT", `
Shows the counters of the engramfs mount at MOUNT (its .engramfs/stats) as a
table: page faults, backing reads (and the object store's, for one), the hot
tier, hints and prefetch, the warm restart, and hint accuracy per layer; each
field with a few words on what it counts (the full meanings: the stats table
of docs/operations.md). --json prints the stats file as it is.
--watch refreshes the table in place every INTERVAL (default 1s; 500ms, 2s or
a number of seconds) and adds rates over the last interval: faults/s, hot-tier
hit ratio, backing MB/s, prefetched pages/s and hinted rows/s, late
prefetches/s. Ctrl-C stops it.`)
	asJSON := fl.Bool("json", false, "print the raw JSON of .engramfs/stats")
	var watch watchFlag
	fl.Var(&watch, "watch", "refresh every `INTERVAL` (default 1s) and show rates")
	count := fl.Int("count", 0, "with --watch: stop after N refreshes (0: until interrupted)")
	pos, err := parseInterspersed(fl, args)
	if err != nil {
		return err
	}
	if watch.on && len(pos) == 2 {
		// --watch 2s MOUNT or MOUNT --watch 2s: the interval is the one
		// that parses as one and is not a directory.
		for i, p := range pos {
			if d, err := parseInterval(p); err == nil {
				if fi, serr := os.Stat(p); serr != nil || !fi.IsDir() {
					watch.interval = d
					pos = slices.Delete(pos, i, i+1)
					break
				}
			}
		}
	}
	if len(pos) != 1 {
		return usagef("want MOUNT, got %d arguments", len(pos))
	}
	if *asJSON && watch.on {
		return usagef("--json and --watch do not mix (for a time series, scrape --metrics-addr)")
	}
	mount := pos[0]
	if *asJSON {
		// The daemon's own bytes: fields that this binary does not know
		// (a newer daemon) or that the daemon lacks (an older one) stay
		// as they are, not decoded and re-encoded.
		b, err := os.ReadFile(filepath.Join(mount, stats.RelPath))
		if err != nil {
			return fmt.Errorf("%s: not an engramfs mount? %w", mount, err)
		}
		_, err = os.Stdout.Write(b)
		return err
	}
	if !watch.on {
		s, err := stats.ReadFile(mount)
		if err != nil {
			return err
		}
		renderStats(os.Stdout, mount, s, nil, 0)
		return nil
	}
	return watchStats(os.Stdout, mount, watch.interval, *count, isTerminal(os.Stdout))
}

// watchStats redraws the table every interval: in place on a terminal (ANSI
// home and clear), as successive tables elsewhere (a log keeps them all).
func watchStats(w io.Writer, mount string, interval time.Duration, count int, tty bool) error {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sig)
	var prev *stats.Snapshot
	var prevAt time.Time
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for n := 0; count == 0 || n < count; n++ {
		if n > 0 {
			select {
			case <-sig:
				return nil
			case <-tick.C:
			}
		}
		s, err := stats.ReadFile(mount)
		if err != nil {
			return err
		}
		now := time.Now()
		if tty {
			fmt.Fprint(w, "\x1b[H\x1b[2J")
		} else if n > 0 {
			fmt.Fprintln(w)
		}
		renderStats(w, mount, s, prev, now.Sub(prevAt))
		prev, prevAt = &s, now
	}
	return nil
}

// rates are the watch line: what changed over the last interval.
type rates struct {
	faults, backingMBps, pagesPushed, rowsHinted, late float64
	hitRatio                                           float64 // -1: no lookups
}

func computeRates(cur, prev stats.Snapshot, dt time.Duration) rates {
	sec := dt.Seconds()
	if sec <= 0 {
		sec = 1
	}
	per := func(a, b uint64) float64 {
		if a < b { // a restarted daemon: counters went back to zero
			return 0
		}
		return float64(a-b) / sec
	}
	r := rates{
		faults:      per(cur.FuseReads, prev.FuseReads),
		backingMBps: per(cur.BackingBytes, prev.BackingBytes) / 1e6,
		pagesPushed: per(cur.PrefetchPagesStored, prev.PrefetchPagesStored),
		rowsHinted:  per(cur.HintRows, prev.HintRows),
		late:        per(cur.PrefetchLate, prev.PrefetchLate),
		hitRatio:    -1,
	}
	if cur.CacheHits >= prev.CacheHits && cur.CacheMisses >= prev.CacheMisses {
		if h, m := cur.CacheHits-prev.CacheHits, cur.CacheMisses-prev.CacheMisses; h+m > 0 {
			r.hitRatio = float64(h) / float64(h+m)
		}
	}
	return r
}

func percent(num, den uint64) string {
	if den == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(num)/float64(den))
}

func bytesStr(n uint64) string { return units.BytesSize(float64(n)) }

// renderStats writes the table. With prev, a line of rates over dt leads.
func renderStats(w io.Writer, mount string, s stats.Snapshot, prev *stats.Snapshot, dt time.Duration) {
	fmt.Fprintf(w, "engramfs %s   %s\n", mount, time.Now().Format("2006-01-02 15:04:05"))
	if prev != nil {
		r := computeRates(s, *prev, dt)
		hit := "-"
		if r.hitRatio >= 0 {
			hit = fmt.Sprintf("%.1f%%", 100*r.hitRatio)
		}
		fmt.Fprintf(w, "over %.1fs: %.0f faults/s · hit ratio %s · backing %.1f MB/s · prefetched %.0f pages/s (%.0f rows/s hinted) · %.0f late prefetches/s\n",
			dt.Seconds(), r.faults, hit, r.backingMBps, r.pagesPushed, r.rowsHinted, r.late)
	}
	// One tabwriter for every section, so the columns line up across them;
	// trailing padding is trimmed. The rows and their labels are
	// stats.Fields, in its order.
	var buf bytes.Buffer
	tw := tabwriter.NewWriter(&buf, 0, 0, 2, ' ', 0)
	group, show := "", false
	var layerFields []stats.Field
	for _, f := range stats.Fields {
		if f.PerLayer() {
			layerFields = append(layerFields, f)
			continue
		}
		if f.Group != group {
			group, show = f.Group, showGroup(s, f.Group)
			if show {
				fmt.Fprintf(tw, "\t\t\n%s\t\t\n", group)
			}
		}
		if !show {
			continue
		}
		value, label := statValue(s, f), f.Label
		if f.Name == "cache_misses" {
			label += " (hit ratio " + percent(s.CacheHits, s.CacheHits+s.CacheMisses) + ")"
		}
		fmt.Fprintf(tw, "  %s\t%v\t%s\n", f.Name, value, label)
	}
	tw.Flush()

	if len(s.Layers) > 0 {
		head, cols := "", "  layer\t"
		for i, f := range layerFields {
			if i > 0 {
				head += ", "
			}
			head += f.Label + " (" + f.JSONKey() + ")"
			cols += f.JSONKey() + "\t"
		}
		fmt.Fprintf(&buf, "\n%s (%s): %s\n", stats.GroupLayers, strings.TrimSuffix(stats.LayerPrefix, "."), head)
		tw = tabwriter.NewWriter(&buf, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, cols)
		layers := make([]int, 0, len(s.Layers))
		for l := range s.Layers {
			layers = append(layers, l)
		}
		slices.Sort(layers)
		for _, l := range layers {
			fmt.Fprintf(tw, "  %d\t", l)
			for _, f := range layerFields {
				fmt.Fprintf(tw, "%v\t", s.Value(f, l))
			}
			fmt.Fprintln(tw)
		}
		tw.Flush()
	}
	for _, line := range strings.SplitAfter(buf.String(), "\n") {
		io.WriteString(w, strings.TrimRight(line, " \n"))
		if strings.HasSuffix(line, "\n") {
			io.WriteString(w, "\n")
		}
	}
}

// showGroup hides the object store's sections on a mount of a directory,
// where they are all zero.
func showGroup(s stats.Snapshot, group string) bool {
	if group != stats.GroupS3 && group != stats.GroupMirror || s.ReadEngine == "s3" {
		return true
	}
	for _, f := range stats.Fields {
		if f.Group == group && s.Value(f, 0) != uint64(0) {
			return true
		}
	}
	return false
}

// statValue is field f of s for the table: sizes in bytes read as sizes,
// the used part of the hot tier with its share of the budget.
func statValue(s stats.Snapshot, f stats.Field) any {
	v := s.Value(f, 0)
	if f.Unit == "bytes" {
		n := uint64(0)
		switch x := v.(type) {
		case uint64:
			n = x
		case int64:
			n = uint64(max(x, 0))
		}
		if f.Name == "cache_used_bytes" {
			return fmt.Sprintf("%s (%s)", bytesStr(n), percent(n, uint64(max(s.CacheCapacityBytes, 0))))
		}
		return bytesStr(n)
	}
	if v == "" {
		return "-"
	}
	return v
}

package bench

import (
	"cmp"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// pathColors gives each path one color in every panel: the shard paths in
// greys and blues, engramfs in oranges, the warm reference green.
var pathColors = map[PathID]color.RGBA{
	PathPread:        {0x88, 0x88, 0x88, 0xff},
	PathMmap:         {0x44, 0x55, 0x66, 0xff},
	PathMmapRA:       {0x99, 0xaa, 0xbb, 0xff},
	PathMmapWillneed: {0x33, 0x77, 0xbb, 0xff},
	PathEngramfs:     {0xee, 0x99, 0x33, 0xff},
	PathHints:        {0xdd, 0x55, 0x11, 0xff},
	PathWarm:         {0x44, 0xaa, 0x55, 0xff},

	PathEngramfsWillneed: {0xee, 0xbb, 0x66, 0xff},
}

// shortLabel is a path's name under its bar.
func shortLabel(p PathID) string {
	switch p {
	case PathMmapRA:
		return "2' mmap RA"
	case PathMmapWillneed:
		return "3 willneed"
	case PathEngramfsWillneed:
		return "4' willneed"
	case PathHints:
		return "5 +hints"
	case PathWarm:
		return "warm"
	}
	return strings.TrimSpace(p.Label())
}

// Plot draws the report as a PNG: per geometry, the decode step p50 (lower
// is better) and the prefill gather rate (higher is better) of every path,
// on log scales, with the disk's limit as a dashed line.
func (r *Report) Plot(path string) error {
	rows := make([][]*plot.Plot, len(r.Geometries))
	for i, g := range r.Geometries {
		var ids []PathID
		var dec, pre []float64
		// The warm reference goes last: it is the floor, not a contender.
		paths := slices.Clone(g.Paths)
		slices.SortStableFunc(paths, func(a, b *PathResult) int {
			return cmp.Compare(boolInt(a.Path == PathWarm), boolInt(b.Path == PathWarm))
		})
		for _, p := range paths {
			if !p.measured() {
				continue
			}
			ids = append(ids, p.Path)
			d, q := math.NaN(), math.NaN()
			if p.Decode != nil && p.Decode.Times.N > 0 {
				d = p.Decode.Times.P50.Seconds() * 1e3
			}
			if p.Prefill != nil && p.Prefill.RowsPerSec > 0 {
				q = p.Prefill.RowsPerSec
			}
			dec = append(dec, d)
			pre = append(pre, q)
		}
		geo := fmt.Sprintf("%s (%d+%d B rows)", g.Geometry.Name, g.Geometry.WeightRow, g.Geometry.ScaleRow)
		decLimit, preLimit := math.NaN(), math.NaN()
		if r.Disk != nil && r.Disk.QD1.P50 > 0 {
			decLimit = r.Disk.QD1.P50.Seconds() * 1e3
		}
		if g.LimitChunkSec > 0 && len(g.ChunkRows) > 0 {
			var n float64
			for _, c := range g.ChunkRows {
				n += float64(c)
			}
			preLimit = n / float64(len(g.ChunkRows)) / g.LimitChunkSec
		}
		rows[i] = []*plot.Plot{
			barPanel(geo+": decode step p50, ms (lower is better)", ids, dec, decLimit, "one QD1 disk read", fmtPlotMs),
			barPanel(geo+": prefill gather, rows/s (higher is better)", ids, pre, preLimit, "disk IOPS limit", fmtCount),
		}
	}
	rows = append(rows, r.servePanels()...)
	if len(rows) == 0 {
		return fmt.Errorf("plot: nothing measured")
	}
	const w, h = 14 * vg.Inch, 4.5 * vg.Inch
	img := vgimg.New(w, h*vg.Length(len(rows)))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(rows), Cols: 2, PadX: vg.Centimeter, PadY: vg.Centimeter,
		PadTop: vg.Millimeter * 3, PadBottom: vg.Millimeter * 3, PadLeft: vg.Millimeter * 3, PadRight: vg.Millimeter * 3}
	canvases := plot.Align(rows, tiles, dc)
	for i := range rows {
		for j := range rows[i] {
			rows[i][j].Draw(canvases[i][j])
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return f.Close()
}

// servePanels are the serving loop's rows: per geometry and rank count,
// each path's decode step p50 with engramfs+hints' floor dashed, and its
// prefill chunk time (wait + gather).
func (r *Report) servePanels() [][]*plot.Plot {
	if r.Serve == nil {
		return nil
	}
	var rows [][]*plot.Plot
	for _, run := range r.Serve.Runs {
		var ids []PathID
		var dec, pre []float64
		for _, p := range run.Paths {
			if p.measured() {
				ids = append(ids, p.Path)
				dec = append(dec, p.Decode.P50.Seconds()*1e3)
				pre = append(pre, p.Chunk.Mean.Seconds()*1e3)
			}
		}
		if len(ids) == 0 {
			continue
		}
		floor := math.NaN()
		if h := run.path(PathHints); h != nil && h.Floor > 0 {
			floor = h.Floor.Seconds() * 1e3
		}
		name := fmt.Sprintf("serving, %s, %d rank(s)", run.Geometry.Name, run.Ranks)
		rows = append(rows, []*plot.Plot{
			barPanel(name+": decode step p50, ms (lower is better)", ids, dec, floor, "engramfs+hints' floor: a burst of its cold reads", fmtPlotMs),
			barPanel(name+": prefill chunk, wait + gather, ms (lower is better)", ids, pre, math.NaN(), "", fmtPlotMs),
		})
	}
	return rows
}

func fmtPlotMs(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 1:
		return fmt.Sprintf("%.1f", v)
	case v >= 0.1:
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.3f", v)
}

// barPanel is one panel: a bar per path on a log scale, each bar labelled
// with its value, and the limit as a dashed line.
func barPanel(title string, ids []PathID, vals []float64, limit float64, limitName string, format func(float64) string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = formattedTicks{format}
	p.Y.Tick.Label.Font.Size = vg.Points(9)
	p.X.Tick.Label.Font.Size = vg.Points(10)
	names := make([]string, len(ids))
	for i, id := range ids {
		names[i] = shortLabel(id)
	}
	p.NominalX(names...)
	p.Add(plotter.NewGrid())
	p.X.Padding = 0
	p.Add(&logBars{ids: ids, vals: vals, format: format, label: p.X.Tick.Label})
	if !math.IsNaN(limit) && limit > 0 {
		l, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: limit}, {X: float64(len(ids)) - 0.5, Y: limit}})
		if err == nil {
			l.LineStyle.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
			l.LineStyle.Width = vg.Points(1.5)
			l.LineStyle.Color = color.RGBA{0xcc, 0x00, 0x00, 0xff}
			p.Add(l)
			p.Legend.Add(limitName+" ("+format(limit)+")", l)
			p.Legend.Top = true
			p.Legend.TextStyle.Font.Size = vg.Points(9)
		}
	}
	return p
}

// logBars draws bars up from the bottom of a log axis (plotter.BarChart
// starts bars at 0, which a log scale cannot show).
type logBars struct {
	ids    []PathID
	vals   []float64
	format func(float64) string
	label  draw.TextStyle
}

func (b *logBars) Plot(c draw.Canvas, plt *plot.Plot) {
	trX, trY := plt.Transforms(&c)
	half := vg.Centimeter * 0.7
	lbl := b.label
	lbl.XAlign, lbl.YAlign = draw.XCenter, draw.YBottom
	lbl.Font.Size = vg.Points(9)
	for i, v := range b.vals {
		x := trX(float64(i))
		if math.IsNaN(v) || v <= 0 {
			c.FillText(lbl, vg.Point{X: x, Y: c.Min.Y + vg.Millimeter}, "n/a")
			continue
		}
		top := trY(v)
		pts := []vg.Point{{X: x - half, Y: c.Min.Y}, {X: x - half, Y: top}, {X: x + half, Y: top}, {X: x + half, Y: c.Min.Y}}
		c.FillPolygon(pathColors[b.ids[i]], c.ClipPolygonY(pts))
		c.FillText(lbl, vg.Point{X: x, Y: top + vg.Millimeter}, b.format(v))
	}
}

func (b *logBars) DataRange() (xmin, xmax, ymin, ymax float64) {
	ymin, ymax = math.Inf(1), math.Inf(-1)
	for _, v := range b.vals {
		if v > 0 {
			ymin, ymax = min(ymin, v), max(ymax, v)
		}
	}
	if math.IsInf(ymin, 1) {
		ymin, ymax = 1, 10
	}
	// Room below the shortest bar, and above the tallest for its label.
	return -0.5, float64(len(b.vals)) - 0.5, ymin / 3, ymax * 3
}

// formattedTicks are log ticks labelled like the bars (100K, not 100000).
type formattedTicks struct{ format func(float64) string }

func (f formattedTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.LogTicks{Prec: -1}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = f.format(ts[i].Value)
		}
	}
	return ts
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

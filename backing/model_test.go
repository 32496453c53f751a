package backing

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// smallSynth is a model small enough to build in every test: flash-like rows
// so that tables share pages, two layers.
func smallSynth() SynthSpec {
	s := DefaultSynth()
	s.Rows = 64
	s.FlashGeometry()
	return s
}

func synthDir(t testing.TB, spec SynthSpec) string {
	t.Helper()
	dir := t.TempDir()
	if err := Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	return dir
}

func shardPath(dir string, layer, layers int) string {
	return filepath.Join(dir, fmt.Sprintf("model-%05d-of-%05d.safetensors", layer+1, layers))
}

func writeIndex(t testing.TB, dir string, weightMap map[string]string) {
	t.Helper()
	b, err := json.Marshal(map[string]any{"weight_map": weightMap})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, IndexFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// table2D is a tensor of rows x cols elements of dtype at data offset begin.
func table2D(name, dtype string, shape []int64, begin int64) TensorInfo {
	size, _ := DtypeSize(dtype)
	n := size
	for _, d := range shape {
		n *= d
	}
	return TensorInfo{Name: name, Dtype: dtype, Shape: shape, Begin: begin, End: begin + n}
}

// modelDir writes one shard per entry of shards (file name -> tensors, laid
// out back to back from offset 0) and an index naming them, unless noIndex.
func modelDir(t testing.TB, shards map[string][]TensorInfo, noIndex bool) string {
	t.Helper()
	dir := t.TempDir()
	wm := map[string]string{}
	for name, tensors := range shards {
		off := int64(0)
		laid := make([]TensorInfo, len(tensors))
		for i, ti := range tensors {
			ti.End, ti.Begin = off+ti.End-ti.Begin, off
			off = ti.End
			laid[i] = ti
			wm[ti.Name] = name
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := writeShard(filepath.Join(dir, name), laid, 1); err != nil {
			t.Fatal(err)
		}
	}
	if !noIndex {
		writeIndex(t, dir, wm)
	}
	return dir
}

// wantRefusal asserts that err names both the file and the problem.
func wantRefusal(t *testing.T, m *Model, err error, file, problem string) {
	t.Helper()
	if err == nil {
		t.Fatalf("Load accepted a broken model: %d tables", len(m.Tables))
	}
	if m != nil {
		t.Fatalf("error %v came with a model", err)
	}
	if !strings.Contains(err.Error(), file) {
		t.Errorf("error %q does not name %s", err, file)
	}
	if !strings.Contains(err.Error(), problem) {
		t.Errorf("error %q does not say %q", err, problem)
	}
}

func TestLoadRefusesBrokenShards(t *testing.T) {
	spec := smallSynth()
	cases := []struct {
		name    string
		breakIt func(t *testing.T, shard string) // shard: the path of layer 1's shard
		problem string
	}{
		{"file-under-8-bytes", func(t *testing.T, shard string) { truncate(t, shard, 5) },
			"shorter than the 8-byte header length"},
		{"header-cut-short", func(t *testing.T, shard string) { truncate(t, shard, 100) },
			"runs past the end of the file"},
		{"header-length-past-end", func(t *testing.T, shard string) {
			fi, _ := os.Stat(shard)
			putLength(t, shard, uint64(fi.Size()))
		}, "runs past the end of the file"},
		{"header-length-over-limit", func(t *testing.T, shard string) { putLength(t, shard, 1<<40) },
			"over the limit"},
		{"data-offsets-past-end", func(t *testing.T, shard string) {
			fi, _ := os.Stat(shard)
			truncate(t, shard, fi.Size()-1)
		}, "past the end of the data section"},
		{"header-not-json", func(t *testing.T, shard string) {
			f, err := os.OpenFile(shard, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			f.WriteAt([]byte("#!"), 8)
		}, "not a JSON object"},
		{"shard-is-a-directory", func(t *testing.T, shard string) {
			os.Remove(shard)
			os.Mkdir(shard, 0o755)
		}, "not a regular file"},
		{"missing-shard", func(t *testing.T, shard string) { os.Remove(shard) },
			"no such file or directory"},
	}
	for _, c := range cases {
		for _, glob := range []bool{false, true} {
			if glob && c.name == "missing-shard" {
				continue // without an index, a missing shard is just not there
			}
			t.Run(fmt.Sprintf("%s/glob=%v", c.name, glob), func(t *testing.T) {
				dir := synthDir(t, spec)
				if glob {
					os.Remove(filepath.Join(dir, IndexFile))
				}
				shard := shardPath(dir, 1, spec.Layers)
				c.breakIt(t, shard)
				m, err := Load(dir, DefaultTablePattern)
				wantRefusal(t, m, err, shard, c.problem)
			})
		}
	}
}

func truncate(t *testing.T, path string, size int64) {
	t.Helper()
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
}

func putLength(t *testing.T, path string, n uint64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(binary.LittleEndian.AppendUint64(nil, n), 0); err != nil {
		t.Fatal(err)
	}
}

func TestLoadRefusesBadTables(t *testing.T) {
	const w0, s0 = "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"
	cases := []struct {
		name    string
		shards  map[string][]TensorInfo
		problem string
	}{
		{"rank-1", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "U8", []int64{4096}, 0)}}, "must be 2-D"},
		{"rank-3", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "U8", []int64{16, 16, 16}, 0)}}, "must be 2-D"},
		{"rank-0", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "U8", []int64{}, 0)}}, "must be 2-D"},
		{"rows-differ", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "F8_E4M3", []int64{100, 256}, 0),
			table2D(s0, "F32", []int64{99, 2}, 0)}}, "rows, but other tables of layer 0 have"},
		{"rows-differ-across-shards", map[string][]TensorInfo{
			"a.safetensors": {table2D(w0, "F8_E4M3", []int64{100, 256}, 0)},
			"b.safetensors": {table2D(s0, "F32", []int64{101, 2}, 0)}}, "rows, but other tables of layer 0 have"},
		{"zero-rows", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "U8", []int64{0, 16}, 0)}}, "at least one row"},
		{"zero-columns", map[string][]TensorInfo{"a.safetensors": {
			table2D(w0, "U8", []int64{16, 0}, 0)}}, "at least one row and one column"},
		{"unknown-dtype", map[string][]TensorInfo{"a.safetensors": {
			{Name: w0, Dtype: "Q4_K", Shape: []int64{4, 4}, Begin: 0, End: 8}}}, `unknown dtype "Q4_K"`},
		{"layer-out-of-range", map[string][]TensorInfo{"a.safetensors": {
			table2D("layers.65536.engram.embed.weight", "U8", []int64{4, 4}, 0)}}, "not a number from 0 to 65535"},
		{"layer-overflows-int", map[string][]TensorInfo{"a.safetensors": {
			table2D("layers.99999999999999999999999.engram.embed.weight", "U8", []int64{4, 4}, 0)}}, "not a number from 0 to 65535"},
		{"same-layer-twice", map[string][]TensorInfo{"a.safetensors": {
			table2D("layers.7.engram.embed.weight", "U8", []int64{4, 4}, 0),
			table2D("layers.007.engram.embed.weight", "U8", []int64{4, 4}, 0)}}, "is layer 7 table \"weight\", as is tensor"},
	}
	for _, c := range cases {
		for _, glob := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/glob=%v", c.name, glob), func(t *testing.T) {
				dir := modelDir(t, c.shards, glob)
				m, err := Load(dir, DefaultTablePattern)
				// The shard named in the error is one of the model's.
				file := filepath.Join(dir, "a.safetensors")
				if len(c.shards) > 1 && err != nil && !strings.Contains(err.Error(), file) {
					file = filepath.Join(dir, "b.safetensors")
				}
				wantRefusal(t, m, err, file, c.problem)
			})
		}
	}
}

func TestLoadRefusesBadIndex(t *testing.T) {
	spec := smallSynth()
	const w1 = "layers.1.engram.embed.weight"
	cases := []struct {
		name    string
		index   string // written over the index; "" keeps the synthetic one
		edit    func(wm map[string]string, dir string)
		problem string
		file    func(dir string) string
	}{
		{name: "not-json", index: "{weight_map", problem: "not a safetensors index"},
		{name: "empty-file", index: " ", problem: "not a safetensors index"},
		{name: "no-weight-map", index: `{"metadata":{"total_size":1}}`, problem: "no weight_map"},
		{name: "weight-map-null", index: `{"weight_map":null}`, problem: "no weight_map"},
		{name: "weight-map-not-object", index: `{"weight_map":["a"]}`, problem: "not a safetensors index"},
		{name: "weight-map-empty", index: `{"weight_map":{}}`, problem: "no tensor matches the table pattern",
			file: func(dir string) string { return dir }},
		{name: "missing-shard", edit: func(wm map[string]string, _ string) { wm[w1] = "model-gone.safetensors" },
			problem: "no such file or directory", file: func(dir string) string { return filepath.Join(dir, "model-gone.safetensors") }},
		{name: "tensor-not-in-shard", edit: func(wm map[string]string, _ string) { wm[w1] = filepath.Base(shardPath("", 0, 2)) },
			problem: `maps tensor "layers.1.engram.embed.weight" here, but the shard has no such tensor`,
			file:    func(dir string) string { return shardPath(dir, 0, 2) }},
		{name: "shard-is-the-directory", edit: func(wm map[string]string, _ string) { wm[w1] = "." },
			problem: "not a regular file", file: func(dir string) string { return dir }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := synthDir(t, spec)
			indexPath := filepath.Join(dir, IndexFile)
			if c.index != "" {
				if err := os.WriteFile(indexPath, []byte(c.index), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if c.edit != nil {
				wm := readWeightMap(t, dir)
				c.edit(wm, dir)
				writeIndex(t, dir, wm)
			}
			file := indexPath
			if c.file != nil {
				file = c.file(dir)
			}
			m, err := Load(dir, DefaultTablePattern)
			wantRefusal(t, m, err, file, c.problem)
		})
	}

	t.Run("over-size-limit", func(t *testing.T) {
		dir := synthDir(t, spec)
		indexPath := filepath.Join(dir, IndexFile)
		truncate(t, indexPath, maxIndexBytes+1) // sparse: costs no disk
		m, err := Load(dir, DefaultTablePattern)
		wantRefusal(t, m, err, indexPath, "over the limit")
	})
}

func readWeightMap(t *testing.T, dir string) map[string]string {
	t.Helper()
	wm, _, err := readIndex(NewLocalSource(dir, IOBuffered, nil, nil), filepath.Join(dir, IndexFile))
	if err != nil {
		t.Fatal(err)
	}
	return wm
}

// An index may not send us outside the model directory: such a name is
// refused, and no file outside is so much as opened (watched with inotify).
func TestLoadRefusesShardOutsideDir(t *testing.T) {
	spec := smallSynth()
	outside := synthDir(t, spec)
	target := shardPath(outside, 1, spec.Layers)
	for _, c := range []struct{ name, file string }{
		{"absolute", target},
		{"dot-dot", filepath.Join("..", filepath.Base(outside), filepath.Base(target))},
		{"dot-dot-inside", "sub/../../" + filepath.Base(outside) + "/" + filepath.Base(target)},
		{"dot-dot-deep", strings.Repeat("../", 30) + strings.TrimPrefix(target, "/")},
	} {
		t.Run(c.name, func(t *testing.T) {
			// The model directory is a sibling of outside, so ".." reaches it.
			dir := filepath.Join(filepath.Dir(outside), "model-"+c.name)
			if err := Synthesize(dir, spec); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			wm := readWeightMap(t, dir)
			wm["layers.1.engram.embed.weight"] = c.file
			writeIndex(t, dir, wm)
			if _, err := os.Stat(filepath.Join(dir, c.file)); c.name != "absolute" && err != nil {
				t.Fatalf("the test's relative name does not reach the outside shard: %v", err)
			}

			ino := watchOpens(t, outside)
			m, err := Load(dir, DefaultTablePattern)
			wantRefusal(t, m, err, filepath.Join(dir, IndexFile), "absolute or leaves the model directory")
			if !strings.Contains(err.Error(), c.file) {
				t.Errorf("error %q does not quote the shard name %q", err, c.file)
			}
			if n := ino.opens(t); n != 0 {
				t.Fatalf("Load opened %d files outside the model directory", n)
			}
			// The watch works: opening the target is seen.
			f, err := os.Open(target)
			if err != nil {
				t.Fatal(err)
			}
			f.Close()
			if n := ino.opens(t); n == 0 {
				t.Fatal("inotify saw no open of the outside shard: the check above proves nothing")
			}
		})
	}
}

// A table name is a file name in the mount (layers/<L>/<table>.safetensors):
// with a permissive pattern, a tensor whose `table` group leaves that
// directory, or names a directory, is refused with its name, before any
// path is built from it (the mount's index and manifest sent loaders to
// ../evil.safetensors, outside the mount, and the daemon opened it).
func TestLoadRefusesTableNameOutsideMount(t *testing.T) {
	const pattern = `^layers\.(?P<layer>\d+)\.(?P<table>.*)$`
	for _, name := range []string{
		"layers.0.../../../evil", "layers.0../evil", "layers.0.a/b", "layers.0./abs", "layers.0...",
		"layers.0..", "layers.0.", "layers.0.nul\x00byte",
	} {
		for _, glob := range []bool{false, true} {
			t.Run(fmt.Sprintf("%q/glob=%v", name, glob), func(t *testing.T) {
				dir := modelDir(t, map[string][]TensorInfo{"a.safetensors": {
					table2D(name, "U8", []int64{4, 4096}, 0)}}, glob)
				m, err := Load(dir, pattern)
				wantRefusal(t, m, err, filepath.Join(dir, "a.safetensors"), "not a file name inside the mount")
				if err != nil && !strings.Contains(err.Error(), strconv.Quote(name)) {
					t.Errorf("error %q does not quote the tensor %q", err, name)
				}
			})
		}
	}
	// The same pattern with names that stay inside is fine.
	dir := modelDir(t, map[string][]TensorInfo{"a.safetensors": {
		table2D("layers.0.engram..weight", "U8", []int64{4, 4096}, 0)}}, false)
	m, err := Load(dir, pattern)
	if err != nil || m.Tables[0].Path() != filepath.Join("layers", "0", "engram..weight.safetensors") {
		t.Fatalf("a dotted table name: %v", err)
	}
}

// The check of LoadSourceChecked hears the tables and the shards holding
// them, before any shard is opened when there is an index (after the
// headers without one), and its refusal ends the load.
func TestLoadSourceCheckedCountsFirst(t *testing.T) {
	spec := smallSynth()
	spec.Layers = 3
	for _, glob := range []bool{false, true} {
		t.Run(fmt.Sprintf("glob=%v", glob), func(t *testing.T) {
			dir := synthDir(t, spec)
			if glob {
				os.Remove(filepath.Join(dir, IndexFile))
			}
			ino := watchOpens(t, dir)
			var tables, shards int
			refusal := errors.New("too many for this test")
			m, err := LoadSourceChecked(NewLocalSource(dir, IOBuffered, nil, nil), DefaultTablePattern, func(t, s int) error {
				tables, shards = t, s
				return refusal
			})
			if !errors.Is(err, refusal) || m != nil {
				t.Fatalf("LoadSourceChecked with a refusing check: %v", err)
			}
			if tables != 2*spec.Layers || shards != spec.Layers {
				t.Errorf("check heard %d tables in %d shards, want %d in %d", tables, shards, 2*spec.Layers, spec.Layers)
			}
			if n := ino.opens(t); !glob && n != 2 { // the index's open and read
				t.Errorf("%d opens and reads in the model directory before the check, want the index's 2", n)
			}
			if m, err := LoadSourceChecked(NewLocalSource(dir, IOBuffered, nil, nil), DefaultTablePattern, func(int, int) error { return nil }); err != nil || len(m.Tables) != 2*spec.Layers {
				t.Fatalf("LoadSourceChecked with a check that passes: %v", err)
			}
		})
	}
}

type inotifyWatch struct{ fd int }

func watchOpens(t *testing.T, dir string) inotifyWatch {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Skipf("inotify: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_OPEN|unix.IN_ACCESS); err != nil {
		t.Skipf("inotify watch: %v", err)
	}
	return inotifyWatch{fd}
}

// opens drains the events so far and counts them.
func (w inotifyWatch) opens(t *testing.T) int {
	t.Helper()
	buf := make([]byte, 64<<10)
	events := 0
	for {
		n, err := unix.Read(w.fd, buf)
		if errors.Is(err, unix.EAGAIN) {
			return events
		}
		if err != nil {
			t.Fatal(err)
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			length := binary.NativeEndian.Uint32(buf[off+12:])
			off += unix.SizeofInotifyEvent + int(length)
			events++
		}
	}
}

func TestLoadRefusesBadPatternAndDir(t *testing.T) {
	dir := synthDir(t, smallSynth())
	for _, c := range []struct{ name, pattern, problem string }{
		{"no-named-groups", `^layers\.(\d+)\.engram\.embed\.(weight|scale)$`, "needs named groups"},
		{"no-table-group", `^layers\.(?P<layer>\d+)\.engram\.embed\.(weight|scale)$`, "needs named groups"},
		{"not-a-regexp", `^layers\.(?P<layer>\d+`, "table pattern"},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := Load(dir, c.pattern)
			wantRefusal(t, m, err, strconv.Quote(c.pattern), c.problem)
		})
	}
	t.Run("nothing-matches", func(t *testing.T) {
		pattern := `^model\.layers\.(?P<layer>\d+)\.(?P<table>embed)$`
		for _, glob := range []bool{false, true} {
			d := synthDir(t, smallSynth())
			if glob {
				os.Remove(filepath.Join(d, IndexFile))
			}
			m, err := Load(d, pattern)
			// The error shows names the model has: what the pattern missed.
			wantRefusal(t, m, err, d, "no tensor matches the table pattern")
			if want := `"embed_tokens.weight", "layers.0.engram.embed.scale"`; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("glob %v: error %v does not show the model's names (%s)", glob, err, want)
			}
		}
	})
	t.Run("no-such-dir", func(t *testing.T) {
		missing := filepath.Join(dir, "nope")
		m, err := Load(missing, DefaultTablePattern)
		wantRefusal(t, m, err, missing, "no such file or directory")
	})
	t.Run("not-a-dir", func(t *testing.T) {
		file := filepath.Join(dir, IndexFile)
		m, err := Load(file, DefaultTablePattern)
		wantRefusal(t, m, err, file, "not a directory")
	})
	t.Run("empty-dir", func(t *testing.T) {
		empty := t.TempDir()
		m, err := Load(empty, DefaultTablePattern)
		wantRefusal(t, m, err, empty, "no model.safetensors.index.json and no *.safetensors files")
	})
	t.Run("tensor-in-two-shards", func(t *testing.T) {
		d := modelDir(t, map[string][]TensorInfo{
			"a.safetensors": {table2D("layers.0.engram.embed.weight", "U8", []int64{4, 4}, 0)},
			"b.safetensors": {table2D("layers.0.engram.embed.weight", "U8", []int64{4, 4}, 0)},
		}, true)
		m, err := Load(d, DefaultTablePattern)
		wantRefusal(t, m, err, filepath.Join(d, "b.safetensors"), "is also in shard "+filepath.Join(d, "a.safetensors"))
	})
}

// checkModel checks what every model loaded from Synthesize(spec) must be.
func checkModel(t *testing.T, m *Model, dir string, spec SynthSpec) {
	t.Helper()
	if m.Dir != dir {
		t.Errorf("Dir = %s, want %s", m.Dir, dir)
	}
	if len(m.Tables) != 2*spec.Layers {
		t.Fatalf("%d tables, want %d", len(m.Tables), 2*spec.Layers)
	}
	var wantLayers []int
	for l := range spec.Layers {
		wantLayers = append(wantLayers, l)
	}
	if !reflect.DeepEqual(m.Layers, wantLayers) {
		t.Errorf("Layers = %v, want %v", m.Layers, wantLayers)
	}
	if len(m.Shards) != spec.Layers {
		t.Errorf("%d shards, want %d", len(m.Shards), spec.Layers)
	}
	for i, tb := range m.Tables {
		// Ordered by layer, then kind ("scale" < "weight"); ID = index.
		layer, kind := i/2, []string{"scale", "weight"}[i%2]
		if tb.ID != uint32(i) || tb.Layer != layer || tb.Kind != kind {
			t.Fatalf("table %d is ID %d layer %d kind %s, want layer %d kind %s", i, tb.ID, tb.Layer, tb.Kind, layer, kind)
		}
		if tb.Name != fmt.Sprintf(spec.TableNames, layer, kind) {
			t.Errorf("table %d named %q", i, tb.Name)
		}
		if tb.Name == UnrelatedTensor {
			t.Errorf("the unrelated tensor %s is a table", UnrelatedTensor)
		}
		if tb.Path() != filepath.Join("layers", fmt.Sprint(layer), kind+".safetensors") {
			t.Errorf("table %s: Path() = %s", tb.Name, tb.Path())
		}
		dtype, rowBytes := "F32", spec.ScaleRow
		if kind == "weight" {
			dtype, rowBytes = "F8_E4M3", spec.WeightRow
		}
		if tb.Dtype != dtype || tb.RowBytes != rowBytes || tb.Rows != spec.Rows || tb.DataLen != int64(spec.Rows)*rowBytes {
			t.Errorf("table %s: dtype %s rows %d row bytes %d data %d; want %s %d %d %d",
				tb.Name, tb.Dtype, tb.Rows, tb.RowBytes, tb.DataLen, dtype, spec.Rows, rowBytes, int64(spec.Rows)*rowBytes)
		}
		if tb.Shard == nil || tb.Shard.Path != shardPath(dir, layer, spec.Layers) || tb.Shard != m.Shards[layer] {
			t.Fatalf("table %s: shard %+v", tb.Name, tb.Shard)
		}
		if tb.Shard.Name != filepath.Base(tb.Shard.Path) {
			t.Errorf("shard Name %q, Path %q", tb.Shard.Name, tb.Shard.Path)
		}
		if fi, err := os.Stat(tb.Shard.Path); err != nil || fi.Size() != tb.Shard.Size {
			t.Errorf("shard %s: Size %d, stat %v %v", tb.Shard.Path, tb.Shard.Size, fi, err)
		}
		if rows, ok := m.LayerRows(layer); !ok || rows != spec.Rows {
			t.Errorf("LayerRows(%d) = %d, %v", layer, rows, ok)
		}
		checkTableData(t, tb, spec.Seed)
	}
	if _, ok := m.LayerRows(spec.Layers); ok {
		t.Errorf("LayerRows(%d) exists", spec.Layers)
	}
	for l := range spec.Layers {
		lt := m.LayerTables(l)
		if len(lt) != 2 || lt[0] != m.Tables[2*l] || lt[1] != m.Tables[2*l+1] {
			t.Errorf("LayerTables(%d) = %v", l, lt)
		}
	}
}

// checkTableData checks DataStart against the shard itself: the first and
// last bytes of the table are the synthetic bytes of that tensor.
func checkTableData(t *testing.T, tb *Table, seed uint64) {
	t.Helper()
	f, err := os.Open(tb.Shard.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h, err := ReadHeader(f, tb.Shard.Size)
	if err != nil {
		t.Fatal(err)
	}
	if ti := h.Tensors[tb.Name]; tb.DataStart != h.DataStart+ti.Begin || tb.DataLen != ti.End-ti.Begin {
		t.Fatalf("table %s: DataStart %d DataLen %d, header says %d + [%d, %d)", tb.Name, tb.DataStart, tb.DataLen, h.DataStart, ti.Begin, ti.End)
	}
	key := NameKey(seed, tb.Name)
	n := min(tb.DataLen, 64)
	for _, off := range []int64{0, tb.DataLen - n} {
		got := make([]byte, n)
		want := make([]byte, n)
		if _, err := f.ReadAt(got, tb.DataStart+off); err != nil {
			t.Fatal(err)
		}
		FillSynth(want, key, off)
		if !bytes.Equal(got, want) {
			t.Fatalf("table %s: bytes at data offset %d are not the table's", tb.Name, off)
		}
	}
}

func TestLoadSynthetic(t *testing.T) {
	for _, c := range []struct {
		name string
		spec func() SynthSpec
	}{
		{"default", func() SynthSpec { s := DefaultSynth(); s.Rows = 2048; return s }},
		{"flash", func() SynthSpec { s := DefaultSynth(); s.FlashGeometry(); return s }},
		{"three-layers-odd-rows", func() SynthSpec {
			s := DefaultSynth()
			s.Layers, s.Rows, s.WeightRow, s.ScaleRow = 3, 1001, 384, 12
			return s
		}},
		{"custom-names", func() SynthSpec {
			s := smallSynth()
			s.TableNames = "model.layers.%d.engram.%s"
			return s
		}},
	} {
		spec := c.spec()
		pattern := DefaultTablePattern
		if c.name == "custom-names" {
			pattern = `^model\.layers\.(?P<layer>\d+)\.engram\.(?P<table>weight|scale)$`
		}
		for _, glob := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/glob=%v", c.name, glob), func(t *testing.T) {
				dir := synthDir(t, spec)
				if glob {
					if err := os.Remove(filepath.Join(dir, IndexFile)); err != nil {
						t.Fatal(err)
					}
				}
				m, err := Load(dir, pattern)
				if err != nil {
					t.Fatal(err)
				}
				checkModel(t, m, dir, spec)
			})
		}
	}
}

// Without an index every *.safetensors file is read, even in a directory
// whose name is a glob pattern; shards without tables are not kept.
func TestLoadGlobMode(t *testing.T) {
	spec := smallSynth()
	dir := filepath.Join(t.TempDir(), "dsv4[fp8]*?")
	if err := Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, IndexFile)); err != nil {
		t.Fatal(err)
	}
	// A shard of nothing but an unrelated tensor, and files that are not shards.
	if err := writeShard(filepath.Join(dir, "aux.safetensors"), []TensorInfo{table2D("lm_head.weight", "BF16", []int64{8, 8}, 0)}, 1); err != nil {
		t.Fatal(err)
	}
	for _, junk := range []string{"README.md", "config.json", "model.safetensors.bak"} {
		if err := os.WriteFile(filepath.Join(dir, junk), []byte("not a shard"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m, err := Load(dir, DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}

	checkModel(t, m, dir, spec)
	for _, s := range m.Shards {
		if s.Name == "aux.safetensors" {
			t.Errorf("Shards holds %s, which has no table", s.Path)
		}
	}
}

func TestLoadIndexShardInSubdirectory(t *testing.T) {
	const w, s = "layers.2.engram.embed.weight", "layers.2.engram.embed.scale"
	dir := modelDir(t, map[string][]TensorInfo{
		"part/one.safetensors": {table2D(w, "F8_E4M3", []int64{10, 300}, 0)},
		"part/two.safetensors": {table2D(s, "F32", []int64{10, 3}, 0), table2D("x", "U8", []int64{5}, 0)},
	}, false)
	m, err := Load(dir, DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Tables) != 2 || m.Tables[0].Name != s || m.Tables[1].Name != w || !reflect.DeepEqual(m.Layers, []int{2}) {
		t.Fatalf("tables %v, layers %v", m.Tables, m.Layers)
	}
	if m.Tables[1].Shard.Path != filepath.Join(dir, "part", "one.safetensors") || m.Tables[1].Shard.Name != "part/one.safetensors" {
		t.Fatalf("shard %+v", m.Tables[1].Shard)
	}
}

// TestTableGeometry: the table file of the mount is its header page(s) then
// the rows, and RowPages says which file pages hold each row, for rows of a
// page or more and rows far smaller than a page, straddling rows included.
func TestTableGeometry(t *testing.T) {
	const rows = 1000
	for _, rowBytes := range []int64{4096, 128, 8, 256, 384, 8192, 1, 4097} {
		t.Run(fmt.Sprint(rowBytes), func(t *testing.T) {
			spec := DefaultSynth()
			spec.Layers, spec.Rows, spec.WeightRow, spec.ScaleRow = 1, rows, rowBytes, 8
			dir := synthDir(t, spec)
			m, err := Load(dir, DefaultTablePattern)
			if err != nil {
				t.Fatal(err)
			}
			for _, tb := range m.Tables {
				checkFileHeader(t, tb)
				checkGeometry(t, tb)
			}
			w := m.Tables[1]
			if w.RowBytes != rowBytes {
				t.Fatalf("weight RowBytes %d", w.RowBytes)
			}
			// Hand-computed: header is one page, so data page 0 is file page 1.
			if w.DataPage() != 1 || w.FileSize != PageSize+rows*rowBytes {
				t.Fatalf("DataPage %d FileSize %d", w.DataPage(), w.FileSize)
			}
			want := map[int64]map[uint64][2]uint64{
				4096: {0: {1, 1}, 999: {1000, 1000}},
				128:  {0: {1, 1}, 31: {1, 1}, 32: {2, 2}, 999: {32, 32}},
				8:    {511: {1, 1}, 512: {2, 2}, 999: {2, 2}},
				256:  {15: {1, 1}, 16: {2, 2}},
				384:  {9: {1, 1}, 10: {1, 2}, 11: {2, 2}, 32: {4, 4}, 999: {94, 94}},
				8192: {0: {1, 2}, 1: {3, 4}, 999: {1999, 2000}},
				1:    {0: {1, 1}, 999: {1, 1}},
				4097: {0: {1, 2}, 1: {2, 3}, 999: {1000, 1001}},
			}[rowBytes]
			for r, pages := range want {
				if first, last := w.RowPages(r); first != pages[0] || last != pages[1] {
					t.Errorf("RowPages(%d) = %d, %d; want %d, %d", r, first, last, pages[0], pages[1])
				}
			}
			wantPages := map[int64]uint64{4096: 1001, 128: 33, 8: 3, 256: 64, 384: 95, 8192: 2001, 1: 2, 4097: 1002}[rowBytes]
			if w.Pages() != wantPages {
				t.Errorf("Pages() = %d, want %d", w.Pages(), wantPages)
			}
		})
	}
}

// checkGeometry checks RowPages of every row against the bytes the row
// occupies in the table file, and Pages against FileSize.
func checkGeometry(t *testing.T, tb *Table) {
	t.Helper()
	hdr := int64(len(tb.FileHeader))
	if hdr%PageSize != 0 || tb.DataPage() != uint64(hdr/PageSize) || tb.DataPage() == 0 {
		t.Fatalf("%s: header of %d bytes, DataPage %d", tb.Name, hdr, tb.DataPage())
	}
	if tb.FileSize != hdr+tb.DataLen || tb.DataLen != int64(tb.Rows)*tb.RowBytes {
		t.Fatalf("%s: FileSize %d, header %d, DataLen %d", tb.Name, tb.FileSize, hdr, tb.DataLen)
	}
	if p := tb.Pages(); (p-1)*PageSize >= uint64(tb.FileSize) || p*PageSize < uint64(tb.FileSize) {
		t.Fatalf("%s: %d pages for %d bytes", tb.Name, p, tb.FileSize)
	}
	next := tb.DataPage() // every data page is some row's, in order
	for r := range tb.Rows {
		first, last := tb.RowPages(r)
		lo, hi := hdr+int64(r)*tb.RowBytes, hdr+int64(r+1)*tb.RowBytes-1 // the row's first and last byte
		if first != uint64(lo/PageSize) || last != uint64(hi/PageSize) {
			t.Fatalf("%s: RowPages(%d) = %d, %d; the row is bytes [%d, %d]", tb.Name, r, first, last, lo, hi)
		}
		if first != next && first != next-1 {
			t.Fatalf("%s: row %d starts on page %d after a row that ended on %d", tb.Name, r, first, next-1)
		}
		next = last + 1
	}
	if next != tb.Pages() {
		t.Fatalf("%s: rows end on page %d, file has %d pages", tb.Name, next-1, tb.Pages())
	}
}

// checkFileHeader: the table file's header is a valid safetensors header of
// exactly the one original tensor, data starting at a page boundary.
func checkFileHeader(t *testing.T, tb *Table) {
	t.Helper()
	if len(tb.FileHeader) < 8 || len(tb.FileHeader)%PageSize != 0 {
		t.Fatalf("%s: FileHeader of %d bytes", tb.Name, len(tb.FileHeader))
	}
	if n := binary.LittleEndian.Uint64(tb.FileHeader); n != uint64(len(tb.FileHeader)-8) {
		t.Fatalf("%s: length prefix %d in a %d-byte header", tb.Name, n, len(tb.FileHeader))
	}
	h, err := ParseHeader(tb.FileHeader[8:], tb.FileSize)
	if err != nil {
		t.Fatalf("%s: FileHeader does not parse: %v", tb.Name, err)
	}
	if h.DataStart != int64(len(tb.FileHeader)) || h.DataStart%PageSize != 0 {
		t.Fatalf("%s: data starts at %d", tb.Name, h.DataStart)
	}
	if len(h.Tensors) != 1 {
		t.Fatalf("%s: %d tensors in the table file", tb.Name, len(h.Tensors))
	}
	got, ok := h.Tensors[tb.Name]
	want := TensorInfo{Name: tb.Name, Dtype: tb.Dtype, Shape: []int64{int64(tb.Rows), tb.RowBytes / mustSize(t, tb.Dtype)}, Begin: 0, End: tb.DataLen}
	if !ok || !reflect.DeepEqual(got, want) {
		t.Fatalf("table file tensor %+v, want %+v", got, want)
	}
	// What a Python loader does: the same answer from the file's bytes.
	hh, err := ReadHeader(bytes.NewReader(append(append([]byte(nil), tb.FileHeader...), make([]byte, tb.DataLen)...)), tb.FileSize)
	if err != nil || !reflect.DeepEqual(hh.Tensors, h.Tensors) {
		t.Fatalf("%s: ReadHeader of the table file: %v", tb.Name, err)
	}
}

func mustSize(t *testing.T, dtype string) int64 {
	n, ok := DtypeSize(dtype)
	if !ok {
		t.Fatalf("dtype %s", dtype)
	}
	return n
}

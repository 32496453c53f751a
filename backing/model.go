package backing

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// DefaultTablePattern finds engram tables among a model's tensors. The named
// groups say which layer and which table of that layer a tensor is.
const DefaultTablePattern = `^layers\.(?P<layer>\d+)\.engram\.embed\.(?P<table>weight|scale)$`

// IndexFile is the name of the sharded-checkpoint index, in the model
// directory and in the mount.
const IndexFile = "model.safetensors.index.json"

// maxIndexBytes bounds the index file we read into memory.
const maxIndexBytes = 64 << 20

// Shard is one safetensors file of the model directory.
type Shard struct {
	Name     string // relative to the model directory
	Path     string // the source's name for it, for messages
	Size     int64
	Identity Identity // as the model was loaded: the Store refuses other bytes
}

// Table is one engram table: a 2-D tensor, one row per hash bucket.
type Table struct {
	ID        uint32 // index in Model.Tables
	Name      string // the original tensor name
	Layer     int
	Kind      string // the `table` group of the pattern: weight, scale, ...
	Dtype     string
	Rows      uint64
	RowBytes  int64
	Shard     *Shard
	DataStart int64 // offset of row 0 in the shard file
	DataLen   int64 // Rows * RowBytes

	// The table file of the mount: a single-tensor safetensors file whose
	// data starts at a page boundary, so file page p >= DataPage holds data
	// bytes [(p-DataPage)*PageSize, ...).
	FileHeader []byte // length prefix + padded JSON; len is a multiple of PageSize
	FileSize   int64
}

// PageSize is the page of the table files; see cache.PageSize.
const PageSize = 4096

// DataPage is the first file page that holds data.
func (t *Table) DataPage() uint64 { return uint64(len(t.FileHeader)) / PageSize }

// Pages is the number of file pages, header included.
func (t *Table) Pages() uint64 { return (uint64(t.FileSize) + PageSize - 1) / PageSize }

// RowPages returns the first and last file page that hold row r.
func (t *Table) RowPages(r uint64) (first, last uint64) {
	off := uint64(len(t.FileHeader)) + r*uint64(t.RowBytes)
	return off / PageSize, (off + uint64(t.RowBytes) - 1) / PageSize
}

// Path is the table file's path inside the mount.
func (t *Table) Path() string {
	return filepath.Join("layers", strconv.Itoa(t.Layer), t.Kind+".safetensors")
}

// Model is the set of engram tables of one model directory.
type Model struct {
	Dir    string
	Tables []*Table // ordered by layer, then kind
	Layers []int    // engram layers, ascending
	Shards []*Shard // shards that hold tables
	// Others maps every tensor that is not a table to its shard file
	// (relative to the model directory): the mount's index sends a loader
	// to the shard itself, served at its own path.
	Others map[string]string
	// IndexMetadata is the source index's "metadata", kept as it was (its
	// total_size counts the same tensors); nil without an index.
	IndexMetadata json.RawMessage
	// Files are the model directory's files, served at their own paths;
	// SkippedFiles the entries left out, and why. Empty when the source
	// cannot list them.
	Files        []ModelFile
	SkippedFiles []SkippedFile
	files        FileSource
	rows         map[int]uint64 // layer -> row count
	// byLayer holds each layer's tables: LayerTables was a scan of every
	// table, which made the manifest of a 100K-table model (50K layers)
	// quadratic: 82% of the daemon's CPU for minutes before it mounted.
	byLayer map[int][]*Table
}

// LayerRows is the row count shared by the tables of layer, if it exists.
func (m *Model) LayerRows(layer int) (uint64, bool) {
	n, ok := m.rows[layer]
	return n, ok
}

// LayerTables returns the tables of layer, ordered by kind. The slice is
// the model's own: read it, do not change it.
func (m *Model) LayerTables(layer int) []*Table {
	return slices.Clip(m.byLayer[layer])
}

// Load reads the model directory dir: its index when there is one, else every
// *.safetensors file in it. Tensors whose name matches pattern (named groups
// `layer` and `table`) become tables; every other tensor is ignored.
func Load(dir, pattern string) (*Model, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("model directory: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("model directory %s: not a directory", dir)
	}
	return LoadSource(NewLocalSource(dir, IOBuffered, nil, nil), pattern)
}

// LoadSource reads a model from src, as Load does from a directory.
func LoadSource(src Source, pattern string) (*Model, error) {
	return LoadSourceChecked(src, pattern, nil)
}

// LoadSourceChecked is LoadSource with check (when not nil) called once the
// number of tables and of the shards that hold them is known, before the
// tables are built; with an index, before any shard is opened. An error
// from check ends the load: the caller can refuse a model it cannot serve
// (its descriptor limit, say) before paying for it.
func LoadSourceChecked(src Source, pattern string, check func(tables, shards int) error) (*Model, error) {
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, fmt.Errorf("table pattern %q: %w", pattern, err)
	}
	layerGroup, tableGroup := re.SubexpIndex("layer"), re.SubexpIndex("table")
	if layerGroup < 0 || tableGroup < 0 {
		return nil, fmt.Errorf("table pattern %q: needs named groups (?P<layer>...) and (?P<table>...)", pattern)
	}
	dir := src.String()
	join := func(name string) string { return strings.TrimSuffix(dir, "/") + "/" + name }

	// tensor name -> shard name, for the tensors that are tables, and for
	// the others.
	wanted, others := map[string]string{}, map[string]string{}
	var skipped []SkippedFile
	indexPath := join(IndexFile)
	weightMap, metadata, err := readIndex(src, indexPath)
	switch {
	case err == nil:
		for name, file := range weightMap {
			local := filepath.IsLocal(file)
			if !re.MatchString(name) {
				if local {
					others[name] = file
				} else {
					skipped = append(skipped, SkippedFile{Name: IndexFile,
						Reason: fmt.Sprintf("tensor %q: shard name %q is absolute or leaves the model directory: not in the mount's index", name, file)})
				}
				continue
			}
			if !local {
				return nil, fmt.Errorf("%s: tensor %q: shard name %q is absolute or leaves the model directory", indexPath, name, file)
			}
			wanted[name] = file
		}
	case errors.Is(err, os.ErrNotExist):
		weightMap = nil
	default:
		return nil, err
	}

	shards := map[string]*Shard{}
	headers := map[string]*Header{}
	openShard := func(name string) (*Header, error) {
		if h, ok := headers[name]; ok {
			return h, nil
		}
		path := join(name)
		f, err := src.Open(name)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("shard %s: %w", path, err)
			}
			return nil, err
		}
		defer f.Close()
		id := f.Identity()
		h, err := ReadHeader(f, id.Size)
		if err != nil {
			return nil, fmt.Errorf("shard %s: %w", path, err)
		}
		shards[name] = &Shard{Name: name, Path: path, Size: id.Size, Identity: id}
		headers[name] = h
		return h, nil
	}

	if weightMap == nil {
		names, err := src.List(".safetensors")
		if err != nil {
			return nil, err
		}
		if len(names) == 0 {
			return nil, fmt.Errorf("model directory %s: no %s and no *.safetensors files", dir, IndexFile)
		}
		var total int64 // the index's total_size: the bytes of every tensor
		for _, name := range names {
			h, err := openShard(name)
			if err != nil {
				return nil, err
			}
			for _, tn := range h.sortedNames() {
				total += h.Tensors[tn].End - h.Tensors[tn].Begin
				if !re.MatchString(tn) {
					others[tn] = name
					continue
				}
				if prev, dup := wanted[tn]; dup {
					return nil, fmt.Errorf("shard %s: tensor %q is also in shard %s", join(name), tn, join(prev))
				}
				wanted[tn] = name
			}
		}
		metadata, _ = json.Marshal(map[string]int64{"total_size": total})
	}

	if check != nil {
		holding := map[string]bool{}
		for _, shard := range wanted {
			holding[shard] = true
		}
		if err := check(len(wanted), len(holding)); err != nil {
			return nil, fmt.Errorf("model %s: %w", dir, err)
		}
	}
	m := &Model{Dir: dir, rows: map[int]uint64{}, byLayer: map[int][]*Table{},
		Others: others, IndexMetadata: metadata, SkippedFiles: skipped}
	names := make([]string, 0, len(wanted))
	for n := range wanted {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		shardName := wanted[name]
		h, err := openShard(shardName)
		if err != nil {
			return nil, err
		}
		shard := shards[shardName]
		ti, ok := h.Tensors[name]
		if !ok {
			return nil, fmt.Errorf("shard %s: %s maps tensor %q here, but the shard has no such tensor", shard.Path, IndexFile, name)
		}
		sub := re.FindStringSubmatch(name)
		layer, err := strconv.Atoi(sub[layerGroup])
		if err != nil || layer < 0 || layer > 0xFFFF {
			return nil, fmt.Errorf("shard %s: tensor %q: layer %q is not a number from 0 to 65535", shard.Path, name, sub[layerGroup])
		}
		if err := checkTableName(sub[tableGroup]); err != nil {
			return nil, fmt.Errorf("shard %s: tensor %q: %w", shard.Path, name, err)
		}
		t, err := newTable(name, layer, sub[tableGroup], ti, shard, h.DataStart)
		if err != nil {
			return nil, fmt.Errorf("shard %s: tensor %q: %w", shard.Path, name, err)
		}
		m.Tables = append(m.Tables, t)
	}
	if len(m.Tables) == 0 {
		return nil, fmt.Errorf("model directory %s: no tensor matches the table pattern %q; %s", dir, pattern, someTensors(weightMap, headers))
	}

	sort.SliceStable(m.Tables, func(i, j int) bool {
		a, b := m.Tables[i], m.Tables[j]
		if a.Layer != b.Layer {
			return a.Layer < b.Layer
		}
		return a.Kind < b.Kind
	})
	seen := map[string]*Table{}
	for i, t := range m.Tables {
		t.ID = uint32(i)
		if prev, dup := seen[t.Path()]; dup {
			return nil, fmt.Errorf("shard %s: tensor %q is layer %d table %q, as is tensor %q of shard %s",
				t.Shard.Path, t.Name, t.Layer, t.Kind, prev.Name, prev.Shard.Path)
		}
		seen[t.Path()] = t
		m.byLayer[t.Layer] = append(m.byLayer[t.Layer], t)
		if n, ok := m.rows[t.Layer]; !ok {
			m.rows[t.Layer] = t.Rows
			m.Layers = append(m.Layers, t.Layer)
		} else if n != t.Rows {
			return nil, fmt.Errorf("shard %s: tensor %q has %d rows, but other tables of layer %d have %d",
				t.Shard.Path, t.Name, t.Rows, t.Layer, n)
		}
	}
	// Only the shards that hold tables: in glob mode every shard was opened to
	// find the tables, but the store need not keep the others open.
	held := map[*Shard]bool{}
	for _, t := range m.Tables {
		if !held[t.Shard] {
			held[t.Shard] = true
			m.Shards = append(m.Shards, t.Shard)
		}
	}
	sort.Slice(m.Shards, func(i, j int) bool { return m.Shards[i].Name < m.Shards[j].Name })
	if err := m.loadFiles(src); err != nil {
		return nil, err
	}
	return m, nil
}

// checkTableName refuses a table name (the pattern's `table` group) that
// is not one plain file name: the table file is layers/<L>/<table>.safetensors
// in the mount, the index and manifest send loaders there, and the daemon
// opens and pins that path itself. With a permissive pattern, a tensor
// named layers.0.../../../evil became ../evil.safetensors, outside the mount.
func checkTableName(kind string) error {
	if kind == "" || kind == "." || kind == ".." || strings.ContainsAny(kind, "/\x00") ||
		!filepath.IsLocal(filepath.Join("layers", "0", kind+".safetensors")) {
		return fmt.Errorf("table name %q (the pattern's `table` group) is not a file name inside the mount", kind)
	}
	return nil
}

func newTable(name string, layer int, kind string, ti TensorInfo, shard *Shard, dataStart int64) (*Table, error) {
	if len(ti.Shape) != 2 {
		return nil, fmt.Errorf("shape %v: a table must be 2-D (rows, columns)", ti.Shape)
	}
	size, ok := DtypeSize(ti.Dtype)
	if !ok {
		return nil, fmt.Errorf("unknown dtype %q", ti.Dtype)
	}
	rows, cols := ti.Shape[0], ti.Shape[1]
	if rows == 0 || cols == 0 {
		return nil, fmt.Errorf("shape %v: a table needs at least one row and one column", ti.Shape)
	}
	t := &Table{
		Name: name, Layer: layer, Kind: kind, Dtype: ti.Dtype,
		Rows: uint64(rows), RowBytes: cols * size, Shard: shard,
		DataStart: dataStart + ti.Begin, DataLen: ti.End - ti.Begin,
	}
	hdr, err := EncodeHeader([]TensorInfo{{Name: name, Dtype: ti.Dtype, Shape: ti.Shape, Begin: 0, End: t.DataLen}},
		map[string]string{"format": "pt"}, PageSize)
	if err != nil {
		return nil, err
	}
	t.FileHeader = hdr
	t.FileSize = int64(len(hdr)) + t.DataLen
	return t, nil
}

// readIndex returns the weight_map and the metadata of a sharded-checkpoint
// index.
func readIndex(src Source, path string) (map[string]string, json.RawMessage, error) {
	b, err := src.ReadFile(IndexFile, maxIndexBytes)
	if err != nil {
		return nil, nil, err
	}
	var idx struct {
		Metadata  json.RawMessage   `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, nil, fmt.Errorf("%s: not a safetensors index: %w", path, err)
	}
	if idx.WeightMap == nil {
		return nil, nil, fmt.Errorf("%s: no weight_map", path)
	}
	return idx.WeightMap, idx.Metadata, nil
}

// someTensors names a few of the tensors a model has, for the error of a
// table pattern that matched none of them: the names show what the pattern
// should have been.
func someTensors(weightMap map[string]string, headers map[string]*Header) string {
	var names []string
	for n := range weightMap {
		names = append(names, n)
	}
	if weightMap == nil {
		for _, h := range headers {
			names = append(names, h.sortedNames()...)
		}
	}
	if len(names) == 0 {
		return "it has no tensors"
	}
	sort.Strings(names)
	const show = 5
	quoted := make([]string, 0, show)
	for _, n := range names[:min(show, len(names))] {
		quoted = append(quoted, strconv.Quote(n))
	}
	more := ""
	if len(names) > show {
		more = fmt.Sprintf(", ... (%d in all)", len(names))
	}
	return "its tensors are named like " + strings.Join(quoted, ", ") + more
}

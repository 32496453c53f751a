package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

// Geometry is a shape of engram tables the bench measures.
type Geometry struct {
	Name      string `json:"name"`
	Layers    int    `json:"layers"`
	Rows      uint64 `json:"rows"`       // rows per table
	WeightRow int64  `json:"weight_row"` // bytes per weight row
	ScaleRow  int64  `json:"scale_row"`  // bytes per scale row
}

// The two geometries of docs/design.md ("The problem"): rows of a page,
// and rows much smaller than a page (16 weight rows and 512 scale rows per page).
const (
	GeometryBig   = "big"   // 4096-byte weight rows, 128-byte scale rows
	GeometryFlash = "flash" // 256-byte weight rows, 8-byte scale rows
)

// NewGeometry returns the named geometry with layers and rows.
func NewGeometry(name string, layers int, rows uint64) (Geometry, error) {
	g := Geometry{Name: name, Layers: layers, Rows: rows}
	switch name {
	case GeometryBig:
		g.WeightRow, g.ScaleRow = 4096, 128
	case GeometryFlash:
		g.WeightRow, g.ScaleRow = 256, 8
	default:
		return Geometry{}, fmt.Errorf("geometry %q: want %s or %s", name, GeometryBig, GeometryFlash)
	}
	if layers < 1 || rows < 1 {
		return Geometry{}, fmt.Errorf("geometry %s: need at least one layer and one row", name)
	}
	return g, nil
}

// RowBytes is the bytes of one row across the tables of a layer.
func (g Geometry) RowBytes() int64 { return g.WeightRow + g.ScaleRow }

// Bytes is the size of all tables.
func (g Geometry) Bytes() int64 { return int64(g.Rows) * g.RowBytes() * int64(g.Layers) }

// String is e.g. "big: 2 layers × 1048576 rows × (4096 + 128) B = 8.3 GiB".
func (g Geometry) String() string {
	return fmt.Sprintf("%s: %d layers × %d rows × (%d + %d) B = %s", g.Name, g.Layers, g.Rows, g.WeightRow, g.ScaleRow, fmtBytes(float64(g.Bytes())))
}

// Spec is the synthetic model of g.
func (g Geometry) Spec(seed uint64) backing.SynthSpec {
	s := backing.DefaultSynth()
	s.Layers, s.Rows, s.WeightRow, s.ScaleRow, s.Seed = g.Layers, g.Rows, g.WeightRow, g.ScaleRow, seed
	return s
}

// DirName is the model's directory under the model root: <name>-<rows>.
func (g Geometry) DirName() string { return fmt.Sprintf("%s-%d", g.Name, g.Rows) }

// stampFile records, once generation has finished, what a model directory
// holds; a directory without it, or with another spec, is regenerated.
const stampFile = "bench-model.json"

type stamp struct {
	Spec   backing.SynthSpec `json:"spec"`
	Shards map[string]int64  `json:"shards"` // name -> size
}

// ownNames are the files a bench model directory may hold: regenerating
// removes them, and a directory with anything else is not ours to touch.
var ownNames = regexp.MustCompile(`^(model-\d{5}-of-\d{5}\.safetensors|` + regexp.QuoteMeta(backing.IndexFile) + `|` + regexp.QuoteMeta(stampFile) +
	synthConfigNames() + `)$`)

// synthConfigNames is the alternation of the model directory's other files
// that synthesis writes (config, tokenizer), each also the bench's own.
func synthConfigNames() string {
	var b strings.Builder
	for _, n := range backing.SynthConfigFiles {
		b.WriteString("|" + regexp.QuoteMeta(n))
	}
	return b.String()
}

// EnsureModel returns the model directory of g under root, generating it
// first when it is missing or holds another spec. progress, if not nil, is
// called now and then with the bytes written so far and the total.
func EnsureModel(ctx context.Context, root string, g Geometry, seed uint64, progress func(done, total int64)) (dir string, generated bool, err error) {
	dir = filepath.Join(root, g.DirName())
	spec := g.Spec(seed)
	if ok, err := checkModel(dir, spec); err != nil {
		return "", false, err
	} else if ok {
		return dir, false, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", false, err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", false, err
	}
	for _, e := range entries {
		if !ownNames.MatchString(e.Name()) {
			return "", false, fmt.Errorf("model directory %s holds %s, which the bench did not write: refusing to regenerate there", dir, e.Name())
		}
	}
	for _, e := range entries {
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
			return "", false, err
		}
	}
	if free, ok := freeBytes(dir); ok && free < g.Bytes()+(1<<30) {
		return "", false, fmt.Errorf("model directory %s: %s free, the %s model needs %s (pick another --model-dir or fewer rows)",
			dir, fmtBytes(float64(free)), g.Name, fmtBytes(float64(g.Bytes())))
	}

	stop := make(chan struct{})
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			if progress != nil {
				progress(dirBytes(dir), g.Bytes())
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	synth := make(chan error, 1)
	go func() { synth <- backing.Synthesize(dir, spec) }()
	select {
	case err = <-synth:
	case <-ctx.Done():
		// Synthesize cannot be stopped; the caller is about to exit, which
		// stops it. The directory has no stamp, so the next run regenerates it.
		err = ctx.Err()
	}
	close(stop)
	<-polled
	if ctx.Err() != nil {
		return "", false, ctx.Err()
	}
	if err != nil {
		return "", false, fmt.Errorf("generate %s: %w", dir, err)
	}
	// Write the tables to disk now: writeback during a measurement would
	// compete with the reads it measures.
	unix.Sync()
	st, err := readShards(dir)
	if err != nil {
		return "", false, err
	}
	b, _ := json.MarshalIndent(stamp{Spec: spec, Shards: st}, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, stampFile), append(b, '\n'), 0o644); err != nil {
		return "", false, err
	}
	return dir, true, nil
}

// checkModel reports whether dir holds a finished model of spec whose shards
// are unchanged since.
func checkModel(dir string, spec backing.SynthSpec) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, stampFile))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var s stamp
	if json.Unmarshal(b, &s) != nil || !reflect.DeepEqual(s.Spec, spec) {
		return false, nil
	}
	now, err := readShards(dir)
	if err != nil || !reflect.DeepEqual(now, s.Shards) {
		return false, nil
	}
	return true, nil
}

func readShards(dir string) (map[string]int64, error) {
	m, err := backing.Load(dir, backing.DefaultTablePattern)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, sh := range m.Shards {
		out[sh.Name] = sh.Size
	}
	return out, nil
}

// RemoveModels removes the models the bench generated under root: every
// directory there that holds only a model's files (the shards, the index,
// the stamp), then root itself if that leaves it empty. A directory with
// anything else in it is left alone and named in the error.
func RemoveModels(root string) ([]ModelFiles, error) {
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []ModelFiles
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(root, e.Name())
		if !e.IsDir() {
			errs = append(errs, fmt.Errorf("%s is not a model directory: left alone", dir))
			continue
		}
		files, err := os.ReadDir(dir)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ours := true
		for _, f := range files {
			if !ownNames.MatchString(f.Name()) {
				errs = append(errs, fmt.Errorf("%s holds %s, which the bench did not write: left alone", dir, f.Name()))
				ours = false
				break
			}
		}
		if !ours {
			continue
		}
		size := dirBytes(dir)
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, ModelFiles{Dir: dir, Bytes: size})
	}
	if len(errs) == 0 {
		if err := os.Remove(root); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}

func dirBytes(dir string) int64 {
	entries, _ := os.ReadDir(dir)
	var n int64
	for _, e := range entries {
		if fi, err := e.Info(); err == nil {
			n += fi.Size()
		}
	}
	return n
}

func freeBytes(dir string) (int64, bool) {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return 0, false
	}
	return int64(st.Bavail) * st.Bsize, true
}

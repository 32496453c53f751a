package fs

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
)

const page = 4096

// shardTensor is one tensor of a shard as the shard's own header places it,
// parsed here without the backing package: the oracle the table files are
// compared with.
type shardTensor struct {
	Dtype       string  `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// shardData returns the bytes of tensor name in the model's shards, and its
// entry in the shard header.
func shardData(t *testing.T, m *backing.Model, name string) ([]byte, shardTensor) {
	t.Helper()
	idx, err := os.ReadFile(filepath.Join(m.Dir, backing.IndexFile))
	if err != nil {
		t.Fatal(err)
	}
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(idx, &index); err != nil {
		t.Fatal(err)
	}
	shard, err := os.ReadFile(filepath.Join(m.Dir, index.WeightMap[name]))
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(shard)
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(shard[8:8+n], &hdr); err != nil {
		t.Fatal(err)
	}
	var st shardTensor
	if err := json.Unmarshal(hdr[name], &st); err != nil {
		t.Fatalf("shard entry of %s: %v", name, err)
	}
	data := shard[8+n:]
	return data[st.DataOffsets[0]:st.DataOffsets[1]], st
}

// checkTableHeader checks that file is a valid single-tensor safetensors
// file for tensor name with shard entry want, its data on a page boundary,
// and returns the data offset.
func checkTableHeader(t *testing.T, name string, file []byte, want shardTensor) int64 {
	t.Helper()
	if len(file) < 8 {
		t.Fatalf("%s: %d bytes, no length prefix", name, len(file))
	}
	n := binary.LittleEndian.Uint64(file)
	dataOff := int64(8 + n)
	if dataOff%page != 0 {
		t.Fatalf("%s: data offset %d is not page-aligned", name, dataOff)
	}
	if dataOff > int64(len(file)) {
		t.Fatalf("%s: header length %d past the file's %d bytes", name, n, len(file))
	}
	js := file[8:dataOff]
	if !json.Valid(js) {
		t.Fatalf("%s: header (padding included) is not valid JSON: %q", name, js)
	}
	end := bytes.LastIndexByte(js, '}') + 1
	if pad := js[end:]; len(bytes.Trim(pad, " ")) != 0 {
		t.Fatalf("%s: padding after the JSON is not all spaces: %q", name, pad)
	}
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(js, &hdr); err != nil {
		t.Fatal(err)
	}
	delete(hdr, "__metadata__")
	if len(hdr) != 1 || hdr[name] == nil {
		t.Fatalf("%s: header names %v, want exactly the one tensor", name, slices.Sorted(maps.Keys(hdr)))
	}
	var got shardTensor
	if err := json.Unmarshal(hdr[name], &got); err != nil {
		t.Fatal(err)
	}
	dataLen := want.DataOffsets[1] - want.DataOffsets[0]
	if got.Dtype != want.Dtype || !slices.Equal(got.Shape, want.Shape) || !slices.Equal(got.DataOffsets, []int64{0, dataLen}) {
		t.Fatalf("%s: header entry %+v, want dtype %s shape %v data_offsets [0 %d]", name, got, want.Dtype, want.Shape, dataLen)
	}
	if int64(len(file)) != dataOff+dataLen {
		t.Fatalf("%s: %d bytes, want header %d + data %d", name, len(file), dataOff, dataLen)
	}
	return dataOff
}

// tableOracle is the expected content of every table file: its header as
// served (checked by checkTableHeader) followed by the shard's bytes.
func tableOracle(t *testing.T, tr *tree, tb *backing.Table) (node, fh uint64, want []byte) {
	t.Helper()
	node = tr.node(tablePath(tb))
	attr, s := tr.getattr(node)
	if s != fuse.OK {
		t.Fatal(s)
	}
	fh = tr.open(node, syscall.O_RDONLY).Fh
	data, ent := shardData(t, tr.model, tb.Name)
	// The synthetic bytes are a pure function of the seed, name and offset:
	// a second oracle that does not trust the shard parse above.
	synth := make([]byte, len(data))
	backing.FillSynth(synth, backing.NameKey(tr.spec.Seed, tb.Name), 0)
	if !bytes.Equal(synth, data) {
		t.Fatalf("%s: shard bytes differ from the synthetic ones (test oracle broken)", tb.Name)
	}
	// The header is the first bytes up to the data; read it with one READ
	// of a size that cannot reach the data (the prefix says how much).
	prefix := tr.mustRead(node, fh, 0, 8)
	hdrLen := int(8 + binary.LittleEndian.Uint64(prefix))
	hdr := tr.mustRead(node, fh, 0, hdrLen)
	want = append(hdr, data...)
	checkTableHeader(t, tb.Name, want, ent)
	if attr.Size != uint64(len(want)) {
		t.Fatalf("%s: GETATTR size %d, want %d", tb.Name, attr.Size, len(want))
	}
	return node, fh, want
}

// clip is want[off:off+n] clipped to want.
func clip(want []byte, off int64, n int) []byte {
	if off >= int64(len(want)) {
		return nil
	}
	return want[off:min(off+int64(n), int64(len(want)))]
}

func forGeometries(t *testing.T, f func(t *testing.T, flash bool)) {
	for _, flash := range []bool{false, true} {
		t.Run(map[bool]string{false: "page-rows", true: "flash-rows"}[flash], func(t *testing.T) {
			f(t, flash)
		})
	}
}

// Every table file is its own safetensors header, space padding to a page,
// then exactly the shard's bytes of the tensor, page by page, the last page
// short when the data does not fill it.
func TestTableFilePages(t *testing.T) {
	forGeometries(t, func(t *testing.T, flash bool) {
		tr := newTree(t, treeConfig{flash: flash})
		short := 0
		for _, tb := range tr.model.Tables {
			node, fh, want := tableOracle(t, tr, tb)
			size := int64(len(want))
			pages := (size + page - 1) / page
			for p := range pages {
				got := tr.mustRead(node, fh, p*page, page)
				if w := clip(want, p*page, page); !bytes.Equal(got, w) {
					t.Fatalf("%s page %d of %d: %d bytes differ from the expected %d (first diff at %d)",
						tb.Name, p, pages, len(got), len(w), firstDiff(got, w))
				}
			}
			if size%page != 0 {
				short++
				last := tr.mustRead(node, fh, (pages-1)*page, page)
				if int64(len(last)) != size%page {
					t.Fatalf("%s: last page is %d bytes, want %d", tb.Name, len(last), size%page)
				}
			}
			// One READ of the whole file.
			if got := tr.mustRead(node, fh, 0, int(size)+page); !bytes.Equal(got, want) {
				t.Fatalf("%s: whole-file read differs at %d", tb.Name, firstDiff(got, want))
			}
		}
		if short == 0 {
			t.Fatal("no table ends on a short page: pick a row count that exercises one")
		}
	})
}

// Reads of any offset and length, across the header and the data and across
// page boundaries, return the same bytes; reads at or past EOF return none.
func TestTableFileArbitraryReads(t *testing.T) {
	forGeometries(t, func(t *testing.T, flash bool) {
		tr := newTree(t, treeConfig{flash: flash})
		rng := rand.New(rand.NewPCG(7, uint64(len(tr.model.Tables))))
		for _, tb := range tr.model.Tables {
			node, fh, want := tableOracle(t, tr, tb)
			size := int64(len(want))
			hdrLen := size - tb.DataLen
			type span struct {
				off int64
				n   int
			}
			spans := []span{
				{0, 1}, {0, int(hdrLen)}, {0, int(hdrLen) + 1}, {hdrLen - 1, 2}, {hdrLen - 1, 1}, {hdrLen, 1},
				{hdrLen - 100, 3 * page}, {hdrLen - page, 2 * page}, {5, 2*page + 17}, {hdrLen + 1, page},
				{hdrLen + page - 3, 6}, {size - 1, 1}, {size - 1, page}, {size - 10, 100},
				{size, 1}, {size, page}, {size + 1, page}, {size + 10*page, page}, {0, 0}, {hdrLen + 5, 0},
			}
			for range 300 {
				off := rng.Int64N(size + page)
				spans = append(spans, span{off, 1 + rng.IntN(3*page)})
			}
			for _, sp := range spans {
				if sp.off < 0 {
					continue
				}
				got, s := tr.read(node, fh, sp.off, sp.n)
				if s != fuse.OK {
					t.Fatalf("%s: read %d at %d: %v", tb.Name, sp.n, sp.off, s)
				}
				if w := clip(want, sp.off, sp.n); !bytes.Equal(got, w) {
					t.Fatalf("%s: read %d at %d (header %d, size %d): got %d bytes, want %d (first diff at %d)",
						tb.Name, sp.n, sp.off, hdrLen, size, len(got), len(w), firstDiff(got, w))
				}
			}
		}
	})
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// READs of table files are counted, with the bytes they returned; reads past
// EOF are not.
func TestTableReadCounters(t *testing.T) {
	tr := newTree(t, treeConfig{flash: true})
	tb := tr.model.Tables[1]
	node, fh, want := tableOracle(t, tr, tb)
	r0, b0 := tr.st.FuseReads.Load(), tr.st.FuseReadBytes.Load()
	var n uint64
	for _, sp := range []struct {
		off  int64
		size int
	}{{0, 100}, {int64(len(want)) - 10, page}, {page, 3 * page}} {
		n += uint64(len(tr.mustRead(node, fh, sp.off, sp.size)))
	}
	tr.mustRead(node, fh, int64(len(want)), page)
	if r, b := tr.st.FuseReads.Load()-r0, tr.st.FuseReadBytes.Load()-b0; r != 3 || b != n {
		t.Fatalf("counted %d reads of %d bytes, want 3 of %d", r, b, n)
	}
}

// faultLog is a FaultSink that keeps what it is told.
type faultLog struct{ recorder[cache.PageKey] }

func (f *faultLog) Faulted(keys []cache.PageKey) { f.add(keys...) }

// The fault observer hears of exactly the data pages a READ brought in, and
// of none for a read of the header alone.
func TestTableReadReportsFaultedPages(t *testing.T) {
	fl := &faultLog{}
	tr := newTree(t, treeConfig{faults: fl})
	tb := tr.model.Tables[0]
	node, fh, want := tableOracle(t, tr, tb)
	fl.take()
	hdrLen := int64(len(want)) - tb.DataLen
	dataPage := uint64(hdrLen / page)
	keys := func(first, last uint64) []cache.PageKey {
		var ks []cache.PageKey
		for p := first; p <= last; p++ {
			ks = append(ks, cache.PageKey{Table: tb.ID, Page: p})
		}
		return ks
	}
	for _, c := range []struct {
		off  int64
		n    int
		want []cache.PageKey
	}{
		{0, int(hdrLen), nil},
		{hdrLen + 3*page, page, keys(dataPage+3, dataPage+3)},
		{hdrLen - 1, 2, keys(dataPage, dataPage)},
		{hdrLen + page + 1, 2 * page, keys(dataPage+1, dataPage+3)},
		{int64(len(want)), page, nil},
	} {
		tr.mustRead(node, fh, c.off, c.n)
		if got := fl.take(); !slices.Equal(got, c.want) {
			t.Fatalf("read %d at %d: observer heard %v, want %v", c.n, c.off, got, c.want)
		}
	}
}

// A backing read that fails fails the READ with EIO; the header, which needs
// no backing read, is still served.
func TestTableReadBackingFailureIsEIO(t *testing.T) {
	errDisk := errors.New("injected disk error")
	tr := newTree(t, treeConfig{reader: func() backing.Reader {
		return backing.ReaderFunc(func(tb *backing.Table, off int64, n int) ([]byte, error) {
			return nil, fmt.Errorf("table %s at %d: %w", tb.Name, off, errors.Join(errDisk, syscall.EIO))
		})
	}})
	tb := tr.model.Tables[0]
	node := tr.node(tablePath(tb))
	fh := tr.open(node, syscall.O_RDONLY).Fh
	hdrLen := int64(len(tb.FileHeader))
	if b := tr.mustRead(node, fh, 0, int(hdrLen)); len(b) != int(hdrLen) {
		t.Fatalf("header read returned %d bytes, want %d", len(b), hdrLen)
	}
	for _, off := range []int64{hdrLen, hdrLen - 10, hdrLen + 5*page} {
		if _, s := tr.read(node, fh, off, page); s != fuse.EIO {
			t.Fatalf("read at %d with a failing backing store: %v, want EIO", off, s)
		}
	}
}

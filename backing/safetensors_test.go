package backing

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"
)

// headerCase is a safetensors header (the JSON between the length prefix and
// the data section) followed by dataLen bytes of data. wantErr is a phrase
// the error must contain; "" means the header is valid.
type headerCase struct {
	name    string
	json    string
	dataLen int64
	wantErr string
}

func (c headerCase) fileSize() int64 { return 8 + int64(len(c.json)) + c.dataLen }

// file renders the case as a whole safetensors file (data bytes are zero).
func (c headerCase) file() []byte {
	b := make([]byte, c.fileSize())
	binary.LittleEndian.PutUint64(b, uint64(len(c.json)))
	copy(b[8:], c.json)
	return b
}

// nestedArrays is depth nested JSON arrays: [[[...]]].
func nestedArrays(depth int) string {
	return strings.Repeat("[", depth) + strings.Repeat("]", depth)
}

// deepNesting puts depth nested arrays inside a tensor entry, where the
// decoder must refuse them without exhausting the stack or taking long.
func deepNesting(depth int) string {
	return `{"t":{"dtype":"F32","shape":` + nestedArrays(depth) + `,"data_offsets":[0,4]}}`
}

// headerCases are the valid and hostile headers shared by the parser tests,
// the fuzz seeds and the committed seed corpus (see TestFuzzCorpus).
var headerCases = []headerCase{
	// Valid.
	{name: "valid-empty-object", json: `{}`},
	{name: "valid-one-tensor", json: `{"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}`, dataLen: 24},
	{name: "valid-table-pair", json: `{"__metadata__":{"format":"pt"},` +
		`"layers.0.engram.embed.scale":{"dtype":"F32","shape":[4,2],"data_offsets":[64,96]},` +
		`"layers.0.engram.embed.weight":{"dtype":"F8_E4M3","shape":[4,16],"data_offsets":[0,64]}}`, dataLen: 96},
	{name: "valid-unknown-dtype", json: `{"q":{"dtype":"Q4_K","shape":[7],"data_offsets":[0,3]}}`, dataLen: 3},
	{name: "valid-zero-size", json: `{"z":{"dtype":"BF16","shape":[0,5],"data_offsets":[4,4]}}`, dataLen: 4},
	{name: "valid-scalar", json: `{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}`, dataLen: 8},
	{name: "valid-padded", json: `{"t":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}        `, dataLen: 3},
	{name: "valid-metadata-null", json: `{"__metadata__":null}`},
	{name: "valid-data-after-tensors", json: `{"t":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}}`, dataLen: 100},

	// Not a JSON object.
	{name: "empty-header", json: ``, wantErr: "not a JSON object"},
	{name: "not-json", json: `this is not json`, wantErr: "not a JSON object"},
	{name: "json-array", json: `[1,2,3]`, wantErr: "not a JSON object"},
	{name: "json-null", json: `null`, wantErr: "not a JSON object"},
	{name: "json-truncated", json: `{"t":{"dtype":"F32","sha`, wantErr: "not a JSON object"},
	{name: "json-trailing-garbage", json: `{} {}`, wantErr: "not a JSON object"},
	{name: "deep-nesting", json: deepNesting(100_000), dataLen: 4, wantErr: "depth"},

	// Offsets.
	{name: "negative-begin", json: `{"t":{"dtype":"U8","shape":[3],"data_offsets":[-1,2]}}`, dataLen: 8, wantErr: "not an ordered pair"},
	{name: "negative-both", json: `{"t":{"dtype":"U8","shape":[0],"data_offsets":[-5,-5]}}`, dataLen: 8, wantErr: "not an ordered pair"},
	{name: "begin-after-end", json: `{"t":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}}`, dataLen: 8, wantErr: "not an ordered pair"},
	{name: "offset-overflows-int64", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,9223372036854775808]}}`, dataLen: 8, wantErr: "data_offsets"},
	{name: "offset-huge-exponent", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1e300]}}`, dataLen: 8, wantErr: "data_offsets"},
	{name: "offset-fraction", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,0.5]}}`, dataLen: 8, wantErr: "data_offsets"},
	{name: "offset-max-int64", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[9223372036854775806,9223372036854775807]}}`, dataLen: 8, wantErr: "past the end of the data section"},
	{name: "end-past-data", json: `{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`, dataLen: 15, wantErr: "past the end of the data section"},
	{name: "end-past-data-unknown-dtype", json: `{"t":{"dtype":"XX","shape":[1],"data_offsets":[0,9]}}`, dataLen: 8, wantErr: "past the end of the data section"},
	{name: "data-offsets-one", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[1]}}`, dataLen: 8, wantErr: "data_offsets has 1 entries, want 2"},
	{name: "data-offsets-three", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}`, dataLen: 8, wantErr: "data_offsets has 3 entries, want 2"},
	{name: "data-offsets-missing", json: `{"t":{"dtype":"U8","shape":[1]}}`, dataLen: 8, wantErr: "data_offsets has 0 entries, want 2"},
	{name: "data-offsets-not-array", json: `{"t":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}}`, dataLen: 8, wantErr: "data_offsets"},

	// Shapes and dtypes.
	{name: "shape-elements-overflow", json: `{"t":{"dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "overflows"},
	{name: "shape-bytes-overflow", json: `{"t":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "overflows"},
	{name: "shape-negative-dim", json: `{"t":{"dtype":"U8","shape":[-1,4],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "negative"},
	{name: "shape-negative-pair", json: `{"t":{"dtype":"U8","shape":[-2,-2],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "negative"},
	{name: "shape-not-array", json: `{"t":{"dtype":"U8","shape":"4","data_offsets":[0,4]}}`, dataLen: 4, wantErr: "shape"},
	{name: "dtype-shape-disagree", json: `{"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}`, dataLen: 16, wantErr: "need 16 bytes"},
	{name: "dtype-shape-disagree-bf16", json: `{"t":{"dtype":"BF16","shape":[3],"data_offsets":[2,10]}}`, dataLen: 16, wantErr: "need 6 bytes"},
	{name: "dtype-missing", json: `{"t":{"shape":[4],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "no dtype"},
	{name: "dtype-not-string", json: `{"t":{"dtype":4,"shape":[4],"data_offsets":[0,4]}}`, dataLen: 4, wantErr: "dtype"},
	{name: "tensor-not-object", json: `{"t":5}`, wantErr: `tensor "t"`},
	{name: "tensor-null", json: `{"t":null}`, wantErr: "no dtype"},

	// Metadata.
	{name: "metadata-number-value", json: `{"__metadata__":{"format":1}}`, wantErr: "__metadata__ is not a map of strings"},
	{name: "metadata-array", json: `{"__metadata__":["pt"]}`, wantErr: "__metadata__ is not a map of strings"},
	{name: "metadata-string", json: `{"__metadata__":"pt"}`, wantErr: "__metadata__ is not a map of strings"},
	{name: "metadata-nested", json: `{"__metadata__":{"a":{"b":"c"}}}`, wantErr: "__metadata__ is not a map of strings"},
}

func TestParseHeaderCases(t *testing.T) {
	for _, c := range headerCases {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			h, err := ParseHeader([]byte(c.json), c.fileSize())
			if took := time.Since(start); took > 2*time.Second {
				t.Errorf("ParseHeader took %v", took)
			}
			checkCase(t, c, h, err)
			checkAccepted(t, h, err, int64(len(c.json)), c.fileSize())

			// The same bytes as a whole file must give the same answer.
			h, err = ReadHeader(bytes.NewReader(c.file()), c.fileSize())
			checkCase(t, c, h, err)
			checkAccepted(t, h, err, int64(len(c.json)), c.fileSize())
		})
	}
}

func checkCase(t *testing.T, c headerCase, h *Header, err error) {
	t.Helper()
	if c.wantErr == "" {
		if err != nil {
			t.Fatalf("valid header refused: %v", err)
		}
		if h.DataStart != 8+int64(len(c.json)) {
			t.Fatalf("DataStart = %d, want %d", h.DataStart, 8+len(c.json))
		}
		return
	}
	if err == nil {
		t.Fatalf("hostile header accepted: %+v", h)
	}
	if h != nil {
		t.Fatalf("error %v came with a header", err)
	}
	if !strings.Contains(err.Error(), c.wantErr) {
		t.Fatalf("error %q does not say %q", shorten(err.Error()), c.wantErr)
	}
}

func shorten(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return s
}

// checkAccepted is the invariant of every header the parser accepts: each
// tensor lies inside the data section, a known dtype's byte range is exactly
// its shape, and re-encoding the header gives back the same tensors.
func checkAccepted(t *testing.T, h *Header, err error, headerLen, fileSize int64) {
	t.Helper()
	if err != nil {
		return
	}
	if h.DataStart != 8+headerLen {
		t.Fatalf("DataStart = %d, want %d", h.DataStart, 8+headerLen)
	}
	dataLen := fileSize - h.DataStart
	if dataLen < 0 {
		t.Fatalf("accepted a header that runs past the end of a %d-byte file", fileSize)
	}
	for name, ti := range h.Tensors {
		if ti.Name != name {
			t.Fatalf("tensor %q has Name %q", name, ti.Name)
		}
		if name == "__metadata__" {
			t.Fatalf("__metadata__ accepted as a tensor")
		}
		if ti.Dtype == "" {
			t.Fatalf("tensor %q accepted without dtype", name)
		}
		if ti.Begin < 0 || ti.End < ti.Begin || ti.End > dataLen {
			t.Fatalf("tensor %q: [%d, %d) outside the data section of %d bytes", name, ti.Begin, ti.End, dataLen)
		}
		size, known := DtypeSize(ti.Dtype)
		if !known {
			continue
		}
		want := new(big.Int).SetInt64(size)
		for _, d := range ti.Shape {
			if d < 0 {
				t.Fatalf("tensor %q: negative dimension in %v accepted", name, ti.Shape)
			}
			want.Mul(want, big.NewInt(d))
		}
		if want.Cmp(big.NewInt(ti.End-ti.Begin)) != 0 {
			t.Fatalf("tensor %q: %s %v is %v bytes, range [%d, %d) holds %d", name, ti.Dtype, ti.Shape, want, ti.Begin, ti.End, ti.End-ti.Begin)
		}
	}

	// What we accept we can write back: the mount's table files are
	// EncodeHeader of parsed tensors.
	tensors := make([]TensorInfo, 0, len(h.Tensors))
	for _, n := range h.sortedNames() {
		tensors = append(tensors, h.Tensors[n])
	}
	enc, err := EncodeHeader(tensors, h.Metadata, 1)
	if err != nil {
		t.Fatalf("EncodeHeader of an accepted header: %v", err)
	}
	again, err := ParseHeader(enc[8:], int64(len(enc))+dataLen)
	if err != nil {
		t.Fatalf("re-encoded header refused: %v\n%s", err, shorten(string(enc[8:])))
	}
	if !reflect.DeepEqual(again.Tensors, h.Tensors) {
		t.Fatalf("re-encoded tensors differ:\n got %+v\nwant %+v", again.Tensors, h.Tensors)
	}
	if len(again.Metadata) != len(h.Metadata) || (len(h.Metadata) > 0 && !reflect.DeepEqual(again.Metadata, h.Metadata)) {
		t.Fatalf("re-encoded metadata %v, want %v", again.Metadata, h.Metadata)
	}
}

// fileCases are whole files whose length prefix or size is wrong.
func fileCases() []struct {
	name    string
	file    []byte
	wantErr string
} {
	prefix := func(n uint64, rest string) []byte {
		b := binary.LittleEndian.AppendUint64(nil, n)
		return append(b, rest...)
	}
	valid := `{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}`
	return []struct {
		name    string
		file    []byte
		wantErr string
	}{
		{"file-empty", nil, "shorter than the 8-byte header length"},
		{"file-7-bytes", []byte{2, 0, 0, 0, 0, 0, 0}, "shorter than the 8-byte header length"},
		{"length-max-uint64", prefix(math.MaxUint64, valid), "over the limit"},
		{"length-2pow63", prefix(1<<63, valid), "over the limit"},
		{"length-over-limit", prefix(MaxHeaderBytes+1, valid), "over the limit"},
		{"length-past-file", prefix(uint64(len(valid))+3, valid), "runs past the end of the file"},
		{"length-at-limit-past-file", prefix(MaxHeaderBytes, valid), "runs past the end of the file"},
		{"header-cut-short", prefix(uint64(len(valid)), valid[:20]), "runs past the end of the file"},
		{"length-only", prefix(0, ""), "not a JSON object"},
		{"valid-header-only", prefix(uint64(len(`{}`)), `{}`), ""},
		{"valid-with-data", prefix(uint64(len(valid)), valid+"ab"), ""},
	}
}

func TestReadHeaderFiles(t *testing.T) {
	for _, c := range fileCases() {
		t.Run(c.name, func(t *testing.T) {
			h, err := ReadHeader(bytes.NewReader(c.file), int64(len(c.file)))
			if c.wantErr == "" {
				if err != nil {
					t.Fatalf("valid file refused: %v", err)
				}
				checkAccepted(t, h, err, h.DataStart-8, int64(len(c.file)))
				return
			}
			if err == nil || h != nil {
				t.Fatalf("got %+v, %v; want an error saying %q", h, err, c.wantErr)
			}
			if !strings.Contains(err.Error(), c.wantErr) {
				t.Fatalf("error %q does not say %q", err, c.wantErr)
			}
		})
	}
}

// A hostile length prefix must be refused before anything of that size is
// allocated.
func TestReadHeaderHugeLengthAllocatesNothing(t *testing.T) {
	file := binary.LittleEndian.AppendUint64(nil, MaxHeaderBytes)
	file = append(file, "{}"...)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 10 {
		if _, err := ReadHeader(bytes.NewReader(file), int64(len(file))); err == nil {
			t.Fatal("accepted")
		}
	}
	runtime.ReadMemStats(&after)
	if grown := after.TotalAlloc - before.TotalAlloc; grown > 1<<20 {
		t.Fatalf("refusing a %d-byte header length 10 times allocated %d bytes", MaxHeaderBytes, grown)
	}
}

// eofReaderAt returns io.EOF together with a full buffer at the end of its
// bytes, as io.ReaderAt allows.
type eofReaderAt struct{ b []byte }

func (r eofReaderAt) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(r.b)) {
		return 0, io.EOF
	}
	n := copy(p, r.b[off:])
	if off+int64(n) == int64(len(r.b)) {
		return n, io.EOF
	}
	return n, nil
}

// failReaderAt fails every read.
type failReaderAt struct{}

func (failReaderAt) ReadAt([]byte, int64) (int, error) { return 0, errors.New("disk on fire") }

func TestReadHeaderReaderAtContract(t *testing.T) {
	hdr, err := EncodeHeader([]TensorInfo{{Name: "z", Dtype: "U8", Shape: []int64{0}}}, nil, 1)
	if err != nil {
		t.Fatal(err)
	}
	// The header ends the file: a reader may say EOF along with the last byte.
	h, err := ReadHeader(eofReaderAt{hdr}, int64(len(hdr)))
	if err != nil {
		t.Fatalf("EOF with a full read treated as an error: %v", err)
	}
	if _, ok := h.Tensors["z"]; !ok {
		t.Fatalf("tensor lost: %+v", h)
	}
	// Shorter than claimed: the reader's EOF comes early.
	if _, err := ReadHeader(eofReaderAt{hdr[:len(hdr)-1]}, int64(len(hdr))); err == nil || !strings.Contains(err.Error(), "read header") {
		t.Fatalf("short read: got %v, want a read header error", err)
	}
	_, err = ReadHeader(failReaderAt{}, 100)
	if err == nil || !strings.Contains(err.Error(), "read header length") || !strings.Contains(err.Error(), "disk on fire") {
		t.Fatalf("failing reader: got %v", err)
	}
}

func TestEncodeHeaderRoundTrip(t *testing.T) {
	tensors := []TensorInfo{
		{Name: "layers.3.engram.embed.weight", Dtype: "F8_E4M3", Shape: []int64{1000, 384}, Begin: 0, End: 384000},
		{Name: "layers.3.engram.embed.scale", Dtype: "F32", Shape: []int64{1000, 2}, Begin: 384000, End: 392000},
		{Name: "embed_tokens.weight", Dtype: "BF16", Shape: []int64{3, 5}, Begin: 392000, End: 392030},
		{Name: "odd \"name\" <&> é", Dtype: "I64", Shape: []int64{}, Begin: 392030, End: 392038},
		{Name: "opaque", Dtype: "Q4_0", Shape: []int64{64}, Begin: 392038, End: 392074},
	}
	md := map[string]string{"format": "pt", "note": "x\ny"}
	for _, align := range []int64{0, 1, 8, 512, 4096} {
		for _, meta := range []map[string]string{nil, md} {
			t.Run(fmt.Sprintf("align=%d/metadata=%d", align, len(meta)), func(t *testing.T) {
				hdr, err := EncodeHeader(tensors, meta, align)
				if err != nil {
					t.Fatal(err)
				}
				if align > 1 && int64(len(hdr))%align != 0 {
					t.Fatalf("header is %d bytes, not a multiple of %d", len(hdr), align)
				}
				if n := binary.LittleEndian.Uint64(hdr); n != uint64(len(hdr)-8) {
					t.Fatalf("length prefix %d, header %d bytes", n, len(hdr)-8)
				}
				// Reversed input order encodes to the same bytes.
				rev := append([]TensorInfo(nil), tensors...)
				for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
					rev[i], rev[j] = rev[j], rev[i]
				}
				if again, _ := EncodeHeader(rev, meta, align); !bytes.Equal(again, hdr) {
					t.Fatal("encoding depends on the order of tensors")
				}

				file := append(hdr, make([]byte, 392074)...)
				h, err := ReadHeader(bytes.NewReader(file), int64(len(file)))
				if err != nil {
					t.Fatalf("encoded header refused: %v", err)
				}
				if h.DataStart != int64(len(hdr)) {
					t.Fatalf("DataStart %d, want %d", h.DataStart, len(hdr))
				}
				if len(h.Tensors) != len(tensors) {
					t.Fatalf("%d tensors, want %d", len(h.Tensors), len(tensors))
				}
				for _, want := range tensors {
					if got := h.Tensors[want.Name]; !reflect.DeepEqual(got, want) {
						t.Fatalf("tensor %q: got %+v, want %+v", want.Name, got, want)
					}
				}
				if !reflect.DeepEqual(h.Metadata, meta) {
					t.Fatalf("metadata %v, want %v", h.Metadata, meta)
				}
			})
		}
	}
}

func TestDtypeSize(t *testing.T) {
	for dtype, want := range map[string]int64{"F8_E4M3": 1, "BF16": 2, "F32": 4, "I64": 8, "BOOL": 1} {
		if got, ok := DtypeSize(dtype); !ok || got != want {
			t.Errorf("DtypeSize(%s) = %d, %v; want %d", dtype, got, ok, want)
		}
	}
	if _, ok := DtypeSize("f32"); ok {
		t.Error("dtypes are case-sensitive, f32 is not one")
	}
}

// FuzzParseHeader: whatever the bytes, the parser never panics, and what it
// accepts satisfies checkAccepted.
func FuzzParseHeader(f *testing.F) {
	f.Add([]byte(`{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`), int64(72))
	f.Fuzz(func(t *testing.T, header []byte, fileSize int64) {
		h, err := ParseHeader(header, fileSize)
		if (h == nil) == (err == nil) {
			t.Fatalf("got header %v and error %v", h, err)
		}
		checkAccepted(t, h, err, int64(len(header)), fileSize)
	})
}

// FuzzReadHeader does the same on whole files, length prefix included.
func FuzzReadHeader(f *testing.F) {
	f.Add(headerCase{json: `{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}`, dataLen: 2}.file())
	f.Fuzz(func(t *testing.T, file []byte) {
		h, err := ReadHeader(bytes.NewReader(file), int64(len(file)))
		if (h == nil) == (err == nil) {
			t.Fatalf("got header %v and error %v", h, err)
		}
		if err == nil {
			checkAccepted(t, h, err, h.DataStart-8, int64(len(file)))
		}
	})
}

// corpusDepth is the nesting of the deep-nesting seed: past encoding/json's
// limit of 10000, far smaller than the 100k of the unit test.
const corpusDepth = 10_050

// fuzzCorpus is the committed seed corpus, by target and file name.
func fuzzCorpus() map[string]map[string]string {
	parse, read := map[string]string{}, map[string]string{}
	for _, c := range headerCases {
		if c.name == "deep-nesting" {
			c.json = deepNesting(corpusDepth)
		}
		parse[c.name] = fmt.Sprintf("go test fuzz v1\n[]byte(%q)\nint64(%d)\n", c.json, c.fileSize())
		read[c.name] = fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", c.file())
	}
	for _, c := range fileCases() {
		read[c.name] = fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", c.file)
	}
	return map[string]map[string]string{"FuzzParseHeader": parse, "FuzzReadHeader": read}
}

// TestFuzzCorpus checks that testdata/fuzz holds a seed for every case above,
// so plain `go test` runs each through the fuzz targets' invariants. Set
// BACKING_WRITE_FUZZ_CORPUS=1 to (re)write the seeds after adding a case.
func TestFuzzCorpus(t *testing.T) {
	write := os.Getenv("BACKING_WRITE_FUZZ_CORPUS") != ""
	for target, files := range fuzzCorpus() {
		dir := filepath.Join("testdata", "fuzz", target)
		if write {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		for name, want := range files {
			path := filepath.Join(dir, name)
			if write {
				if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			got, err := os.ReadFile(path)
			if err != nil || string(got) != want {
				t.Errorf("%s is missing or stale: run BACKING_WRITE_FUZZ_CORPUS=1 go test -run TestFuzzCorpus ./backing", path)
			}
		}
	}
}

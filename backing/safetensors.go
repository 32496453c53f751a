package backing

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/bits"
	"sort"
)

// MaxHeaderBytes bounds the JSON header of a safetensors file. The format's
// reference implementation refuses headers over 100 MB; a larger length is
// either corruption or hostile, and we will not allocate it.
const MaxHeaderBytes = 100 << 20

// dtypeSizes are the element sizes of the safetensors dtypes.
var dtypeSizes = map[string]int64{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
	"U16": 2, "I16": 2, "F16": 2, "BF16": 2,
	"U32": 4, "I32": 4, "F32": 4,
	"U64": 8, "I64": 8, "F64": 8,
}

// DtypeSize returns the size in bytes of one element of dtype.
func DtypeSize(dtype string) (int64, bool) {
	n, ok := dtypeSizes[dtype]
	return n, ok
}

// TensorInfo is one entry of a safetensors header. Begin and End are offsets
// relative to the start of the data section, as in the file.
type TensorInfo struct {
	Name  string
	Dtype string
	Shape []int64
	Begin int64
	End   int64
}

// Header is a parsed safetensors header.
type Header struct {
	// DataStart is the file offset of the data section: 8 + header length.
	DataStart int64
	Tensors   map[string]TensorInfo
	Metadata  map[string]string
}

type rawTensor struct {
	Dtype       string  `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// ReadHeader parses and validates the header of a safetensors file of
// fileSize bytes. Every tensor's byte range must lie inside the data section
// and, for a known dtype, match its shape exactly. Errors say what is wrong
// but not which file: callers add the name.
func ReadHeader(r io.ReaderAt, fileSize int64) (*Header, error) {
	if fileSize < 8 {
		return nil, fmt.Errorf("file is %d bytes, shorter than the 8-byte header length", fileSize)
	}
	// io.ReaderAt may return io.EOF along with a full buffer at the end of
	// the input: only a short read is an error.
	var lenBuf [8]byte
	if got, err := r.ReadAt(lenBuf[:], 0); got < len(lenBuf) {
		return nil, fmt.Errorf("read header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeaderBytes {
		return nil, fmt.Errorf("header length %d is over the limit of %d bytes", n, MaxHeaderBytes)
	}
	if int64(n) > fileSize-8 {
		return nil, fmt.Errorf("header length %d runs past the end of the file (%d bytes)", n, fileSize)
	}
	buf := make([]byte, n)
	if got, err := r.ReadAt(buf, 8); got < len(buf) {
		return nil, fmt.Errorf("read header: %w", err)
	}
	return ParseHeader(buf, fileSize)
}

// ParseHeader validates the JSON header buf of a file of fileSize bytes.
func ParseHeader(buf []byte, fileSize int64) (*Header, error) {
	h := &Header{DataStart: 8 + int64(len(buf)), Tensors: map[string]TensorInfo{}}
	dataLen := fileSize - h.DataStart
	if dataLen < 0 {
		return nil, fmt.Errorf("header length %d runs past the end of the file (%d bytes)", len(buf), fileSize)
	}
	// encoding/json refuses nesting deeper than 10000 levels, so a hostile
	// header cannot blow the stack; RawMessage keeps values unparsed until we
	// know what each key is.
	var top map[string]json.RawMessage
	if err := json.Unmarshal(buf, &top); err != nil {
		return nil, fmt.Errorf("header is not a JSON object: %w", err)
	}
	if top == nil { // json.Unmarshal of `null` into a map succeeds, leaving it nil
		return nil, fmt.Errorf("header is not a JSON object: null")
	}
	for name, raw := range top {
		if name == "__metadata__" {
			if err := json.Unmarshal(raw, &h.Metadata); err != nil {
				return nil, fmt.Errorf("__metadata__ is not a map of strings: %w", err)
			}
			continue
		}
		var rt rawTensor
		if err := json.Unmarshal(raw, &rt); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		ti, err := checkTensor(name, rt, dataLen)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		h.Tensors[name] = ti
	}
	return h, nil
}

func checkTensor(name string, rt rawTensor, dataLen int64) (TensorInfo, error) {
	ti := TensorInfo{Name: name, Dtype: rt.Dtype, Shape: rt.Shape}
	if rt.Dtype == "" {
		return ti, fmt.Errorf("no dtype")
	}
	if len(rt.DataOffsets) != 2 {
		return ti, fmt.Errorf("data_offsets has %d entries, want 2", len(rt.DataOffsets))
	}
	ti.Begin, ti.End = rt.DataOffsets[0], rt.DataOffsets[1]
	if ti.Begin < 0 || ti.End < ti.Begin {
		return ti, fmt.Errorf("data_offsets [%d, %d] are not an ordered pair of offsets", ti.Begin, ti.End)
	}
	if ti.End > dataLen {
		return ti, fmt.Errorf("data_offsets [%d, %d] run past the end of the data section (%d bytes)", ti.Begin, ti.End, dataLen)
	}
	elems, ok := elements(rt.Shape)
	if !ok {
		return ti, fmt.Errorf("shape %v is negative or its size overflows", rt.Shape)
	}
	size, known := DtypeSize(rt.Dtype)
	if !known {
		// Unknown dtypes are legal in tensors we do not serve; tables check
		// their dtype themselves.
		return ti, nil
	}
	hi, want := bits.Mul64(elems, uint64(size))
	if hi != 0 {
		return ti, fmt.Errorf("dtype %s and shape %v: the byte size overflows", rt.Dtype, rt.Shape)
	}
	if want != uint64(ti.End-ti.Begin) {
		return ti, fmt.Errorf("dtype %s and shape %v need %d bytes, data_offsets [%d, %d] hold %d",
			rt.Dtype, rt.Shape, want, ti.Begin, ti.End, ti.End-ti.Begin)
	}
	return ti, nil
}

// elements is the product of shape, or false if a dimension is negative or
// the product overflows.
func elements(shape []int64) (uint64, bool) {
	n := uint64(1)
	for _, d := range shape {
		if d < 0 {
			return 0, false
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 {
			return 0, false
		}
		n = lo
	}
	return n, true
}

// EncodeHeader renders a safetensors header (length prefix and JSON) for
// tensors, padded with spaces (the format allows trailing whitespace) so that
// the data section starts at a multiple of align. It returns the bytes that
// precede the data section.
func EncodeHeader(tensors []TensorInfo, metadata map[string]string, align int64) ([]byte, error) {
	top := make(map[string]any, len(tensors)+1)
	if len(metadata) > 0 {
		top["__metadata__"] = metadata
	}
	for _, t := range tensors {
		top[t.Name] = rawTensor{Dtype: t.Dtype, Shape: t.Shape, DataOffsets: []int64{t.Begin, t.End}}
	}
	js, err := json.Marshal(top) // maps marshal with sorted keys: output is deterministic
	if err != nil {
		return nil, err
	}
	total := 8 + int64(len(js))
	if align > 1 {
		total = (total + align - 1) / align * align
	}
	out := make([]byte, total)
	binary.LittleEndian.PutUint64(out, uint64(total-8))
	n := copy(out[8:], js)
	for i := 8 + n; i < len(out); i++ {
		out[i] = ' '
	}
	return out, nil
}

// sortedNames returns the tensor names of h in order.
func (h *Header) sortedNames() []string {
	names := make([]string, 0, len(h.Tensors))
	for n := range h.Tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

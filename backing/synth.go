package backing

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strconv"
)

// SynthSpec describes a synthetic model directory.
type SynthSpec struct {
	Layers     int    // engram layers, numbered 0..Layers-1
	Rows       uint64 // rows per table
	WeightRow  int64  // bytes per weight row (F8_E4M3)
	ScaleRow   int64  // bytes per scale row (F32, so a multiple of 4)
	Seed       uint64
	TableNames string // a format with %d for the layer and %s for weight|scale
}

// DefaultSynth is the geometry of the default synthetic model: page-sized
// weight rows, 128-byte scale rows.
func DefaultSynth() SynthSpec {
	return SynthSpec{Layers: 2, Rows: 16384, WeightRow: 4096, ScaleRow: 128, Seed: 1,
		TableNames: "layers.%d.engram.embed.%s"}
}

// FlashGeometry sets the small-row geometry: many rows share each page.
func (s *SynthSpec) FlashGeometry() { s.WeightRow, s.ScaleRow = 256, 8 }

// UnrelatedTensor is the tensor every synthetic model carries that is not an
// engram table; the mount must not expose it.
const UnrelatedTensor = "embed_tokens.weight"

// Synthesize writes a model directory: an index, one shard per layer, and an
// unrelated tensor placed before the first layer's tables so their data
// starts at an unaligned shard offset. Bytes are a pure function of the seed,
// tensor name and offset (see SynthWord).
func Synthesize(dir string, spec SynthSpec) error {
	if spec.Layers < 1 || spec.Rows < 1 || spec.WeightRow < 1 || spec.ScaleRow < 4 || spec.ScaleRow%4 != 0 {
		return fmt.Errorf("synthetic model: need layers >= 1, rows >= 1, weight row >= 1 byte, scale row a positive multiple of 4 bytes")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	weightMap := map[string]string{}
	for layer := 0; layer < spec.Layers; layer++ {
		shard := fmt.Sprintf("model-%05d-of-%05d.safetensors", layer+1, spec.Layers)
		var tensors []TensorInfo
		off := int64(0)
		add := func(name, dtype string, shape []int64, bytes int64) {
			tensors = append(tensors, TensorInfo{Name: name, Dtype: dtype, Shape: shape, Begin: off, End: off + bytes})
			off += bytes
		}
		if layer == 0 {
			add(UnrelatedTensor, "F32", []int64{64, 13}, 64*13*4)
		}
		rows := int64(spec.Rows)
		add(fmt.Sprintf(spec.TableNames, layer, "weight"), "F8_E4M3", []int64{rows, spec.WeightRow}, rows*spec.WeightRow)
		add(fmt.Sprintf(spec.TableNames, layer, "scale"), "F32", []int64{rows, spec.ScaleRow / 4}, rows*spec.ScaleRow)
		for _, t := range tensors {
			weightMap[t.Name] = shard
		}
		if err := writeShard(filepath.Join(dir, shard), tensors, spec.Seed); err != nil {
			return err
		}
	}
	idx, err := json.MarshalIndent(map[string]any{
		"metadata":   map[string]string{"generator": "engramfs synth", "seed": strconv.FormatUint(spec.Seed, 10)},
		"weight_map": weightMap,
	}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, IndexFile), append(idx, '\n'), 0o644)
}

func writeShard(path string, tensors []TensorInfo, seed uint64) error {
	// Align 1: the data section starts wherever the JSON ends, as in real
	// checkpoints, so nothing downstream may assume alignment.
	hdr, err := EncodeHeader(tensors, map[string]string{"format": "pt"}, 1)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if _, err := w.Write(hdr); err != nil {
		f.Close()
		return err
	}
	buf := make([]byte, 1<<20)
	for _, t := range tensors {
		key := NameKey(seed, t.Name)
		for off := int64(0); off < t.End-t.Begin; off += int64(len(buf)) {
			n := min(int64(len(buf)), t.End-t.Begin-off)
			FillSynth(buf[:n], key, off)
			if _, err := w.Write(buf[:n]); err != nil {
				f.Close()
				return err
			}
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// NameKey mixes the seed and a tensor name into the key of FillSynth.
func NameKey(seed uint64, name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return h.Sum64() ^ seed*0x9E3779B97F4A7C15
}

// FillSynth fills b with the synthetic bytes of a tensor at byte offset off.
func FillSynth(b []byte, key uint64, off int64) {
	var w [8]byte
	for i := 0; i < len(b); {
		word := uint64(off+int64(i)) / 8
		binary.LittleEndian.PutUint64(w[:], SynthWord(key, word))
		i += copy(b[i:], w[(off+int64(i))%8:])
	}
}

// SynthWord is splitmix64 of the key and the word index: fast, and every
// 8-byte word of every tensor differs, so a byte served from the wrong
// offset or table never matches by accident.
func SynthWord(key, word uint64) uint64 {
	z := key + (word+1)*0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

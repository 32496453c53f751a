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
// engram table: the mount serves it from its shard, not as a table.
const UnrelatedTensor = "embed_tokens.weight"

// SynthConfigFiles are the small files a synthetic model directory holds
// beside its shards and index, so that it is a model directory as an engine
// reads one (config, tokenizer, generation config).
var SynthConfigFiles = []string{"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}

// Synthesize writes a model directory: an index, one shard per layer, and an
// unrelated tensor placed before the first layer's tables so their data
// starts at an unaligned shard offset, plus SynthConfigFiles. Bytes are a
// pure function of the seed, tensor name and offset (see SynthWord).
func Synthesize(dir string, spec SynthSpec) error {
	if spec.Layers < 1 || spec.Rows < 1 || spec.WeightRow < 1 || spec.ScaleRow < 4 || spec.ScaleRow%4 != 0 {
		return fmt.Errorf("synthetic model: need layers >= 1, rows >= 1, weight row >= 1 byte, scale row a positive multiple of 4 bytes")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	weightMap := map[string]string{}
	var total int64
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
			total += t.End - t.Begin
		}
		if err := writeShard(filepath.Join(dir, shard), tensors, spec.Seed); err != nil {
			return err
		}
	}
	idx, err := json.MarshalIndent(map[string]any{
		"metadata":   map[string]any{"total_size": total, "generator": "engramfs synth", "seed": strconv.FormatUint(spec.Seed, 10)},
		"weight_map": weightMap,
	}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, IndexFile), append(idx, '\n'), 0o644); err != nil {
		return err
	}
	return writeSynthConfig(dir, spec)
}

// writeSynthConfig writes SynthConfigFiles: a DeepSeek-shaped config naming
// the engram layers, a tiny byte-level tokenizer and a generation config.
func writeSynthConfig(dir string, spec SynthSpec) error {
	layers := make([]int, spec.Layers)
	for i := range layers {
		layers[i] = i
	}
	vocab := map[string]int{}
	for i := range 256 {
		vocab[fmt.Sprintf("<0x%02X>", i)] = i
	}
	files := map[string]any{
		"config.json": map[string]any{
			"architectures": []string{"EngramSynthForCausalLM"}, "model_type": "engram_synth",
			"num_hidden_layers": spec.Layers, "engram_layers": layers, "engram_rows": spec.Rows,
			"engram_weight_bytes": spec.WeightRow, "engram_scale_bytes": spec.ScaleRow,
			"torch_dtype": "bfloat16", "vocab_size": 256,
		},
		"generation_config.json": map[string]any{"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 16},
		"tokenizer.json": map[string]any{
			"version": "1.0", "model": map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{}, "byte_fallback": true},
		},
		"tokenizer_config.json": map[string]any{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096},
	}
	for _, name := range SynthConfigFiles {
		b, err := json.MarshalIndent(files[name], "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, name), append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
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

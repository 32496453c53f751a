package main

import (
	"fmt"
	"time"

	"github.com/engramfs/engramfs/backing"
)

func init() {
	register("synth", "write a synthetic model directory with engram tables", runSynth)
}

func runSynth(args []string) error {
	fl := newFlagSet("synth", "[flags] DIR", `
Writes a synthetic model directory to DIR: model.safetensors.index.json, one
shard per engram layer, tables layers.<L>.engram.embed.weight (F8_E4M3) and
layers.<L>.engram.embed.scale (F32), one tensor that is not a table (the mount
serves it from its shard), and config.json, generation_config.json,
tokenizer.json and tokenizer_config.json. The bytes are a deterministic function of --seed, the tensor
name and the offset.`)
	spec := backing.DefaultSynth()
	fl.IntVar(&spec.Layers, "layers", spec.Layers, "engram layers (numbered from 0)")
	fl.Uint64Var(&spec.Rows, "rows", spec.Rows, "rows per table")
	fl.Int64Var(&spec.WeightRow, "weight-bytes", spec.WeightRow, "bytes per weight row")
	fl.Int64Var(&spec.ScaleRow, "scale-bytes", spec.ScaleRow, "bytes per scale row (a multiple of 4)")
	fl.Uint64Var(&spec.Seed, "seed", spec.Seed, "seed of the table bytes")
	geometry := fl.String("geometry", "", "preset row sizes: 'flash' for small rows (256-byte weight, 8-byte scale rows); overrides --weight-bytes and --scale-bytes")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 1 {
		return usagef("want DIR, got %d arguments", fl.NArg())
	}
	switch *geometry {
	case "":
	case "flash":
		spec.FlashGeometry()
	default:
		return usagef("--geometry %q: the only preset is flash", *geometry)
	}
	start := time.Now()
	if err := backing.Synthesize(fl.Arg(0), spec); err != nil {
		return err
	}
	total := float64(spec.Rows) * float64(spec.WeightRow+spec.ScaleRow) * float64(spec.Layers)
	fmt.Printf("wrote %s: %d layers × %d rows (%d + %d bytes a row), %.1f MiB in %v\n",
		fl.Arg(0), spec.Layers, spec.Rows, spec.WeightRow, spec.ScaleRow, total/(1<<20), time.Since(start).Round(time.Millisecond))
	return nil
}

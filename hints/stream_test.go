package hints

import (
	"slices"
	"testing"
)

// A streaming decoder hands out every row as its write arrives and keeps
// nothing of a frame between writes but a partial row or header.
func TestStreamDecoderHandsOutPartsAndBuffersNothing(t *testing.T) {
	d := NewStreamDecoder(layers{0: 1 << 20, 2: 100})
	var want []uint64
	for i := range uint64(50000) {
		want = append(want, i*7%(1<<20))
	}
	stream := AppendBinary(nil, Decode, 0, want)
	stream = AppendText(stream, Prefill, 2, []uint64{5, 6, 7, 8, 9, 10, 11, 12, 13})
	var got []uint64
	var text []uint64
	frames := 0
	for i := 0; i < len(stream); i += 4093 { // writes that split rows and tokens
		parts, err := d.Write(stream[i:min(i+4093, len(stream))])
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range parts {
			switch p.Layer {
			case 0:
				got = append(got, p.Rows...)
			case 2:
				text = append(text, p.Rows...)
			}
			if !p.More {
				frames++
			}
		}
		if b := d.Buffered(); b > 2*rowLen+maxToken {
			t.Fatalf("after a write the decoder holds %d bytes", b)
		}
	}
	if !slices.Equal(got, want) || frames != 2 || !slices.Equal(text, []uint64{5, 6, 7, 8, 9, 10, 11, 12, 13}) {
		t.Fatalf("%d binary rows (want %d), text %v, %d frames ended (want 2)", len(got), len(want), text, frames)
	}
}

// The row limit counts the whole frame, not the part.
func TestStreamDecoderLimitsTheWholeFrame(t *testing.T) {
	d := NewStreamDecoder(layers{0: 10})
	line := []byte("decode 0")
	for range MaxRowsPerFrame {
		line = append(line, " 1"...)
	}
	line = append(line, " 1\n"...)
	var err error
	for i := 0; i < len(line) && err == nil; i += 1 << 16 {
		_, err = d.Write(line[i:min(i+1<<16, len(line))])
	}
	if err == nil {
		t.Fatal("a text frame over the row limit streamed through")
	}
}

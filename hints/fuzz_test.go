package hints

import (
	"encoding/binary"
	"math"
	"testing"
)

// FuzzDecoder feeds arbitrary bytes in chunks whose sizes come from cuts (an
// empty cuts means byte by byte). Decoding must never panic, must hold memory
// in proportion to the bytes received, must only return valid frames, and must
// not depend on how the stream is split.
func FuzzDecoder(f *testing.F) {
	f.Add([]byte("decode 0 1 2 3\n"), []byte{})
	f.Add([]byte(bin(Decode, 0, 1, 2, 999)), []byte{5, 0, 3})
	f.Fuzz(func(t *testing.T, data, cuts []byte) {
		whole, wholeErr := NewDecoder(testLayers).Write(data)
		checkFrames(t, whole)

		d := NewDecoder(testLayers)
		var split []Frame
		var splitErr error
		for i, pos := 0, 0; pos < len(data); i++ {
			size := 1
			if len(cuts) > 0 {
				// A zero cut is an empty write; the write after it takes a byte.
				size = int(cuts[i%len(cuts)])
				if size == 0 && i > 0 && cuts[(i-1)%len(cuts)] == 0 {
					size = 1
				}
			}
			end := min(pos+size, len(data))
			frames, err := d.Write(data[pos:end])
			pos = end
			checkFrames(t, frames)
			if limit := 8*pos + 8*minRows + maxToken; d.Buffered() > limit || d.Buffered() > 8*MaxRowsPerFrame+maxToken {
				t.Fatalf("Buffered() = %d after %d bytes, limit %d", d.Buffered(), pos, limit)
			}
			if err != nil && d.Buffered() != 0 {
				t.Fatalf("Buffered() = %d after error %v", d.Buffered(), err)
			}
			if splitErr == nil {
				split = append(split, frames...)
				splitErr = err
			}
		}
		if (wholeErr == nil) != (splitErr == nil) || (wholeErr != nil && wholeErr.Error() != splitErr.Error()) {
			t.Fatalf("one write failed with %v, split writes with %v", wholeErr, splitErr)
		}
		if !sameFrames(whole, split) {
			t.Fatalf("one write gave %v, split writes %v", whole, split)
		}
	})
}

func checkFrames(t *testing.T, frames []Frame) {
	t.Helper()
	for _, f := range frames {
		rows, ok := testLayers.LayerRows(f.Layer)
		if !ok || (f.Class != Prefill && f.Class != Decode) || len(f.Rows) > MaxRowsPerFrame {
			t.Fatalf("invalid frame returned: %v", f)
		}
		for _, r := range f.Rows {
			if r >= rows {
				t.Fatalf("row %d of layer %d returned, layer has %d rows", r, f.Layer, rows)
			}
		}
	}
}

// everyLayer has every layer, each of math.MaxUint64 rows.
type everyLayer struct{}

func (everyLayer) LayerRows(int) (uint64, bool) { return math.MaxUint64, true }

// FuzzRoundTrip encodes a frame in both encodings and decodes the stream whole
// and split at one point: both must give back the frame twice, or fail on the
// one row value that is out of range.
func FuzzRoundTrip(f *testing.F) {
	f.Add(uint8(1), uint16(3), []byte{}, uint16(0))
	f.Add(uint8(0), uint16(65535), []byte("\xff\xff\xff\xff\xff\xff\xff\xfe\x01\x00\x00\x00\x00\x00\x00\x00"), uint16(13))
	f.Fuzz(func(t *testing.T, class uint8, layer uint16, raw []byte, cut uint16) {
		want := Frame{Class: Class(class & 1), Layer: int(layer)}
		valid := true
		for ; len(raw) >= 8; raw = raw[8:] {
			r := binary.LittleEndian.Uint64(raw)
			want.Rows = append(want.Rows, r)
			valid = valid && r != math.MaxUint64
		}
		stream := AppendBinary(nil, want.Class, want.Layer, want.Rows)
		stream = AppendText(stream, want.Class, want.Layer, want.Rows)
		at := int(cut) % (len(stream) + 1)
		for _, chunks := range [][][]byte{{stream}, {stream[:at], stream[at:]}} {
			frames, err := feed(NewDecoder(everyLayer{}), chunks...)
			if !valid {
				if err == nil || len(frames) != 0 {
					t.Fatalf("row %d accepted: %v, %v", uint64(math.MaxUint64), frames, err)
				}
				continue
			}
			if err != nil || !sameFrames(frames, []Frame{want, want}) {
				t.Fatalf("decoded %v, %v; want %v twice", frames, err, want)
			}
		}
	})
}

package hints

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

// layers is a Validator backed by a map of layer to row count.
type layers map[int]uint64

func (l layers) LayerRows(layer int) (uint64, bool) {
	rows, ok := l[layer]
	return rows, ok
}

var testLayers = layers{0: 1000, 1: math.MaxUint64, 3: 1, 9: 0}

func bin(c Class, layer int, rows ...uint64) string {
	return string(AppendBinary(nil, c, layer, rows))
}

// header builds a binary header field by field, so bad ones can be made.
func header(magic string, class, reserved byte, layer uint16, count uint32) string {
	b := []byte(magic)
	b = append(b, class, reserved)
	b = binary.LittleEndian.AppendUint16(b, layer)
	b = binary.LittleEndian.AppendUint32(b, count)
	return string(b)
}

func rowBytes(rows ...uint64) string {
	var b []byte
	for _, r := range rows {
		b = binary.LittleEndian.AppendUint64(b, r)
	}
	return string(b)
}

// feed writes each chunk in turn and returns the frames up to and including the
// write that fails, and that write's error.
func feed(d *Decoder, chunks ...[]byte) ([]Frame, error) {
	var all []Frame
	for _, c := range chunks {
		frames, err := d.Write(c)
		all = append(all, frames...)
		if err != nil {
			return all, err
		}
	}
	return all, nil
}

func bytewise(s string) [][]byte {
	chunks := make([][]byte, len(s))
	for i := range s {
		chunks[i] = []byte{s[i]}
	}
	return chunks
}

// sameFrames compares frames treating nil and empty rows alike.
func sameFrames(a, b []Frame) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Class != b[i].Class || a[i].Layer != b[i].Layer || len(a[i].Rows) != len(b[i].Rows) {
			return false
		}
		if len(a[i].Rows) > 0 && !reflect.DeepEqual(a[i].Rows, b[i].Rows) {
			return false
		}
	}
	return true
}

func TestDecodeValid(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []Frame
	}{
		{"text", "decode 0 1 2 999\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{1, 2, 999}}}},
		{"text large rows", "prefill 1 0 18446744073709551614\n", []Frame{{Class: Prefill, Layer: 1, Rows: []uint64{0, math.MaxUint64 - 1}}}},
		{"text tabs and spaces", "  decode\t0  5 \t6 \t\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{5, 6}}}},
		{"text crlf", "decode 0 5\r\nprefill 0 6 \r\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{5}}, {Class: Prefill, Layer: 0, Rows: []uint64{6}}}},
		{"text leading zeros", "decode 000 007\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{7}}}},
		{"text no rows", "decode 0\nprefill 9 # empty layer\n", []Frame{{Class: Decode, Layer: 0, Rows: nil}, {Class: Prefill, Layer: 9, Rows: nil}}},
		{"text comment ends token", "decode 0 1#2 3\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{1}}}},
		{"blank and comment lines", "\n# a comment\n   \n\t\r\n#\r\ndecode 3 0 # step 7\n\n",
			[]Frame{{Class: Decode, Layer: 3, Rows: []uint64{0}}}},
		{"comment mentioning E", "# EGH1\ndecode 0 1\n", []Frame{{Class: Decode, Layer: 0, Rows: []uint64{1}}}},
		{"binary", bin(Decode, 0, 1, 2, 999), []Frame{{Class: Decode, Layer: 0, Rows: []uint64{1, 2, 999}}}},
		{"binary count 0", bin(Prefill, 3), []Frame{{Class: Prefill, Layer: 3, Rows: nil}}},
		{"binary large rows", bin(Prefill, 1, math.MaxUint64-1, 1<<40), []Frame{{Class: Prefill, Layer: 1, Rows: []uint64{math.MaxUint64 - 1, 1 << 40}}}},
		{"binary back to back", bin(Decode, 0, 7) + bin(Prefill, 0) + bin(Prefill, 3, 0),
			[]Frame{{Class: Decode, Layer: 0, Rows: []uint64{7}}, {Class: Prefill, Layer: 0, Rows: nil}, {Class: Prefill, Layer: 3, Rows: []uint64{0}}}},
		{"mixed", "# warm up\n" + bin(Decode, 0, 4, 5) + "prefill 0 6\n" + bin(Prefill, 1, 8) + "decode 3\n",
			[]Frame{{Class: Decode, Layer: 0, Rows: []uint64{4, 5}}, {Class: Prefill, Layer: 0, Rows: []uint64{6}}, {Class: Prefill, Layer: 1, Rows: []uint64{8}}, {Class: Decode, Layer: 3, Rows: nil}}},
		{"partial text frame", "decode 0 1 2", nil},
		{"partial binary frame", bin(Decode, 0, 1, 2)[:20], nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := NewDecoder(testLayers).Write([]byte(tt.in))
			if err != nil || !sameFrames(got, tt.want) {
				t.Fatalf("one write: got %v, %v; want %v", got, err, tt.want)
			}
			got, err = feed(NewDecoder(testLayers), bytewise(tt.in)...)
			if err != nil || !sameFrames(got, tt.want) {
				t.Fatalf("byte by byte: got %v, %v; want %v", got, err, tt.want)
			}
			for i := range len(tt.in) + 1 {
				got, err = feed(NewDecoder(testLayers), []byte(tt.in[:i]), nil, []byte(tt.in[i:]))
				if err != nil || !sameFrames(got, tt.want) {
					t.Fatalf("split at %d: got %v, %v; want %v", i, got, err, tt.want)
				}
			}
		})
	}
}

func TestDecodeErrors(t *testing.T) {
	good := "decode 0 1\n"
	goodFrame := Frame{Class: Decode, Layer: 0, Rows: []uint64{1}}
	tests := []struct {
		name    string
		in      string
		wantErr string
	}{
		{"binary unknown layer", header("EGH1", 1, 0, 7, 1) + rowBytes(0), `hint frame: layer 7: unknown layer`},
		{"binary row out of range", bin(Decode, 0, 5, 1000, 6), `hint frame: row 1000 out of range (layer 0 has 1000 rows)`},
		{"binary row in empty layer", bin(Decode, 9, 0), `hint frame: row 0 out of range (layer 9 has 0 rows)`},
		{"bad magic", header("EGHX", 1, 0, 0, 0), `hint frame: bad magic "EGHX"`},
		{"bad magic early", "Ex\n", `hint frame: bad magic "Ex"`},
		{"text line starting with E", "Edecode 0 1\n", `hint frame: bad magic "Ed"`},
		{"bad class", header("EGH1", 3, 0, 0, 0), `hint frame: bad class 3`},
		{"bad reserved byte", header("EGH1", 0, 5, 0, 0), `hint frame: bad reserved byte 5`},
		{"count over limit", header("EGH1", 0, 0, 0, 9999999), `hint frame: layer 0: count 9999999 over the limit 4194304`},
		{"count one over limit", header("EGH1", 0, 0, 0, MaxRowsPerFrame+1), `hint frame: layer 0: count 4194305 over the limit 4194304`},
		{"text unknown class", "foo 0 1\n", `hint frame: text: unknown class "foo"`},
		{"text class case", "Decode 0 1\n", `hint frame: text: unknown class "Decode"`},
		{"text leading space before E", " EGH1\n", `hint frame: text: unknown class "EGH1"`},
		{"text class too long", "prefillprefillprefill 0\n", `hint frame: text: class "prefillprefillprefil"... longer than 20 bytes`},
		{"text bad row", "decode 0 12a\n", `hint frame: text: bad row "12a"`},
		{"text negative row", "decode 0 -1\n", `hint frame: text: bad row "-1"`},
		{"text plus row", "decode 0 +1\n", `hint frame: text: bad row "+1"`},
		{"text row overflows uint64", "prefill 1 18446744073709551616\n", `hint frame: text: bad row "18446744073709551616"`},
		{"text row too long", "prefill 1 000000000000000000001\n", `hint frame: text: row "00000000000000000000"... longer than 20 bytes`},
		{"text row out of range", "decode 0 1 1000\n", `hint frame: text: row 1000 out of range (layer 0 has 1000 rows)`},
		{"text bad layer", "decode x 1\n", `hint frame: text: bad layer "x"`},
		{"text layer too long", "decode 000000000000000000000 1\n", `hint frame: text: layer "00000000000000000000"... longer than 20 bytes`},
		{"text unknown layer", "decode 7 1\n", `hint frame: text: layer 7: unknown layer`},
		{"text layer over limit", "decode 70000\n", `hint frame: text: layer 70000 over the limit 65535`},
		{"text missing layer", "decode\n", `hint frame: text: decode: missing layer`},
		{"text missing layer before comment", "prefill # layer?\n", `hint frame: text: prefill: missing layer`},
		{"text stray carriage return", "decode 0 1\r2\n", `hint frame: text: carriage return not followed by newline`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A good frame before the bad one is returned with the error; one
			// after it in the same write is discarded.
			in := good + tt.in + good
			check := func(how string, got []Frame, err error) {
				t.Helper()
				if !errors.Is(err, ErrBadFrame) || err.Error() != tt.wantErr {
					t.Fatalf("%s: error %v, want %q wrapping ErrBadFrame", how, err, tt.wantErr)
				}
				if !sameFrames(got, []Frame{goodFrame}) {
					t.Fatalf("%s: frames %v, want %v", how, got, []Frame{goodFrame})
				}
			}
			d := NewDecoder(testLayers)
			got, err := d.Write([]byte(in))
			check("one write", got, err)
			if d.Buffered() != 0 {
				t.Fatalf("Buffered() = %d after an error, want 0", d.Buffered())
			}
			// The stream restarts: the next write decodes on its own.
			got, err = d.Write([]byte(good))
			if err != nil || !sameFrames(got, []Frame{goodFrame}) {
				t.Fatalf("write after error: got %v, %v", got, err)
			}
			got, err = feed(NewDecoder(testLayers), bytewise(in)...)
			check("byte by byte", got, err)
		})
	}
}

// A header may claim any count up to the limit; memory must follow the bytes
// that arrive, not the claim.
func TestBinaryMemoryFollowsArrivedRows(t *testing.T) {
	d := NewDecoder(testLayers)
	if _, err := d.Write([]byte(header("EGH1", 0, 0, 1, MaxRowsPerFrame))); err != nil {
		t.Fatal(err)
	}
	if got := d.Buffered(); got != 0 {
		t.Fatalf("after a header announcing %d rows, Buffered() = %d, want 0", MaxRowsPerFrame, got)
	}
	if _, err := d.Write([]byte(rowBytes(1, 2, 3)[:20])); err != nil {
		t.Fatal(err)
	}
	if got, limit := d.Buffered(), 8*minRows+8; got > limit {
		t.Fatalf("after 2.5 rows, Buffered() = %d, want <= %d", got, limit)
	}
	// Rows that arrive in one write take exactly their size.
	d = NewDecoder(testLayers)
	rows := make([]uint64, 1000)
	frame := bin(Prefill, 1, rows...)
	if _, err := d.Write([]byte(frame[:len(frame)-1])); err != nil {
		t.Fatal(err)
	}
	if got, want := d.Buffered(), 8*999+7; got != want {
		t.Fatalf("one byte short of 1000 rows, Buffered() = %d, want %d", got, want)
	}
}

func TestTextMemoryIsTokenBounded(t *testing.T) {
	d := NewDecoder(testLayers)
	// Whitespace and comments cost nothing, however long.
	in := "decode" + strings.Repeat(" ", 1<<16) + "0 # " + strings.Repeat("x", 1<<16)
	if _, err := d.Write([]byte(in)); err != nil {
		t.Fatal(err)
	}
	if got := d.Buffered(); got != 0 {
		t.Fatalf("Buffered() = %d, want 0", got)
	}
	if _, err := d.Write([]byte("\ndecode 0 123")); err != nil {
		t.Fatal(err)
	}
	if got := d.Buffered(); got != 3 {
		t.Fatalf("Buffered() = %d with a 3-digit partial token, want 3", got)
	}
}

func TestRowsPerFrameLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("writes frames of 4M rows")
	}
	rows := make([]uint64, MaxRowsPerFrame)
	text := AppendText(nil, Prefill, 1, rows)
	tests := []struct {
		name    string
		in      []byte
		wantErr string
	}{
		{"binary at the limit", AppendBinary(nil, Prefill, 1, rows), ""},
		{"text at the limit", text, ""},
		{"text over the limit", append(text[:len(text)-1:len(text)-1], " 0\n"...),
			"hint frame: text: layer 1: more than 4194304 rows"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecoder(testLayers)
			frames, err := d.Write(tt.in)
			if tt.wantErr != "" {
				if err == nil || err.Error() != tt.wantErr {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || len(frames) != 1 || len(frames[0].Rows) != MaxRowsPerFrame {
				t.Fatalf("got %d frames, %v", len(frames), err)
			}
		})
	}
}

// The decoder hands each frame's rows to the caller and never touches them again.
func TestFramesDoNotAlias(t *testing.T) {
	d := NewDecoder(testLayers)
	first, err := d.Write([]byte(bin(Decode, 0, 1, 2) + "decode 0 3"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Write([]byte(" 4\n" + bin(Decode, 0, 5, 6))); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(first[0].Rows, []uint64{1, 2}) {
		t.Fatalf("first frame's rows changed to %v", first[0].Rows)
	}
}

func TestReset(t *testing.T) {
	d := NewDecoder(testLayers)
	if _, err := d.Write([]byte(bin(Decode, 0, 1, 2)[:17])); err != nil {
		t.Fatal(err)
	}
	d.Reset()
	if d.Buffered() != 0 {
		t.Fatalf("Buffered() = %d after Reset", d.Buffered())
	}
	frames, err := d.Write([]byte("decode 0 9\n"))
	if err != nil || !sameFrames(frames, []Frame{{Class: Decode, Layer: 0, Rows: []uint64{9}}}) {
		t.Fatalf("after Reset: %v, %v", frames, err)
	}
}

func TestClassString(t *testing.T) {
	for c, want := range map[Class]string{Prefill: "prefill", Decode: "decode", 7: "Class(7)"} {
		if got := c.String(); got != want {
			t.Errorf("Class(%d).String() = %q, want %q", uint8(c), got, want)
		}
	}
}

func TestParseDecimal(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"0", 0, true},
		{"18446744073709551615", math.MaxUint64, true},
		{"18446744073709551616", 0, false},
		{"99999999999999999999", 0, false},
		{"", 0, false},
		{"1_000", 0, false},
		{"0x10", 0, false},
	}
	for _, tt := range tests {
		got, ok := parseDecimal([]byte(tt.in))
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseDecimal(%q) = %d, %v; want %d, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

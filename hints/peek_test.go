package hints

import "testing"

// NextClass names the class of the frame a write continues or begins,
// wherever the stream was cut, and says so only when the bytes do.
func TestNextClass(t *testing.T) {
	dec := bin(Decode, 0, 1, 2)
	pre := bin(Prefill, 0, 1, 2)
	for _, c := range []struct {
		name        string
		before, now string
		want        Class
		ok          bool
	}{
		{"binary decode frame", "", dec, Decode, true},
		{"binary prefill frame", "", pre, Prefill, true},
		{"binary header cut before the class", "", dec[:3], 0, false},
		{"binary header continued", dec[:2], dec[2:], Decode, true},
		{"binary header past the class", dec[:6], dec[6:], Decode, true},
		{"binary rows continued", pre[:14], pre[14:], Prefill, true},
		{"binary bad class", "", header(magic, 7, 0, 0, 1), 0, false},
		{"text decode", "", "decode 0 1 2\n", Decode, true},
		{"text prefill after comments and blanks", "", "# c\n\n  \t\r\nprefill 0 1\n", Prefill, true},
		{"text class token continued", "dec", "ode 0 1\n", Decode, true},
		{"text line continued", "prefill 0 ", "1 2\n", Prefill, true},
		{"text comment continued", "# a long", " comment\ndecode 0 1\n", Decode, true},
		{"text comment after a class", "decode 0 1 # x", "y\n", Decode, true},
		{"text token cut", "", "deco", 0, false},
		{"text unknown class", "", "fetch 0 1\n", 0, false},
		{"empty", "", "", 0, false},
	} {
		d := NewStreamDecoder(testLayers)
		if _, err := d.Write([]byte(c.before)); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		got, ok := d.NextClass([]byte(c.now))
		if ok != c.ok || (ok && got != c.want) {
			t.Errorf("%s: %v, %v; want %v, %v", c.name, got, ok, c.want, c.ok)
		}
		// It consumes nothing: the write that follows decodes as if unasked.
		if _, err := d.Write([]byte(c.now)); err != nil && c.ok {
			t.Errorf("%s: write after NextClass: %v", c.name, err)
		}
	}
}

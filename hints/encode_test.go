package hints

import (
	"math"
	"testing"
)

func TestAppendBinaryLayout(t *testing.T) {
	got := AppendBinary([]byte("x"), Decode, 0x0203, []uint64{1, 0x0102030405060708})
	want := "x" + "EGH1" + "\x01" + "\x00" + "\x03\x02" + "\x02\x00\x00\x00" +
		"\x01\x00\x00\x00\x00\x00\x00\x00" + "\x08\x07\x06\x05\x04\x03\x02\x01"
	if string(got) != want {
		t.Fatalf("AppendBinary = %q, want %q", got, want)
	}
	if got := string(AppendBinary(nil, Prefill, 0, nil)); got != "EGH1\x00\x00\x00\x00\x00\x00\x00\x00" {
		t.Fatalf("empty frame = %q", got)
	}
}

func TestAppendText(t *testing.T) {
	tests := []struct {
		c     Class
		layer int
		rows  []uint64
		want  string
	}{
		{Prefill, 3, []uint64{1, math.MaxUint64}, "prefill 3 1 18446744073709551615\n"},
		{Decode, 0, nil, "decode 0\n"},
	}
	for _, tt := range tests {
		if got := string(AppendText([]byte("#\n"), tt.c, tt.layer, tt.rows)); got != "#\n"+tt.want {
			t.Errorf("AppendText(%v, %d, %v) = %q, want %q", tt.c, tt.layer, tt.rows, got, "#\n"+tt.want)
		}
	}
}

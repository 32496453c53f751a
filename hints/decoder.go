package hints

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Class says how urgently the rows of a hint are wanted.
type Class uint8

const (
	// Prefill rows are needed by a coming chunk: best effort, may be dropped.
	Prefill Class = 0
	// Decode rows are needed by this step: served before queued prefill work.
	Decode Class = 1
)

func (c Class) String() string {
	switch c {
	case Prefill:
		return "prefill"
	case Decode:
		return "decode"
	}
	return fmt.Sprintf("Class(%d)", uint8(c))
}

// Frame is one decoded hint: fetch Rows of every table of Layer. A streaming
// decoder also returns parts of frames: More says the frame continues in
// later writes, and Rows are only the rows this write completed.
type Frame struct {
	Class Class
	Layer int
	Rows  []uint64
	More  bool
}

// Validator tells the decoder which layers exist and their row counts.
type Validator interface {
	LayerRows(layer int) (rows uint64, ok bool)
}

const (
	// MaxRowsPerFrame bounds one frame, and so the memory of one handle
	// (32 MiB of rows), far above the 10K-40K rows of a prefill chunk.
	MaxRowsPerFrame = 4194304
	// MaxLayer is the largest layer either encoding can name (binary holds a u16).
	MaxLayer = 65535
)

// ErrBadFrame is wrapped by every error the decoder returns.
var ErrBadFrame = errors.New("bad hint frame")

const (
	magic     = "EGH1"
	headerLen = 12
	rowLen    = 8
	// maxToken is the digits of the largest uint64, and longer than any class name.
	maxToken = 20
	// minRows is the first allocation for the rows of a frame that arrives in pieces.
	minRows = 16
)

type frameError string

func (e frameError) Error() string { return "hint frame: " + string(e) }
func (e frameError) Unwrap() error { return ErrBadFrame }

type state uint8

// The text states come last: errorf tells text from binary by the order.
const (
	stStart   state = iota // between frames
	stHeader               // binary: d.n bytes of the header are in d.buf
	stRows                 // binary: d.n bytes of the next row are in d.buf
	stText                 // text: d.n bytes of the current token are in d.buf
	stComment              // text: after '#', up to the newline
	stCR                   // text: after '\r', which must end the line
)

// Decoder turns the byte stream of one control-file handle into frames. It is
// not safe for concurrent use: FUSE may deliver two writes of one handle at
// once, so the filesystem must serialise them (a mutex per handle).
type Decoder struct {
	v      Validator
	stream bool // hand out the rows of a partial frame at the end of every write
	st     state
	buf    [maxToken]byte // partial header, row or text token
	n      int            // bytes in buf
	field  int            // text: token index in the line: 0 class, 1 layer, then rows

	// The frame being decoded.
	class     Class
	layer     int
	layerRows uint64
	count     int // binary: rows the header announced
	got       int // rows of the frame decoded so far
	rows      []uint64
}

// NewDecoder returns a decoder that checks layers and rows against v, which must not be nil.
func NewDecoder(v Validator) *Decoder {
	return &Decoder{v: v}
}

// NewStreamDecoder is NewDecoder for a decoder that never buffers a frame:
// at the end of every write it returns the rows of a frame still incomplete
// as a part (More set), so a handle holds at most a partial row or header
// between writes, whatever the frame's size. The caller owns every Rows
// slice it returns. Rows of a frame that later turns out bad have been
// returned already; only the bad field and what follows it are refused.
func NewStreamDecoder(v Validator) *Decoder {
	return &Decoder{v: v, stream: true}
}

// Reset drops any partial frame so that the next write starts a fresh one.
func (d *Decoder) Reset() {
	*d = Decoder{v: d.v, stream: d.stream}
}

// AtFrameStart reports whether the stream is between frames: a write
// refused now (the filesystem's EAGAIN) leaves no frame half taken.
func (d *Decoder) AtFrameStart() bool { return d.st == stStart }

// Buffered reports the bytes of memory the partial frame holds.
func (d *Decoder) Buffered() int {
	return rowLen*cap(d.rows) + d.n
}

// Write consumes p and returns the valid frames that p completes, in order. If
// p holds a bad frame, Write also returns an error wrapping ErrBadFrame,
// discards the rest of p and resets the stream; frames completed before the
// bad one are still returned. The package doc says when a frame is found bad.
func (d *Decoder) Write(p []byte) ([]Frame, error) {
	var frames []Frame
	for len(p) > 0 {
		var (
			n    int
			done bool
			err  error
		)
		switch d.st {
		case stStart:
			d.st = stText
			if p[0] == magic[0] {
				d.st = stHeader
			}
			continue
		case stHeader:
			n, done, err = d.header(p)
		case stRows:
			n, done, err = d.binaryRows(p)
		default:
			n, done, err = d.text(p)
		}
		if err != nil {
			d.Reset()
			return frames, err
		}
		p = p[n:]
		if done {
			frames = append(frames, Frame{Class: d.class, Layer: d.layer, Rows: d.rows})
			d.Reset()
		}
	}
	if d.stream && len(d.rows) > 0 {
		frames = append(frames, Frame{Class: d.class, Layer: d.layer, Rows: d.rows, More: true})
		d.rows = nil
	}
	return frames, nil
}

// errorf builds a frame error, naming the encoding when it is text so a person
// typing at a shell sees which line went wrong.
func (d *Decoder) errorf(format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if d.st >= stText {
		msg = "text: " + msg
	}
	return frameError(msg)
}

func (d *Decoder) setLayer(layer int) error {
	rows, ok := d.v.LayerRows(layer)
	if !ok {
		return d.errorf("layer %d: unknown layer", layer)
	}
	d.layer, d.layerRows = layer, rows
	return nil
}

// reserve makes room for n more rows, never for more than limit rows of the
// frame in all, so capacity follows the bytes that have arrived and not a
// claimed count.
func (d *Decoder) reserve(n, limit int) {
	need := len(d.rows) + n
	if need <= cap(d.rows) {
		return
	}
	c := min(max(need, 2*cap(d.rows), minRows), limit-(d.got-len(d.rows)))
	rows := make([]uint64, len(d.rows), c)
	copy(rows, d.rows)
	d.rows = rows
}

func (d *Decoder) outOfRange(row uint64) error {
	return d.errorf("row %d out of range (layer %d has %d rows)", row, d.layer, d.layerRows)
}

// header consumes header bytes, checking each field as soon as it is complete.
func (d *Decoder) header(p []byte) (int, bool, error) {
	for i, b := range p {
		d.buf[d.n] = b
		d.n++
		switch d.n {
		case 1, 2, 3, 4:
			if b != magic[d.n-1] {
				return 0, false, d.errorf("bad magic %q", d.buf[:d.n])
			}
		case 5:
			if Class(b) != Prefill && Class(b) != Decode {
				return 0, false, d.errorf("bad class %d", b)
			}
			d.class = Class(b)
		case 6:
			if b != 0 {
				return 0, false, d.errorf("bad reserved byte %d", b)
			}
		case 8:
			if err := d.setLayer(int(binary.LittleEndian.Uint16(d.buf[6:8]))); err != nil {
				return 0, false, err
			}
		case headerLen:
			count := binary.LittleEndian.Uint32(d.buf[8:12])
			if count > MaxRowsPerFrame {
				return 0, false, d.errorf("layer %d: count %d over the limit %d", d.layer, count, MaxRowsPerFrame)
			}
			d.count, d.n = int(count), 0
			if count == 0 {
				return i + 1, true, nil
			}
			d.st = stRows
			return i + 1, false, nil
		}
	}
	return len(p), false, nil
}

// binaryRows consumes row bytes; whole rows are decoded straight from p, and
// only a row split across writes goes through d.buf.
func (d *Decoder) binaryRows(p []byte) (int, bool, error) {
	used := 0
	if d.n > 0 {
		used = copy(d.buf[d.n:rowLen], p)
		d.n += used
		if d.n < rowLen {
			return used, false, nil
		}
		d.n = 0
		row := binary.LittleEndian.Uint64(d.buf[:rowLen])
		if row >= d.layerRows {
			return 0, false, d.outOfRange(row)
		}
		d.reserve(1, d.count)
		d.rows = append(d.rows, row)
		d.got++
		if d.got == d.count {
			return used, true, nil
		}
	}
	k := min((len(p)-used)/rowLen, d.count-d.got)
	d.reserve(k, d.count)
	for range k {
		row := binary.LittleEndian.Uint64(p[used:])
		if row >= d.layerRows {
			return 0, false, d.outOfRange(row)
		}
		d.rows = append(d.rows, row)
		used += rowLen
	}
	d.got += k
	if d.got == d.count {
		return used, true, nil
	}
	// Fewer than rowLen bytes are left: keep them for the next write.
	d.n = copy(d.buf[:rowLen], p[used:])
	return len(p), false, nil
}

// text consumes one text line at most.
func (d *Decoder) text(p []byte) (int, bool, error) {
	for i, b := range p {
		switch d.st {
		case stComment:
			if b == '\n' {
				done, err := d.endLine()
				return i + 1, done, err
			}
			continue
		case stCR:
			if b != '\n' {
				return 0, false, d.errorf("carriage return not followed by newline")
			}
			done, err := d.endLine()
			return i + 1, done, err
		}
		switch b {
		case ' ', '\t':
			if err := d.endToken(); err != nil {
				return 0, false, err
			}
		case '#', '\r':
			if err := d.endToken(); err != nil {
				return 0, false, err
			}
			d.st = stComment
			if b == '\r' {
				d.st = stCR
			}
		case '\n':
			if err := d.endToken(); err != nil {
				return 0, false, err
			}
			done, err := d.endLine()
			return i + 1, done, err
		default:
			if d.n == maxToken {
				return 0, false, d.errorf("%s %q... longer than %d bytes", fieldName(d.field), d.buf[:d.n], maxToken)
			}
			d.buf[d.n] = b
			d.n++
		}
	}
	return len(p), false, nil
}

func fieldName(field int) string {
	switch field {
	case 0:
		return "class"
	case 1:
		return "layer"
	}
	return "row"
}

func (d *Decoder) endToken() error {
	if d.n == 0 {
		return nil
	}
	tok := d.buf[:d.n]
	switch d.field {
	case 0:
		switch string(tok) {
		case "prefill":
			d.class = Prefill
		case "decode":
			d.class = Decode
		default:
			return d.errorf("unknown class %q", tok)
		}
	case 1:
		layer, ok := parseDecimal(tok)
		if !ok {
			return d.errorf("bad layer %q", tok)
		}
		if layer > MaxLayer {
			return d.errorf("layer %d over the limit %d", layer, MaxLayer)
		}
		if err := d.setLayer(int(layer)); err != nil {
			return err
		}
	default:
		row, ok := parseDecimal(tok)
		if !ok {
			return d.errorf("bad row %q", tok)
		}
		if row >= d.layerRows {
			return d.outOfRange(row)
		}
		if d.got == MaxRowsPerFrame {
			return d.errorf("layer %d: more than %d rows", d.layer, MaxRowsPerFrame)
		}
		d.reserve(1, MaxRowsPerFrame)
		d.rows = append(d.rows, row)
		d.got++
	}
	d.field++
	d.n = 0
	return nil
}

// endLine ends a text line whose last token has been taken; it reports whether
// the line is a frame.
func (d *Decoder) endLine() (bool, error) {
	switch d.field {
	case 0: // blank or comment only
		d.Reset()
		return false, nil
	case 1:
		return false, d.errorf("%s: missing layer", d.class)
	}
	return true, nil
}

// parseDecimal parses unsigned decimal digits; it rejects signs, an empty
// token and values over the uint64 range.
func parseDecimal(tok []byte) (uint64, bool) {
	if len(tok) == 0 {
		return 0, false
	}
	var v uint64
	for _, c := range tok {
		if c < '0' || c > '9' {
			return 0, false
		}
		d := uint64(c - '0')
		if v > (1<<64-1-d)/10 {
			return 0, false
		}
		v = v*10 + d
	}
	return v, true
}

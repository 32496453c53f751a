package hints

// NextClass reports the class of the frame that the next write, p, continues
// or begins, without consuming p: the stream's own frame when one is begun
// and its class is decoded, else the first frame p begins (a text stream's
// blank and comment lines skipped). ok is false when the stream and p do
// not say yet (a header or class token cut short, p empty) or name no class
// (a bad frame, which Write will refuse). The filesystem asks it so that a
// full decode backlog holds back decode frames only: prefill is never
// refused.
func (d *Decoder) NextClass(p []byte) (c Class, ok bool) {
	switch {
	case d.st == stRows, d.st >= stText && d.field > 0:
		return d.class, true
	case d.st == stHeader:
		if d.n > 4 {
			return d.class, true
		}
		if i := 4 - d.n; i < len(p) {
			return classByte(p[i])
		}
		return 0, false
	case d.st == stStart:
		if len(p) == 0 {
			return 0, false
		}
		if p[0] == magic[0] {
			if len(p) > 4 {
				return classByte(p[4])
			}
			return 0, false
		}
	}
	// Text at the start of a line: the class is its first token.
	var tok []byte
	if d.st == stText {
		tok = append(tok, d.buf[:d.n]...)
	}
	comment := d.st == stComment || d.st == stCR
	for _, b := range p {
		if comment {
			comment = b != '\n'
			continue
		}
		switch b {
		case ' ', '\t', '\r', '\n', '#':
			if len(tok) > 0 {
				return classToken(tok)
			}
			comment = b == '#' || b == '\r'
		default:
			if tok = append(tok, b); len(tok) > maxToken {
				return 0, false
			}
		}
	}
	return 0, false
}

func classByte(b byte) (Class, bool) {
	c := Class(b)
	return c, c == Prefill || c == Decode
}

func classToken(tok []byte) (Class, bool) {
	switch string(tok) {
	case "prefill":
		return Prefill, true
	case "decode":
		return Decode, true
	}
	return 0, false
}

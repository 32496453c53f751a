package hints

import (
	"encoding/binary"
	"slices"
	"strconv"
)

// AppendBinary appends one binary frame to dst. The caller keeps layer within
// 0..MaxLayer and len(rows) within MaxRowsPerFrame; the decoder rejects
// anything else.
func AppendBinary(dst []byte, c Class, layer int, rows []uint64) []byte {
	n := len(dst)
	dst = slices.Grow(dst, headerLen+rowLen*len(rows))[:n+headerLen+rowLen*len(rows)]
	h := dst[n:]
	copy(h, magic)
	h[4], h[5] = byte(c), 0
	binary.LittleEndian.PutUint16(h[6:], uint16(layer))
	binary.LittleEndian.PutUint32(h[8:], uint32(len(rows)))
	b := h[headerLen:]
	for i, r := range rows {
		binary.LittleEndian.PutUint64(b[rowLen*i:], r)
	}
	return dst
}

// AppendText appends one text frame (a line ending in '\n') to dst.
func AppendText(dst []byte, c Class, layer int, rows []uint64) []byte {
	dst = append(dst, c.String()...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, int64(layer), 10)
	for _, r := range rows {
		dst = append(dst, ' ')
		dst = strconv.AppendUint(dst, r, 10)
	}
	return append(dst, '\n')
}

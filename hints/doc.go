// Package hints decodes the hint stream that clients write to .engramfs/control.
//
// A hint names a layer and row ids of that layer. Each open handle of the control
// file carries its own stream of frames; a frame may span several writes and a
// write may hold several frames. Two encodings may be mixed, frame by frame:
//
//	text:   prefill|decode <layer> <row> [<row> ...]\n
//	binary: "EGH1" · class u8 · reserved u8 = 0 · layer u16 · count u32 · count × row u64
//
// Binary is little-endian; class 0 is prefill, 1 is decode. A frame whose first
// byte is 'E' is binary, anything else is text: no text line can start with 'E'
// because the only classes are "prefill" and "decode". In text, fields are
// separated by spaces or tabs, layer and rows are decimal, '#' starts a comment
// that runs to the end of the line, blank and comment-only lines are skipped,
// and a line may end in "\r\n". A text frame completes at its newline; a line
// with a class and a layer but no rows is a valid frame with no rows, as is a
// binary frame with count 0.
//
// # Limits
//
// A handle's memory is bounded and never sized by a count it has not checked:
// one frame names at most [MaxRowsPerFrame] rows, a text token is at most 20
// bytes (the digits of the largest uint64), and the rows of a frame are stored
// only as their bytes arrive. A handle therefore holds at most
// 8*MaxRowsPerFrame bytes of rows plus 20 bytes of partial header or token. Both
// encodings name layers 0..[MaxLayer].
//
// # Errors
//
// A frame is bad if its magic, class, reserved byte, layer or count is wrong, a
// row is not below the layer's row count (as the [Validator] reports it), a
// text token is malformed or too long, or a text line names a class but no
// layer. The decoder checks each field as soon as its last byte arrives, so a
// frame fails on the write that delivers its first bad field, not necessarily
// on the write that would have completed it: a binary header fails on the byte
// that makes it wrong, a row (binary or text) fails when it is complete and out
// of range, and a text line with too many rows fails on the first row over the
// limit. That write returns an error wrapping [ErrBadFrame], along with the
// valid frames it completed before the bad one; the rest of the write is
// discarded and the stream restarts, so the next write begins a fresh frame.
// The filesystem fails that write with EINVAL, which carries no text, and
// keeps the error's text for the handle's next barrier: [Status.Error] says
// why, as does the error of the clients' call that sent the frame.
//
// # The step
//
// A decode step's frames and its barrier can go in one ioctl(2) on the
// handle instead of a write per frame and a read: [StepCmd], whose buffer
// ([StepBuffer]) carries the frames going in and the barrier's status line
// coming back ([StepStatus]).
package hints

"""Send engramfs hints from Python (standard library only).

    from engramfs_hints import Hinter

    with Hinter('/mnt/engram') as h:
        h.prefill(layer, rows)  # rows a coming chunk will need: best effort
        h.decode(layer, rows)   # rows this step needs: served first
        h.wait()                # fsync: returns once every hint so far is
                                # resident; OSError (EIO) if one failed

rows is an iterable of non-negative ints below 2**64, or a numpy integer
array. Each call sends binary frames to <mount>/.engramfs/control, one
write(2) per frame, little-endian:

    b"EGH1" . class u8 (0 prefill, 1 decode) . reserved u8 = 0 . layer u16
    . count u32 . count x row u64

A frame holds at most MAX_ROWS_PER_FRAME rows; longer row lists are split.
"""

import os
import struct
import sys
from array import array

MAX_ROWS_PER_FRAME = 4194304
MAX_LAYER = 65535
PREFILL = 0
DECODE = 1

_HEADER = struct.Struct('<4sBBHI')
_MAGIC = b'EGH1'
_ROW = 8
_CLASS_NAMES = {PREFILL: 'prefill', DECODE: 'decode'}


def _row_bytes(rows):
    """Return rows as little-endian u64 bytes."""
    # numpy is never imported here: if rows is an ndarray, numpy is loaded.
    np = sys.modules.get('numpy')
    if np is not None and isinstance(rows, np.ndarray):
        if rows.dtype.kind not in 'ui':
            raise TypeError('rows must be integers, not %s' % rows.dtype)
        # astype would wrap a negative row to a huge valid-looking one.
        if rows.dtype.kind == 'i' and rows.size and rows.min() < 0:
            raise ValueError('rows must be non-negative')
        return rows.astype('<u8', copy=False).tobytes()
    a = array('Q', rows)  # raises OverflowError on a negative or huge row
    if sys.byteorder != 'little':
        a.byteswap()
    return a.tobytes()


class Hinter:
    """One handle of a mount's control file; hints on it form one stream."""

    def __init__(self, mount):
        self.path = os.path.join(os.fspath(mount), '.engramfs', 'control')
        # No O_TRUNC: the control file is not a regular file to truncate.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)

    def prefill(self, layer, rows):
        """Ask for rows of layer that a coming chunk will need."""
        self._send(PREFILL, layer, rows)

    def decode(self, layer, rows):
        """Ask for rows of layer that this step needs."""
        self._send(DECODE, layer, rows)

    def wait(self):
        """Return once every hint sent so far is resident, or raise OSError."""
        self._check_open()
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise OSError(e.errno, 'hint wait: %s' % e.strerror, self.path) from e

    def close(self):
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._fd is None:
            raise ValueError('hinter for %s is closed' % self.path)

    def _send(self, cls, layer, rows):
        self._check_open()
        what = 'hint %s layer %s' % (_CLASS_NAMES[cls], layer)
        # The frame holds a u16: a larger layer would silently name another one.
        if not isinstance(layer, int) or not 0 <= layer <= MAX_LAYER:
            raise ValueError('%s: layer out of range 0..%d' % (what, MAX_LAYER))
        data = memoryview(_row_bytes(rows))
        step = _ROW * MAX_ROWS_PER_FRAME
        for start in range(0, len(data), step):
            chunk = data[start:start + step]
            frame = _HEADER.pack(_MAGIC, cls, 0, layer, len(chunk) // _ROW) + chunk
            try:
                self._write_all(frame)
            except OSError as e:
                raise OSError(e.errno, '%s: %s' % (what, e.strerror), self.path) from e

    def _write_all(self, buf):
        view = memoryview(buf)
        while view:
            view = view[os.write(self._fd, view):]

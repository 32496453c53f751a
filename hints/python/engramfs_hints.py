"""Send engramfs hints from Python (standard library only; numpy and torch
are used when given, never imported here).

    from engramfs_hints import Hinter

    with Hinter('/mnt/engram') as h:
        h.prefill(layer, rows)  # rows a coming chunk will need: best effort
        h.decode(layer, rows)   # rows this step needs: served first, never dropped
        st = h.wait()           # read barrier: returns once every hint sent
                                # so far on this handle has settled, with
                                # {'frames', 'pages', 'resident', 'pinned',
                                #  'dropped', 'failed'} since the last wait;
                                # raises HintFailed if failed > 0

rows is an iterable of non-negative ints below 2**64, or anything with the
buffer protocol holding integers (a numpy array, array.array, a torch tensor
on any device). Each frame goes to <mount>/.engramfs/control in one writev(2)
(header and rows, no copy of the rows when they are already little-endian
u64), little-endian:

    b"EGH1" . class u8 (0 prefill, 1 decode) . reserved u8 = 0 . layer u16
    . count u32 . count x row u64

A frame holds at most MAX_ROWS_PER_FRAME rows; longer row lists are split.

The barrier is read(2) on the handle: it blocks only this handle, never
another rank's. (os.fsync on the handle also waits, but the kernel then
holds the control file's lock and every other rank's hints wait behind it.)

A frame the filesystem rejects (a row out of range, an unknown layer) fails
its write with EINVAL, which carries no text: prefill() or decode() then
reads the barrier, whose status line says why, and raises HintRejected (an
OSError, EINVAL) with the reason ("row 99999 out of range (layer 0 has 16384
rows)"); the counts that barrier read are kept for the next wait().

A Hinter is safe to use from several threads, and after fork: a child
process opens its own handle on first use (a handle shared across processes
would mix their frames and their barriers).
"""

import errno
import json
import operator
import os
import struct
import sys
import threading
import time
import weakref
from array import array

MAX_ROWS_PER_FRAME = 4194304
MAX_LAYER = 65535
PREFILL = 0
DECODE = 1

_HEADER = struct.Struct('<4sBBHI')
_MAGIC = b'EGH1'
_ROW = 8
_CLASS_NAMES = {PREFILL: 'prefill', DECODE: 'decode'}
_STATUS_BYTES = 4096
# EAGAIN: this handle has more decode work queued than the daemon holds for
# one handle; nothing of the frame was taken, so it is sent again.
_EAGAIN_SLEEP_MAX = 0.01
_EAGAIN_TIMEOUT = 60.0

__all__ = ['Hinter', 'HintFailed', 'HintRejected', 'MAX_ROWS_PER_FRAME', 'MAX_LAYER', 'PREFILL', 'DECODE']


class HintFailed(OSError):
    """Pages failed since the previous barrier; .status has the counts and,
    in status['error'], why the first failed."""

    def __init__(self, status, path):
        msg = 'hint wait: %d of %d pages failed' % (status['failed'], status['pages'])
        if status.get('error'):
            msg += ' (%s)' % status['error']
        super().__init__(errno.EIO, msg, path)
        self.status = status


class HintRejected(OSError):
    """The filesystem rejected a frame (its write failed with EINVAL);
    .reason is why, from the barrier's status line ('' from a daemon that
    does not say)."""

    def __init__(self, what, reason, path):
        msg = '%s: rejected by the mount' % what
        if reason:
            msg += ': ' + reason
        super().__init__(errno.EINVAL, msg, path)
        self.reason = reason


def _empty_status():
    return {'frames': 0, 'pages': 0, 'resident': 0, 'pinned': 0, 'dropped': 0, 'failed': 0}


def _add_status(into, status):
    """Add status's counts to into (every count, those a later daemon adds
    too); keep into's error, or take status's."""
    for k, v in status.items():
        if k == 'error':
            into.setdefault('error', v)
        elif isinstance(v, int):
            into[k] = into.get(k, 0) + v


def _as_u64(rows):
    """Return rows as a buffer of little-endian u64 (a memoryview when no
    conversion is needed)."""
    mod = type(rows).__module__
    if mod.startswith('torch'):
        rows = rows.detach().to('cpu').contiguous().numpy()
        mod = 'numpy'
    np = sys.modules.get('numpy')
    if np is not None and isinstance(rows, np.ndarray):
        if rows.dtype.kind not in 'ui':
            raise TypeError('rows must be integers, not %s' % rows.dtype)
        # astype would wrap a negative row to a huge valid-looking one.
        if rows.dtype.kind == 'i' and rows.size and rows.min() < 0:
            raise ValueError('rows must be non-negative')
        rows = np.ascontiguousarray(rows.reshape(-1), dtype='<u8')
        return memoryview(rows).cast('B')
    try:
        mv = memoryview(rows)
    except TypeError:
        mv = None
    if mv is not None:
        fmt = mv.format.lstrip('@=<')
        if fmt not in ('b', 'B', 'h', 'H', 'i', 'I', 'l', 'L', 'q', 'Q', 'n', 'N'):
            raise TypeError('rows must be integers, not format %r' % mv.format)
        if fmt in ('Q', 'L', 'N') and mv.itemsize == 8 and sys.byteorder == 'little' and mv.c_contiguous:
            return mv.cast('B')
        rows = mv.tolist()
    a = array('Q', rows)  # raises OverflowError on a negative or huge row
    if sys.byteorder != 'little':
        a.byteswap()
    return memoryview(a).cast('B')


_LIVE = weakref.WeakSet()


def _after_fork_in_child():
    for h in list(_LIVE):
        h._lock = threading.Lock()


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Hinter:
    """One handle of a mount's control file; hints on it form one stream."""

    def __init__(self, mount):
        self.path = os.path.join(os.fspath(mount), '.engramfs', 'control')
        self._lock = threading.Lock()
        self._fd = None
        self._pid = None
        self._carried = None  # counts read after a rejected frame: the next wait's
        self._open()
        _LIVE.add(self)

    def _open(self):
        # No O_TRUNC: the control file is not a regular file to truncate.
        # O_RDWR: reading the handle is the barrier.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self._pid = os.getpid()
        self._carried = None

    def _handle(self):
        """The fd of this process's own handle, opened again after a fork."""
        if self._fd is None:
            raise ValueError('hinter for %s is closed' % self.path)
        if self._pid != os.getpid():
            # The parent's handle stays the parent's: drop our copy of it.
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
            self._open()
        return self._fd

    def prefill(self, layer, rows):
        """Ask for rows of layer that a coming chunk will need (best effort)."""
        self._send(PREFILL, layer, rows)

    def decode(self, layer, rows):
        """Ask for rows of layer that this step needs (served first)."""
        self._send(DECODE, layer, rows)

    def wait(self):
        """Return once every hint sent so far on this handle has settled: a
        dict of counts since the previous wait. Raises HintFailed (an
        OSError, EIO) if pages failed, HintRejected if a frame was rejected
        that no call has reported (another thread's writes on the handle);
        either says why."""
        with self._lock:
            fd = self._handle()
            try:
                status = self._read_status(fd)
            except OSError as e:
                raise OSError(e.errno, 'hint wait: %s' % e.strerror, self.path) from e
            if self._carried is not None:
                _add_status(self._carried, status)
                status, self._carried = self._carried, None
        if status.get('failed', 0) > 0:
            raise HintFailed(status, self.path)
        if status.get('error'):
            raise HintRejected('hint wait', status['error'], self.path)
        return status

    @staticmethod
    def _read_status(fd):
        """One barrier read: the status dict (all zero when nothing was sent
        since the previous barrier)."""
        line = os.read(fd, _STATUS_BYTES)  # EINTR is retried (PEP 475)
        return json.loads(line) if line else _empty_status()

    def _why_rejected(self, fd, what, err):
        """The HintRejected for a frame whose write failed with EINVAL: the
        errno carries no text, the barrier's status line says why. The
        barrier's counts are kept for the next wait()."""
        try:
            status = self._read_status(fd)
        except OSError:
            return OSError(err.errno, '%s: %s' % (what, err.strerror), self.path)
        reason = status.pop('error', '')
        if status.get('failed', 0) > 0 and reason:
            status['error'] = reason  # the failed pages' reason is the next wait's too
        if self._carried is None:
            self._carried = _empty_status()
        _add_status(self._carried, status)
        return HintRejected(what, reason, self.path)

    def close(self):
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                if self._pid == os.getpid():
                    os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, cls, layer, rows):
        what = 'hint %s layer %s' % (_CLASS_NAMES[cls], layer)
        try:
            layer = operator.index(layer)  # numpy integers too, never floats
        except TypeError:
            raise ValueError('%s: layer must be an integer' % what) from None
        # The frame holds a u16: a larger layer would silently name another one.
        if not 0 <= layer <= MAX_LAYER:
            raise ValueError('%s: layer out of range 0..%d' % (what, MAX_LAYER))
        data = _as_u64(rows)
        step = _ROW * MAX_ROWS_PER_FRAME
        with self._lock:
            fd = self._handle()
            for start in range(0, len(data), step):
                chunk = data[start:start + step]
                header = _HEADER.pack(_MAGIC, cls, 0, layer, len(chunk) // _ROW)
                try:
                    self._write_frame(fd, header, chunk)
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        raise self._why_rejected(fd, what, e) from e
                    raise OSError(e.errno, '%s: %s' % (what, e.strerror), self.path) from e

    def _write_frame(self, fd, header, rows):
        want = len(header) + len(rows)
        sleep, deadline = 0.00005, None
        while True:
            try:
                n = os.writev(fd, [header, rows])  # EINTR is retried (PEP 475)
            except BlockingIOError:
                # The handle's decode backlog is full: nothing was taken.
                if deadline is None:
                    deadline = time.monotonic() + _EAGAIN_TIMEOUT
                elif time.monotonic() > deadline:
                    raise
                time.sleep(sleep)
                sleep = min(2 * sleep, _EAGAIN_SLEEP_MAX)
                continue
            if n != want:
                # The daemon refused part of the frame (a bad row: the
                # stream was reset). Sending the rest would start a new
                # stream in the middle of a frame.
                raise OSError(errno.EIO, 'short write: %d of %d bytes of a frame taken' % (n, want))
            return

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
        st = h.step([(layer, rows), ...])  # a decode step: decode() for each
                                # layer and wait(), in one request

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

step() sends a decode step's frames and waits for them in one ioctl(2) on
the handle (one request to the daemon where a write a frame and the barrier
read make one each; a step whose pages are all resident costs little more
than that request). The ioctl's buffer is the frames' length (u32), the
frames, then room for the status line, which comes back in the same buffer
after its length (u32); at most 16383 bytes, so a step of more than ~2,000
rows, or a daemon without the ioctl (ENOTTY), goes as decode() calls and a
wait().

A Hinter is safe to use from several threads, and after fork: a child
process opens its own handle on first use (a handle shared across processes
would mix their frames and their barriers).
"""

import errno
import fcntl
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
# The step ioctl: _IOWR(0xE6, 1, size), size = the whole buffer.
_STEP_TYPE = 0xE6
_STEP_NR = 1
_STEP_MAX_BYTES = (1 << 14) - 1
_STEP_MIN_BYTES = 4 + 256
_U32 = struct.Struct('<I')
# EAGAIN: this handle has more decode work queued than the daemon holds for
# one handle; nothing of the frame was taken, so it is sent again.
_EAGAIN_SLEEP_MAX = 0.01
_EAGAIN_TIMEOUT = 60.0



def _step_cmd(size):
    return (3 << 30) | (size << 16) | (_STEP_TYPE << 8) | _STEP_NR


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


# Errors of a handle the daemon no longer knows, while the mount may: the
# handle is reopened once.
_STALE = (errno.EBADF, errno.ESTALE, errno.ENOTCONN)

_LIVE = weakref.WeakSet()


def _until_taken(call):
    """call() until the daemon takes what it sends: again after EAGAIN (the
    handle's decode backlog is full; nothing was taken), backing off, for
    at most _EAGAIN_TIMEOUT. Returns what call() returns."""
    sleep, deadline = 0.00005, None
    while True:
        try:
            return call()
        except BlockingIOError:
            if deadline is None:
                deadline = time.monotonic() + _EAGAIN_TIMEOUT
            elif time.monotonic() > deadline:
                raise
            time.sleep(sleep)
            sleep = min(2 * sleep, _EAGAIN_SLEEP_MAX)


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
        self._no_step = False  # the daemon answered the step's ioctl ENOTTY
        self._open()
        _LIVE.add(self)

    def _open(self):
        # No O_TRUNC: the control file is not a regular file to truncate.
        # O_RDWR: reading the handle is the barrier.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self._pid = os.getpid()
        self._carried = None

    def _reopen(self):
        """Replace this process's descriptor with a new handle: after a fork
        (the parent's handle stays the parent's), or when the daemon no
        longer knows the handle (EBADF: a successor that took the mount over
        without it; ESTALE; ENOTCONN: a dead mount, remounted since). Frames
        sent on the old handle are not waited for by the new one's barrier."""
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = None
        self._open()
        return self._fd

    def _handle(self):
        """The fd of this process's own handle, opened again after a fork."""
        if self._fd is None:
            raise ValueError('hinter for %s is closed' % self.path)
        if self._pid != os.getpid():
            return self._reopen()
        return self._fd

    def prefill(self, layer, rows):
        """Ask for rows of layer that a coming chunk will need (best effort)."""
        self._send(PREFILL, layer, rows)

    def decode(self, layer, rows):
        """Ask for rows of layer that this step needs (served first)."""
        self._send(DECODE, layer, rows)

    def step(self, layer_rows):
        """This step's rows as decode hints, [(layer, rows), ...], and the
        wait for them, in one ioctl(2): returns and raises as wait() does.
        A step too large for the ioctl, or a daemon without it, is sent as
        decode() calls and a wait()."""
        layer_rows = list(layer_rows)
        frames = []
        for layer, rows in layer_rows:
            layer = self._layer('hint step layer %s' % (layer,), layer)
            data = _as_u64(rows)
            frames.append(_HEADER.pack(_MAGIC, DECODE, 0, layer, len(data) // _ROW))
            frames.append(data)
        size = 4 + sum(len(f) for f in frames)
        if self._no_step or size > _STEP_MAX_BYTES:
            return self._step_as_writes(layer_rows)
        buf = bytearray(max(size, _STEP_MIN_BYTES))
        _U32.pack_into(buf, 0, size - 4)
        at = 4
        for f in frames:
            buf[at:at + len(f)] = f
            at += len(f)
        with self._lock:
            fd = self._handle()
            try:
                try:
                    self._ioctl_step(fd, buf)
                except OSError as e:
                    if e.errno not in _STALE:
                        raise
                    # Nothing was taken: send it on a new handle.
                    fd = self._reopen()
                    self._ioctl_step(fd, buf)
            except OSError as e:
                if e.errno == errno.ENOTTY:
                    self._no_step = True
                    status = None
                elif e.errno == errno.EINVAL:
                    raise self._why_rejected(fd, 'hint step', e) from e
                else:
                    raise OSError(e.errno, 'hint step: %s' % e.strerror, self.path) from e
            else:
                (n,) = _U32.unpack_from(buf, 0)
                status = json.loads(bytes(buf[4:4 + n]))
                if self._carried is not None:
                    _add_status(self._carried, status)
                    status, self._carried = self._carried, None
        if status is None:
            return self._step_as_writes(layer_rows)
        return self._conclude(status)

    def _step_as_writes(self, layer_rows):
        for layer, rows in layer_rows:
            self.decode(layer, rows)
        return self.wait()

    @staticmethod
    def _ioctl_step(fd, buf):
        def call():
            while True:
                try:
                    return fcntl.ioctl(fd, _step_cmd(len(buf)), buf, True)
                except InterruptedError:
                    # The frames were taken; naming them again is harmless.
                    continue
        _until_taken(call)

    def _conclude(self, status):
        if status.get('failed', 0) > 0:
            raise HintFailed(status, self.path)
        if status.get('error'):
            raise HintRejected('hint wait', status['error'], self.path)
        return status

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
                if e.errno not in _STALE:
                    raise OSError(e.errno, 'hint wait: %s' % e.strerror, self.path) from e
                try:
                    self._reopen()
                except OSError as e2:
                    raise OSError(e.errno, 'hint wait: %s (reopen: %s)' % (e.strerror, e2.strerror), self.path) from e
                status = _empty_status()  # nothing to wait for on the new handle
            if self._carried is not None:
                _add_status(self._carried, status)
                status, self._carried = self._carried, None
        return self._conclude(status)

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

    @staticmethod
    def _layer(what, layer):
        try:
            layer = operator.index(layer)  # numpy integers too, never floats
        except TypeError:
            raise ValueError('%s: layer must be an integer' % what) from None
        # The frame holds a u16: a larger layer would silently name another one.
        if not 0 <= layer <= MAX_LAYER:
            raise ValueError('%s: layer out of range 0..%d' % (what, MAX_LAYER))
        return layer

    def _send(self, cls, layer, rows):
        what = 'hint %s layer %s' % (_CLASS_NAMES[cls], layer)
        layer = self._layer(what, layer)
        data = _as_u64(rows)
        step = _ROW * MAX_ROWS_PER_FRAME
        with self._lock:
            fd = self._handle()
            for start in range(0, len(data), step):
                chunk = data[start:start + step]
                header = _HEADER.pack(_MAGIC, cls, 0, layer, len(chunk) // _ROW)
                try:
                    try:
                        self._write_frame(fd, header, chunk)
                    except OSError as e:
                        if e.errno not in _STALE:
                            raise
                        # Nothing of the frame was taken: send it on a new handle.
                        fd = self._reopen()
                        self._write_frame(fd, header, chunk)
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        raise self._why_rejected(fd, what, e) from e
                    raise OSError(e.errno, '%s: %s' % (what, e.strerror), self.path) from e

    def _write_frame(self, fd, header, rows):
        want = len(header) + len(rows)
        n = _until_taken(lambda: os.writev(fd, [header, rows]))  # EINTR is retried (PEP 475)
        if n != want:
            # The daemon refused part of the frame (a bad row: the stream
            # was reset). Sending the rest would start a new stream in the
            # middle of a frame.
            raise OSError(errno.EIO, 'short write: %d of %d bytes of a frame taken' % (n, want))

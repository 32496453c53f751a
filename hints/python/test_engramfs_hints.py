"""Checks the bytes engramfs_hints writes against the binary frame layout.

A temp directory with a regular .engramfs/control file stands in for a mount.
Run: python3 -m unittest (from this directory).
"""

import errno
import os
import sys
import tempfile
import unittest
from array import array
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engramfs_hints as eh  # noqa: E402

real_writev = os.writev

try:
    import numpy
except ImportError:
    numpy = None


def frame(cls, layer, rows):
    """The layout spelled out byte by byte, independent of the module's struct."""
    out = b'EGH1' + bytes([cls, 0]) + layer.to_bytes(2, 'little') + len(rows).to_bytes(4, 'little')
    for r in rows:
        out += r.to_bytes(8, 'little')
    return out


class HinterTest(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.mount = tmp.name
        os.mkdir(os.path.join(self.mount, '.engramfs'))
        self.control = os.path.join(self.mount, '.engramfs', 'control')
        open(self.control, 'wb').close()

    def written(self):
        with open(self.control, 'rb') as f:
            return f.read()

    def test_layout_literal(self):
        with eh.Hinter(self.mount) as h:
            h.prefill(3, [1, 0x0102030405060708])
            h.decode(0x0203, [2**64 - 1])
        self.assertEqual(self.written(),
                         b'EGH1\x00\x00\x03\x00\x02\x00\x00\x00'
                         b'\x01\x00\x00\x00\x00\x00\x00\x00'
                         b'\x08\x07\x06\x05\x04\x03\x02\x01'
                         b'EGH1\x01\x00\x03\x02\x01\x00\x00\x00'
                         b'\xff\xff\xff\xff\xff\xff\xff\xff')

    def test_step_falls_back_to_writes(self):
        # A regular file has no step ioctl (ENOTTY): the frames are written.
        with eh.Hinter(self.mount) as h:
            st = h.step(iter([(0, [1, 2]), (7, [2**40])]))
            self.assertEqual(st['failed'], 0)
            h.step([(0, [3])])
        self.assertEqual(self.written(), frame(1, 0, [1, 2]) + frame(1, 7, [2**40]) + frame(1, 0, [3]))

    def test_step_command(self):
        # _IOWR(0xE6, 1, 260), as <asm-generic/ioctl.h> spells it.
        self.assertEqual(eh._step_cmd(260), 0xC104E601)

    def test_row_containers(self):
        with eh.Hinter(self.mount) as h:
            h.decode(1, (5, 6))
            h.decode(1, range(3))
            h.prefill(2, array('L', [7, 8]))
            h.prefill(2, iter([9]))
        self.assertEqual(self.written(),
                         frame(1, 1, [5, 6]) + frame(1, 1, [0, 1, 2]) +
                         frame(0, 2, [7, 8]) + frame(0, 2, [9]))

    def test_empty_rows_send_nothing(self):
        with eh.Hinter(self.mount) as h:
            h.prefill(0, [])
        self.assertEqual(self.written(), b'')

    def test_split_into_frames_one_write_each(self):
        with mock.patch.object(eh, 'MAX_ROWS_PER_FRAME', 3), \
                mock.patch.object(eh.os, 'writev', wraps=os.writev) as writev, \
                eh.Hinter(self.mount) as h:
            h.prefill(4, range(7))
        self.assertEqual(writev.call_count, 3)
        self.assertEqual(self.written(),
                         frame(0, 4, [0, 1, 2]) + frame(0, 4, [3, 4, 5]) + frame(0, 4, [6]))

    @unittest.skipIf(numpy is None, 'numpy is not installed')
    def test_numpy(self):
        with eh.Hinter(self.mount) as h:
            h.decode(5, numpy.array([3, 2**40], dtype=numpy.uint64))
            h.decode(5, numpy.array([1, 2], dtype='>i4'))  # converted, not reinterpreted
            h.prefill(6, numpy.arange(4, dtype=numpy.int64).reshape(2, 2))
            h.prefill(6, numpy.array([], dtype=numpy.uint64))
            with self.assertRaises(ValueError):
                h.decode(5, numpy.array([1, -1]))
            with self.assertRaises(TypeError):
                h.decode(5, numpy.array([1.5]))
        self.assertEqual(self.written(),
                         frame(1, 5, [3, 2**40]) + frame(1, 5, [1, 2]) + frame(0, 6, [0, 1, 2, 3]))

    def test_bad_arguments_write_nothing(self):
        with eh.Hinter(self.mount) as h:
            for layer in (-1, 65536, 1.0):
                with self.assertRaisesRegex(ValueError, 'layer out of range|layer must be an integer'):
                    h.decode(layer, [1])
            with self.assertRaises(OverflowError):
                h.decode(0, [-1])
            with self.assertRaises(OverflowError):
                h.decode(0, [2**64])
        self.assertEqual(self.written(), b'')

    def test_wait_close(self):
        h = eh.Hinter(self.mount)
        h.decode(0, [1])
        h.wait()
        h.close()
        h.close()
        with self.assertRaisesRegex(ValueError, 'closed'):
            h.decode(0, [1])
        with self.assertRaisesRegex(ValueError, 'closed'):
            h.wait()

    def test_short_write_is_an_error(self):
        with mock.patch.object(eh.os, 'writev', side_effect=lambda fd, bufs: 5), \
                eh.Hinter(self.mount) as h:
            with self.assertRaisesRegex(OSError, 'short write') as cm:
                h.decode(0, [1, 2])
        self.assertEqual(cm.exception.errno, errno.EIO)

    def test_eagain_sends_the_frame_again(self):
        calls = []

        def writev(fd, bufs):
            calls.append(b''.join(bytes(b) for b in bufs))
            if len(calls) < 3:
                raise BlockingIOError(errno.EAGAIN, 'full')
            return real_writev(fd, bufs)
        with mock.patch.object(eh.os, 'writev', side_effect=writev), eh.Hinter(self.mount) as h:
            h.decode(2, [7])
        self.assertEqual(calls, [frame(1, 2, [7])] * 3)
        self.assertEqual(self.written(), frame(1, 2, [7]))

    def test_one_writev_per_frame_no_copy_of_u64_rows(self):
        rows = array('Q', [1, 2, 3])
        seen = []

        def writev(fd, bufs):
            seen.append(bufs)
            return real_writev(fd, bufs)
        with mock.patch.object(eh.os, 'writev', side_effect=writev), eh.Hinter(self.mount) as h:
            h.prefill(1, rows)
        self.assertEqual(len(seen), 1)
        self.assertEqual(seen[0][1].obj, rows)  # a view of the caller's rows
        self.assertEqual(self.written(), frame(0, 1, [1, 2, 3]))

    @unittest.skipIf(numpy is None, 'numpy is not installed')
    def test_numpy_integer_layer(self):
        with eh.Hinter(self.mount) as h:
            h.decode(numpy.int64(3), numpy.array([4], dtype=numpy.int32))
        self.assertEqual(self.written(), frame(1, 3, [4]))

    def test_wait_returns_the_status_line(self):
        with eh.Hinter(self.mount) as h:
            self.assertEqual(h.wait()['pages'], 0)  # nothing to read: idle
            line = b'{"frames":1,"pages":4,"resident":3,"pinned":1,"dropped":0,"failed":0}\n'
            with mock.patch.object(eh.os, 'read', return_value=line):
                self.assertEqual(h.wait()['resident'], 3)
            with mock.patch.object(eh.os, 'read', return_value=line.replace(b'"failed":0', b'"failed":2')):
                with self.assertRaises(eh.HintFailed) as cm:
                    h.wait()
            self.assertEqual(cm.exception.errno, errno.EIO)
            self.assertEqual(cm.exception.status['failed'], 2)

    def test_rejected_frame_says_why(self):
        reason = 'hint frame: row 99999 out of range (layer 0 has 16384 rows)'
        line = ('{"frames":1,"pages":4,"resident":4,"pinned":0,"dropped":0,"failed":0,"error":"%s"}\n' % reason).encode()

        def einval(fd, bufs):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        with eh.Hinter(self.mount) as h:
            with mock.patch.object(eh.os, 'writev', side_effect=einval), \
                    mock.patch.object(eh.os, 'read', return_value=line):
                with self.assertRaises(eh.HintRejected) as cm:
                    h.decode(0, [99999])
            self.assertEqual(cm.exception.errno, errno.EINVAL)
            self.assertEqual(cm.exception.reason, reason)
            self.assertEqual(str(cm.exception),
                             '[Errno 22] hint decode layer 0: rejected by the mount: %s: %r' % (reason, self.control))
            # The counts that barrier read belong to the next wait; the
            # reason was said once.
            self.assertEqual(h.wait(), {'frames': 1, 'pages': 4, 'resident': 4, 'pinned': 0, 'dropped': 0, 'failed': 0})
            self.assertEqual(h.wait()['frames'], 0)

            # A reason no call reported (another thread's frame) is raised by wait.
            with mock.patch.object(eh.os, 'read', return_value=line):
                with self.assertRaises(eh.HintRejected) as cm:
                    h.wait()
            self.assertEqual(cm.exception.reason, reason)

            # Failed pages say why.
            failed = line.replace(b'"failed":0', b'"failed":2').replace(reason.encode(), b'pages failed: table t: EIO')
            with mock.patch.object(eh.os, 'read', return_value=failed):
                with self.assertRaises(eh.HintFailed) as cm:
                    h.wait()
            self.assertIn('2 of 4 pages failed (pages failed: table t: EIO)', str(cm.exception))

    @unittest.skipUnless(hasattr(os, 'fork'), 'needs fork')
    def test_child_opens_its_own_handle(self):
        h = eh.Hinter(self.mount)
        parent_fd = h._fd
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                h.decode(0, [1])
                os.write(w, b'%d' % (h._pid == os.getpid()))
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.read(r, 10), b'1')
        os.close(r)
        self.assertEqual(h._fd, parent_fd)
        h.decode(0, [2])  # the parent's handle still works
        h.close()

    def test_missing_control(self):
        with tempfile.TemporaryDirectory() as empty:
            with self.assertRaises(FileNotFoundError):
                eh.Hinter(empty)

    @unittest.skipUnless(os.path.exists('/dev/full'), 'needs /dev/full')
    def test_write_error_has_context(self):
        os.remove(self.control)
        os.symlink('/dev/full', self.control)
        with eh.Hinter(self.mount) as h:
            with self.assertRaises(OSError) as cm:
                h.decode(3, [1])
        self.assertEqual(cm.exception.errno, errno.ENOSPC)
        self.assertIn('hint decode layer 3', str(cm.exception))
        self.assertEqual(cm.exception.filename, self.control)

    def test_reopens_a_stale_handle(self):
        # A write on a read-only descriptor, or a read on a write-only one,
        # fails with EBADF as a handle the daemon no longer knows does (a
        # successor that took the mount over without it): reopened once.
        with eh.Hinter(self.mount) as h:
            os.close(h._fd)
            h._fd = os.open(self.control, os.O_RDONLY)
            h.decode(3, [7])
            self.assertEqual(self.written(), frame(1, 3, [7]))
            os.close(h._fd)
            h._fd = os.open(self.control, os.O_WRONLY)
            self.assertEqual(h.wait()['pages'], 0)
            h.prefill(1, [2])  # the new handle works
        # (A regular file: the new handle writes from offset 0.)
        self.assertTrue(self.written().startswith(frame(0, 1, [2])))


if __name__ == '__main__':
    unittest.main()

"""engramfs for the DeepSeek-V4.1 engram DISK path (vLLM): the tables read
from an engramfs mount, the hash-ahead and the decode gather turned into
hints. Copy this file beside models/deepseek_v4_1/common/engram.py and apply
engram-engramfs.diff (README.md says how); engram.py then calls:

    # module top
    _KAI_ENGRAMFS = _kai_engramfs.enabled()    # DSV41_ENGRAM_PREFETCH_MODE=engramfs

    # DiskTable.__init__, once the shard offsets are known, before the maps
    self.engramfs = _kai_engramfs.retarget(self, model_dir, layer_id)

    # _hash_ahead (stage 8), instead of the pool of _kai_prefetch_rows tasks
    table.engramfs.prefill(rows)                # rank-local rows: returns at once

    # stage(), before gather_dequant_many(requests)
    _kai_engramfs.decode_and_wait(requests)     # decode-sized steps: [(table, rel, owned)]
    _kai_engramfs.wait_prefill(requests)        # prefill chunks: their hash-ahead landed

retarget moves a table's descriptors, offsets and paths from the shard to
the mount's table file (layers/L/weight.safetensors: the same bytes as the
shard's tensor, at the offset its safetensors header gives), so the gather,
stage 6's memory map and v3's WILLNEED all read the file the hints fill.
The mount is DSV41_ENGRAMFS_MOUNT, else model_dir when it is an engramfs
mount itself.

Nothing here imports vLLM or torch: rows may be lists, numpy arrays or
torch tensors (the client takes them through the buffer protocol).
"""

import json
import os
import struct
import sys
import threading

try:
    import engramfs_hints  # pip install <engramfs>/hints/python
except ImportError:  # a checkout: the client two directories up
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'hints', 'python'))
    import engramfs_hints

MODE_ENV = 'DSV41_ENGRAM_PREFETCH_MODE'
MOUNT_ENV = 'DSV41_ENGRAMFS_MOUNT'

_lock = threading.Lock()
_hints = {}  # mount -> Hints, per process (engramfs_hints reopens after fork)
_indexes = {}  # mount -> its weight_map


def enabled():
    """True when the engine reads and hints through engramfs."""
    return os.environ.get(MODE_ENV, '') == 'engramfs'


def mount_for(model_dir):
    """The engramfs mount serving model_dir's tables."""
    mount = os.environ.get(MOUNT_ENV) or model_dir
    if not os.path.exists(os.path.join(mount, '.engramfs', 'control')):
        raise RuntimeError('%s=engramfs: %s is not an engramfs mount (no .engramfs/control); '
                           'set %s to the mount' % (MODE_ENV, mount, MOUNT_ENV))
    return mount


def _weight_map(mount):
    with _lock:
        wm = _indexes.get(mount)
        if wm is None:
            with open(os.path.join(mount, 'model.safetensors.index.json')) as f:
                wm = _indexes[mount] = json.load(f)['weight_map']
        return wm


def _data_start(path, name):
    """Where tensor name's bytes start in the safetensors file at path."""
    with open(path, 'rb') as f:
        (n,) = struct.unpack('<Q', f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]['data_offsets'][0]


class Hints:
    """One process's hints to one mount: a prefill handle, never waited on,
    and a decode handle, whose barrier then waits for decode frames only."""

    def __init__(self, mount):
        self.mount = mount
        self.pre = engramfs_hints.Hinter(mount)
        self.dec = engramfs_hints.Hinter(mount)
        self.prefill_rows = 0
        self.decode_steps = 0
        self.last_status = None
        self.prefill_waits = 0
        self.last_prefill_status = None

    def prefill(self, layer, rows):
        self.pre.prefill(layer, rows)
        self.prefill_rows += len(rows)

    def decode_and_wait(self, layer_rows):
        """This step's rows of every layer as decode hints and the wait for
        them, in one request (the step ioctl; as decode() calls and a read
        barrier where it cannot carry them): when it returns they are in the
        page cache. Returns the barrier's counts; raises
        engramfs_hints.HintFailed if pages failed (with the reason) and
        HintRejected for a bad row."""
        # One barrier for the whole step. A barrier per layer (a handle per
        # layer, each layer's barrier read right before its gather) measured
        # no faster in the serving loop, whose layers have no compute in
        # between (engramfs bench --serve --serve-decode-per-layer); it pays
        # only where the engine computes between its engram layers, and
        # this is the one place to change for it.
        self.last_status = self.dec.step(layer_rows)
        self.decode_steps += 1
        return self.last_status

    def wait_prefill(self):
        """Wait for the prefill hints sent so far (the chunk about to be
        gathered: _hash_ahead hinted it at the end of the last stage()).
        Returns the barrier's counts. Pages that failed are not raised here:
        the gather reads them again, and fails there if they still do."""
        try:
            self.last_prefill_status = self.pre.wait()
        except engramfs_hints.HintFailed as e:
            self.last_prefill_status = e.status
        self.prefill_waits += 1
        return self.last_prefill_status

    def close(self):
        self.pre.close()
        self.dec.close()


def hints_for(mount):
    """The process's Hints for mount."""
    with _lock:
        h = _hints.get(mount)
        if h is None:
            h = _hints[mount] = Hints(mount)
        return h


class TableHints:
    """The hints of one engine table (one engram layer, both its tensors):
    rank-local rows in, the layer's global row ids out."""

    def __init__(self, hints, layer, row_start):
        self.hints, self.layer, self.row_start = hints, layer, row_start

    def rows(self, rel):
        if isinstance(rel, (list, tuple, range)):
            return [r + self.row_start for r in rel]
        return rel + self.row_start  # numpy arrays, torch tensors

    def prefill(self, rel):
        """The next chunk's rank-local rows: queued, returns at once."""
        self.hints.prefill(self.layer, self.rows(rel))


def retarget(table, model_dir, layer):
    """Point an engine table (w_fd, w_off, _w_path and the s_ ones, offsets
    already past row_start) at the mount's table files of layer, and return
    its TableHints."""
    mount = mount_for(model_dir)
    wm = _weight_map(mount)
    for kind, pre in (('weight', 'w'), ('scale', 's')):
        name = 'layers.%d.engram.embed.%s' % (layer, kind)
        old_path, off = getattr(table, '_%s_path' % pre), getattr(table, '%s_off' % pre)
        new_path = os.path.join(mount, wm[name])
        if os.path.realpath(old_path) == os.path.realpath(new_path):
            continue
        rel = off - _data_start(old_path, name)
        fd = os.open(new_path, os.O_RDONLY | os.O_CLOEXEC)
        os.close(getattr(table, '%s_fd' % pre))
        setattr(table, '%s_fd' % pre, fd)
        setattr(table, '%s_off' % pre, _data_start(new_path, name) + rel)
        setattr(table, '_%s_path' % pre, new_path)
    return TableHints(hints_for(mount), layer, table.row_start)


def _unique(x):
    if hasattr(x, 'unique'):  # torch
        return x.unique()
    import numpy as np
    return np.unique(x)


def wait_prefill(requests):
    """stage()'s requests of a prefill chunk: wait for the prefill hints of
    the mounts their tables read from (see Hints.wait_prefill). A chunk
    gathered before its hints landed faults each page the daemon has not
    pushed yet through FUSE, one round trip at a time: in the serving loop
    (4 ranks, 256-byte rows) a chunk took 2.5-2.7x the engine's own path
    that way against 1.4x after the wait (engramfs bench --serve
    --serve-prefill-gather-first). Returns the last barrier's counts, or
    None."""
    seen, st = set(), None
    for table, _rel, _owned in requests:
        th = getattr(table, 'engramfs', None)
        if th is not None and id(th.hints) not in seen:
            seen.add(id(th.hints))
            st = th.hints.wait_prefill()
    return st


def decode_and_wait(requests):
    """stage()'s requests, [(table, rel, owned)], as one decode step: a
    decode hint a layer and the barrier (see Hints.decode_and_wait). Tables without engramfs
    are left out. Returns the barrier's counts, or None."""
    by_hints = {}
    for table, rel, owned in requests:
        th = getattr(table, 'engramfs', None)
        if th is not None:
            by_hints.setdefault(id(th.hints), (th.hints, []))[1].append((th.layer, th.rows(_unique(rel[owned]))))
    st = None
    for hints, layer_rows in by_hints.values():
        st = hints.decode_and_wait(layer_rows)
    return st

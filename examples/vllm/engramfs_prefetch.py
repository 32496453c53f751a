"""engramfs hints for the DeepSeek-V4.1 engram DISK path (vLLM).

The engine's stage 8 (`_hash_ahead`) warms the next prefill chunk's rows
with posix_fadvise/pread from a thread pool (`_kai_prefetch_rows`), and its
decode gather faults rows in one by one (`_KAI_MMAP_INLINE_ROWS`: WILLNEED
then one np.take). With the engramfs mount as `model_dir` both become hints
on one control handle per rank process:

    DSV41_ENGRAM_PREFETCH_MODE=engramfs   # next to fadvise | pread
    DSV41_ENGRAMFS_MOUNT=/mnt/engram      # default: model_dir

    # _hash_ahead, instead of the pool of _kai_prefetch_rows tasks:
    hints = engramfs_prefetch.for_model_dir(model_dir)
    hints.prefill(layer_id, rel_rows + row_start)     # best effort, returns at once

    # stage(), before gather_dequant_many(requests), decode-sized steps only:
    hints.decode_and_wait([(layer_id, rel_rows + row_start), ...])

Rows are global row ids of the layer (the mount's table files hold every
row; a rank's table starts at row_start). Hint layers are engram layer ids,
the L of `layers.L.engram.embed.{weight,scale}`: one hint covers both tables.

Nothing here imports vLLM or torch; torch tensors and numpy arrays go
through the buffer protocol (engramfs_hints).
"""

import os
import sys
import threading

try:
    import engramfs_hints  # pip install <engramfs>/hints/python
except ImportError:  # a checkout: use the client beside this file
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'hints', 'python'))
    import engramfs_hints

MODE_ENV = 'DSV41_ENGRAM_PREFETCH_MODE'
MOUNT_ENV = 'DSV41_ENGRAMFS_MOUNT'

_lock = threading.Lock()
_by_mount = {}


def enabled():
    """True when the engine is to hint engramfs instead of fadvise/pread."""
    return os.environ.get(MODE_ENV, '') == 'engramfs'


class Hints:
    """One rank's hints: two control handles (per process: engramfs_hints
    opens its own again after a fork), one for prefill, never waited on, and
    one for decode, whose barrier then waits for decode frames only."""

    def __init__(self, mount):
        self.mount = mount
        self.pre = engramfs_hints.Hinter(mount)
        self.h = engramfs_hints.Hinter(mount)
        self.prefill_rows = 0
        self.decode_steps = 0
        self.last_status = None

    def prefill(self, layer, rows):
        """The next chunk's rows of layer: queued, returns at once."""
        self.pre.prefill(layer, rows)
        self.prefill_rows += len(rows)

    def decode_and_wait(self, layer_rows):
        """This step's rows, every layer, then the read barrier: when it
        returns the rows are in the page cache and the gather (np.take on
        the mapping) runs at memory speed. Returns the barrier's counts;
        raises engramfs_hints.HintFailed if pages failed."""
        for layer, rows in layer_rows:
            self.h.decode(layer, rows)
        self.decode_steps += 1
        self.last_status = self.h.wait()
        return self.last_status

    def close(self):
        self.pre.close()
        self.h.close()


def for_model_dir(model_dir):
    """The process's Hints for the mount serving model_dir."""
    mount = os.environ.get(MOUNT_ENV) or model_dir
    with _lock:
        h = _by_mount.get(mount)
        if h is None:
            h = _by_mount[mount] = Hints(mount)
        return h

"""A stand-in for the vLLM DSV4.1 engram DISK path with engram-engramfs.diff
applied, without vLLM or a GPU: it makes the engine's calls, on the engine's
data, through engramfs_prefetch.py, against a real mount.

  - DiskTable: the engine's fields from the model directory's shards (a
    descriptor, the offset of this rank's first row, the path), then the
    patch's `self.engramfs = retarget(self, model_dir, layer_id)`, then stage
    6's read-only map of `_w_path`/`_s_path` (MADV_RANDOM) as numpy
    [num_rows, row_bytes] views at `w_off`/`s_off`;
  - prefill: chunk N's stage() waits for its prefill hints
    (`wait_prefill(requests)`) and gathers its rows (np.take); then chunk
    N+1's rank-local rows go to `table.engramfs.prefill(rows)` (stage 8's
    _hash_ahead, at the end of stage()) while chunk N "computes" (a sleep);
  - decode: each step's requests, [(table, rel, owned)] as disk_rel_owned
    gives them (Zipf-popular rows, some owned by other ranks), go to
    `decode_and_wait(requests)` (stage()), then the gather;
  - several rank processes, forked from one parent that hinted first (each
    child must open its own control handle).

Every row gathered is checked against the shard's bytes (pread of the
original shard). DSV41_ENGRAMFS_MOUNT is set to MOUNT, as a deployment sets
it when the engine's model directory is not the mount itself.

usage: standin.py MODEL_DIR MOUNT [--ranks 4] [--chunks 4] [--chunk-rows 2000]
                                  [--compute-ms 50] [--decode-steps 20]
Prints one JSON line per rank and OK. Exits 1 if a barrier reported failed
or dropped decode pages, a row differed from the shard's, or a rank failed.
"""

import argparse
import json
import mmap
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engramfs_prefetch as _kai_engramfs  # noqa: E402

DECODE_ROWS = 72


def _map(path):
    """Stage 6's _kai_map_file: the whole file, read-only, MADV_RANDOM."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    mm.madvise(mmap.MADV_RANDOM)
    return mm, np.frombuffer(mm, dtype=np.uint8)


class DiskTable:
    """The engine's disk table of one engram layer, this rank's rows."""

    def __init__(self, model_dir, weight_map, layer_id, rank, ranks):
        wname = 'layers.%d.engram.embed.weight' % layer_id
        sname = 'layers.%d.engram.embed.scale' % layer_id
        self.w_fd, self.w_off, self.w_shape = self._open(model_dir, weight_map[wname], wname)
        self.s_fd, self.s_off, self.s_shape = self._open(model_dir, weight_map[sname], sname)
        self._w_path = os.path.join(model_dir, weight_map[wname])
        self._s_path = os.path.join(model_dir, weight_map[sname])
        self.dim, self.sb = self.w_shape[1], self.s_shape[1]
        rows = self.w_shape[0]
        per = rows // ranks
        row_start = rank * per
        num_rows = per if rank < ranks - 1 else rows - row_start
        self.w_off += row_start * self.dim
        self.s_off += row_start * self.sb
        self.row_start = row_start
        self.num_rows = num_rows
        # The shard's bytes, to check every gathered row against.
        self.check = [(os.open(self._w_path, os.O_RDONLY), self.w_off, self.dim),
                      (os.open(self._s_path, os.O_RDONLY), self.s_off, self.sb)]
        # engram-engramfs.diff's line:
        self.engramfs = _kai_engramfs.retarget(self, model_dir, layer_id) if _kai_engramfs.enabled() else None
        # Stage 6.
        self._w_mm, w_buf = _map(self._w_path)
        self._s_mm, s_buf = _map(self._s_path)
        self.w_view = np.ndarray((num_rows, self.dim), dtype=np.uint8, buffer=w_buf, offset=self.w_off)
        self.s_view = np.ndarray((num_rows, self.sb), dtype=np.uint8, buffer=s_buf, offset=self.s_off)

    @staticmethod
    def _open(model_dir, shard, name):
        """The engine's _open: a descriptor, the tensor's data offset, its
        shape (as bytes a row: the tables here are byte-sized or F32)."""
        path = os.path.join(model_dir, shard)
        with open(path, 'rb') as f:
            n = int.from_bytes(f.read(8), 'little')
            info = json.loads(f.read(n))[name]
        begin, end = info['data_offsets']
        rows = info['shape'][0]
        return os.open(path, os.O_RDONLY), 8 + n + begin, [rows, (end - begin) // rows]

    def disk_rel_owned(self, rows):
        """Global rows to rank-local ones, and which this rank owns."""
        rel = np.asarray(rows, dtype=np.int64) - self.row_start
        owned = (rel >= 0) & (rel < self.num_rows)
        return np.where(owned, rel, 0), owned

    def gather(self, rel):
        """Stage 6's gather (np.take on the views), each row checked."""
        idx = np.asarray(rel, dtype=np.int64)
        got = [np.take(self.w_view, idx, axis=0), np.take(self.s_view, idx, axis=0)]
        for out, (fd, base, width) in zip(got, self.check):
            for i, r in enumerate(idx):
                if os.pread(fd, width, base + int(r) * width) != out[i].tobytes():
                    raise SystemExit('layer row %d (rank-local %d): bytes differ from the shard\'s'
                                     % (self.row_start + int(r), int(r)))
        return len(idx)


def layers_of(weight_map):
    out = set()
    for name in weight_map:
        parts = name.split('.')
        if len(parts) == 5 and parts[0] == 'layers' and parts[2:4] == ['engram', 'embed']:
            out.add(int(parts[1]))
    return sorted(out)


def run_rank(model_dir, rank, args):
    with open(os.path.join(model_dir, 'model.safetensors.index.json')) as f:
        weight_map = json.load(f)['weight_map']
    tables = [DiskTable(model_dir, weight_map, layer, rank, args.ranks) for layer in layers_of(weight_map)]
    layer_rows = tables[0].w_shape[0]
    rng = np.random.default_rng(100 + rank)
    gathered = 0

    def chunk_rows(c):
        # The "hash" of chunk c, rank-local rows: known a whole chunk ahead.
        r = np.random.default_rng(1000 * rank + c)
        return [np.unique(r.integers(0, t.num_rows, size=args.chunk_rows)).tolist() for t in tables]

    # Prefill: chunk 0 is hinted before it computes, chunk N+1 at the end of
    # chunk N's stage() (_hash_ahead), while N computes.
    nxt = chunk_rows(0)
    for t, rows in zip(tables, nxt):
        t.engramfs.prefill(rows)
    prefill_waits = 0
    for c in range(args.chunks):
        cur = nxt
        st = _kai_engramfs.wait_prefill([(t, None, None) for t in tables])  # stage()
        if st is None or st['failed'] or st['frames'] != len(tables):
            raise SystemExit('rank %d: chunk %d prefill barrier status %r' % (rank, c, st))
        prefill_waits += 1
        for t, rows in zip(tables, cur):  # the chunk's gather
            gathered += t.gather(rows)
        if c + 1 < args.chunks:
            nxt = chunk_rows(c + 1)
            for t, rows in zip(tables, nxt):  # _hash_ahead
                t.engramfs.prefill(rows)
        time.sleep(args.compute_ms / 1000)

    # Decode: the step's rows are known only now; some are other ranks'.
    barrier_ms = []
    for _ in range(args.decode_steps):
        hot = rng.zipf(1.3, size=DECODE_ROWS) - 1
        requests = [(t, *t.disk_rel_owned(hot[hot < layer_rows])) for t in tables]
        t0 = time.perf_counter()
        st = _kai_engramfs.decode_and_wait(requests)  # stage(), engram-engramfs.diff
        barrier_ms.append(1e3 * (time.perf_counter() - t0))
        # Decode pages are never dropped, and resident when it returns.
        if st['failed'] or st['dropped'] or st['resident'] + st['pinned'] != st['pages']:
            raise SystemExit('rank %d: decode barrier status %r' % (rank, st))
        for t, rel, owned in requests:
            gathered += t.gather(np.unique(rel[owned]))
    hints = tables[0].engramfs.hints
    barrier_ms.sort()
    p = lambda q: barrier_ms[min(len(barrier_ms) - 1, int(q * len(barrier_ms)))]  # noqa: E731
    print(json.dumps({'rank': rank, 'pid': os.getpid(), 'read_from': tables[0]._w_path,
                      'rows_checked': gathered, 'prefill_rows': hints.prefill_rows,
                      'prefill_waits': prefill_waits,
                      'decode_steps': hints.decode_steps, 'decode_barrier_ms_p50': round(p(0.5), 3),
                      'decode_barrier_ms_p99': round(p(0.99), 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('model_dir')
    ap.add_argument('mount')
    ap.add_argument('--ranks', type=int, default=4)
    ap.add_argument('--chunks', type=int, default=4)
    ap.add_argument('--chunk-rows', type=int, default=2000)
    ap.add_argument('--compute-ms', type=float, default=50)
    ap.add_argument('--decode-steps', type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault(_kai_engramfs.MODE_ENV, 'engramfs')
    os.environ[_kai_engramfs.MOUNT_ENV] = args.mount
    # The parent hints first, as an engine's main process may: every forked
    # rank must then open a handle of its own.
    _kai_engramfs.hints_for(args.mount).decode_and_wait([])
    pids = []
    for rank in range(args.ranks):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_rank(args.model_dir, rank, args)
            except BaseException as e:  # noqa: BLE001 - reported, then the exit code
                print('rank %d failed: %r' % (rank, e), file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    if failed:
        print('%d of %d ranks failed' % (failed, args.ranks))
        return 1
    print('OK')
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""A stand-in for the vLLM DSV4.1 engram DISK path, without vLLM or a GPU.

It replays the calls the engine makes, with the engramfs hints of
engramfs_prefetch.py, on whatever model the mount serves (a synthetic one in
the tests: `engramfs synth`):

  - the loader: model.safetensors.index.json, each table file's safetensors
    header parsed by hand, the file mapped (MADV_RANDOM) as a numpy
    [rows, row_bytes] view of this rank's row range;
  - prefill: chunk N+1's rows hinted (stage 8 hash-ahead) while chunk N
    "computes" (its rows gathered with np.take, then a sleep);
  - decode: each step's rows (Zipf-popular, 72 per layer) hinted as decode,
    the read barrier, then the gather;
  - several rank processes at once, forked from one parent that hinted
    first (so each child must open its own control handle).

usage: standin.py MOUNT [--ranks 4] [--chunks 4] [--chunk-rows 2000]
                        [--compute-ms 50] [--decode-steps 20]
Prints one JSON line per rank and OK. Exits 1 if a barrier reported failed
or dropped decode pages, or a rank failed.
"""

import argparse
import json
import mmap
import os
import struct
import sys
import time

import numpy as np

os.environ.setdefault('DSV41_ENGRAM_PREFETCH_MODE', 'engramfs')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engramfs_prefetch  # noqa: E402

DECODE_ROWS = 72


def header(path):
    with open(path, 'rb') as f:
        (n,) = struct.unpack('<Q', f.read(8))
        return json.loads(f.read(n)), 8 + n


class DiskTable:
    """What the engine's disk table holds for one engram layer: a mapped
    [num_rows, row_bytes] view of this rank's rows, for weight and scale."""

    def __init__(self, model_dir, weight_map, layer, rank, ranks):
        self.layer_id = layer
        self.views = []
        self.maps = []
        rows_total = None
        for kind in ('weight', 'scale'):
            name = 'layers.%d.engram.embed.%s' % (layer, kind)
            path = os.path.join(model_dir, weight_map[name])
            hdr, data_start = header(path)
            info = hdr[name]
            rows, _ = info['shape']
            begin, end = info['data_offsets']
            row_bytes = (end - begin) // rows
            rows_total = rows
            with open(path, 'rb') as f:
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            mm.madvise(mmap.MADV_RANDOM)
            self.maps.append(mm)
            self.views.append(np.frombuffer(mm, dtype=np.uint8, count=end - begin,
                                            offset=data_start + begin).reshape(rows, row_bytes))
        per = rows_total // ranks
        self.row_start = rank * per
        self.num_rows = per if rank < ranks - 1 else rows_total - self.row_start
        self.hints = engramfs_prefetch.for_model_dir(model_dir)

    def gather(self, rel):
        idx = np.asarray(rel, dtype=np.int64) + self.row_start
        return [np.take(v, idx, axis=0) for v in self.views]


def layers_of(weight_map):
    out = set()
    for name in weight_map:
        parts = name.split('.')
        if len(parts) == 5 and parts[0] == 'layers' and parts[2:4] == ['engram', 'embed']:
            out.add(int(parts[1]))
    return sorted(out)


def zipf_rows(rng, n, num_rows):
    # Zipf-popular rows (s ~ 1): a few rows take most lookups.
    r = rng.zipf(1.3, size=n) - 1
    return np.unique(r[r < num_rows] % num_rows)


def run_rank(model_dir, rank, args):
    with open(os.path.join(model_dir, 'model.safetensors.index.json')) as f:
        weight_map = json.load(f)['weight_map']
    tables = [DiskTable(model_dir, weight_map, layer, rank, args.ranks) for layer in layers_of(weight_map)]
    hints = tables[0].hints
    rng = np.random.default_rng(100 + rank)

    def chunk_rows(c):
        # The "hash" of chunk c: known a whole chunk ahead.
        r = np.random.default_rng(1000 * rank + c)
        return [np.unique(r.integers(0, t.num_rows, size=args.chunk_rows)) for t in tables]

    # Prefill: chunk 0 is hinted before it computes, chunk N+1 while N computes.
    nxt = chunk_rows(0)
    for t, rel in zip(tables, nxt):
        hints.prefill(t.layer_id, rel + t.row_start)
    for c in range(args.chunks):
        cur = nxt
        if c + 1 < args.chunks:
            nxt = chunk_rows(c + 1)
            for t, rel in zip(tables, nxt):  # stage 8: _hash_ahead
                hints.prefill(t.layer_id, rel + t.row_start)
        for t, rel in zip(tables, cur):  # the chunk's gather
            t.gather(rel)
        time.sleep(args.compute_ms / 1000)

    # Decode: the step's rows are known only now.
    barrier_ms = []
    for _ in range(args.decode_steps):
        step = [(t, zipf_rows(rng, DECODE_ROWS, t.num_rows)) for t in tables]
        t0 = time.perf_counter()
        st = hints.decode_and_wait([(t.layer_id, rel + t.row_start) for t, rel in step])
        barrier_ms.append(1e3 * (time.perf_counter() - t0))
        # Decode pages are never dropped, and resident when it returns.
        if st['failed'] or st['dropped'] or st['resident'] + st['pinned'] != st['pages']:
            raise SystemExit('rank %d: decode barrier status %r' % (rank, st))
        for t, rel in step:
            t.gather(rel)
    barrier_ms.sort()
    p = lambda q: barrier_ms[min(len(barrier_ms) - 1, int(q * len(barrier_ms)))]  # noqa: E731
    print(json.dumps({'rank': rank, 'pid': os.getpid(), 'prefill_rows': hints.prefill_rows,
                      'decode_steps': hints.decode_steps, 'decode_barrier_ms_p50': round(p(0.5), 3),
                      'decode_barrier_ms_p99': round(p(0.99), 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('mount')
    ap.add_argument('--ranks', type=int, default=4)
    ap.add_argument('--chunks', type=int, default=4)
    ap.add_argument('--chunk-rows', type=int, default=2000)
    ap.add_argument('--compute-ms', type=float, default=50)
    ap.add_argument('--decode-steps', type=int, default=20)
    args = ap.parse_args()
    # The parent hints first, as an engine's main process may: every forked
    # rank must then open a handle of its own.
    engramfs_prefetch.for_model_dir(args.mount).decode_and_wait([])
    pids = []
    for rank in range(args.ranks):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_rank(args.mount, rank, args)
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

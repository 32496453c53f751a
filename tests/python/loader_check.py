"""Unmodified-loader check: treat the engramfs mount as a model directory.

Reads the mount's index, parses each table file's safetensors header with its
own code, maps the file with MADV_RANDOM, gathers random rows with numpy, and
compares them with the same rows read straight from the source shards. (The
index's other tensors, in their shards, are model_loader.py's to check.)

usage: loader_check.py MOUNT MODEL_DIR NROWS
"""
import json
import mmap
import os
import struct
import sys

import numpy as np


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def main():
    mount, model_dir, nrows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(os.path.join(mount, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        src_index = json.load(f)
    rng = np.random.default_rng(7)
    checked = 0
    tables = {n: rel for n, rel in index["weight_map"].items() if rel.startswith("layers/")}
    for name, rel in sorted(tables.items()):
        path = os.path.join(mount, rel)
        hdr, data_start = header(path)
        info = hdr[name]
        rows, cols = info["shape"]
        begin, end = info["data_offsets"]
        assert data_start % 4096 == 0, f"{rel}: data at {data_start}"
        row_bytes = (end - begin) // rows
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        mm.madvise(mmap.MADV_RANDOM)
        table = np.frombuffer(mm, dtype=np.uint8, count=end - begin, offset=data_start + begin)
        table = table.reshape(rows, row_bytes)
        ids = rng.integers(0, rows, size=nrows)
        got = np.take(table, ids, axis=0)

        shard = os.path.join(model_dir, src_index["weight_map"][name])
        shdr, sstart = header(shard)
        sbegin, _ = shdr[name]["data_offsets"]
        with open(shard, "rb") as f:
            for i, r in enumerate(ids):
                f.seek(sstart + sbegin + int(r) * row_bytes)
                want = f.read(row_bytes)
                if got[i].tobytes() != want:
                    print(f"MISMATCH {name} row {r}")
                    sys.exit(1)
        checked += len(ids)
        del table, got
        mm.close()
    print(f"OK {checked} rows from {len(tables)} tables")


if __name__ == "__main__":
    main()

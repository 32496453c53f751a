"""One reader process of the load test.

Maps every table of one layer through the mount, and for SECONDS: gathers
random rows (some Zipf-hot, some cold) through the mapping, hints the next
step's rows (decode, with a barrier) and the next chunk's (prefill, without),
and checks every row it gathered against the shard, read directly.

usage: load_reader.py MOUNT MODEL_DIR LAYER SECONDS SEED
prints: OK rows=N hints=N  (exit 1 and MISMATCH ... on a wrong byte)
"""
import json
import mmap
import os
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "hints", "python"))
from engramfs_hints import Hinter  # noqa: E402


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def main():
    mount, model_dir, layer, seconds, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    with open(os.path.join(mount, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        src_index = json.load(f)
    tables = []
    for lay in manifest["layers"]:
        if lay["layer"] != layer:
            continue
        nrows = lay["rows"]
        for t in lay["tables"]:
            f = open(os.path.join(mount, t["file"]), "rb")
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            mm.madvise(mmap.MADV_RANDOM)
            view = np.frombuffer(mm, np.uint8, nrows * t["row_bytes"], t["data_offset"]).reshape(nrows, t["row_bytes"])
            shard = os.path.join(model_dir, src_index["weight_map"][t["name"]])
            shdr, sstart = header(shard)
            sfd = os.open(shard, os.O_RDONLY)
            tables.append((t["name"], t["row_bytes"], view, sfd, sstart + shdr[t["name"]]["data_offsets"][0], f, mm))
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, nrows, size=512)
    rows_checked = hints = 0
    deadline = time.monotonic() + seconds
    with Hinter(mount) as h:
        nxt = np.concatenate([rng.choice(hot, 48), rng.integers(0, nrows, 24)])
        while time.monotonic() < deadline:
            step = nxt
            nxt = np.concatenate([rng.choice(hot, 48), rng.integers(0, nrows, 24)])
            if rng.random() < 0.5:
                h.decode(layer, step)
                h.wait()
                hints += 1
            if rng.random() < 0.1:
                h.prefill(layer, rng.integers(0, nrows, 2000))
                hints += 1
            for name, rb, view, sfd, base, _, _ in tables:
                got = np.take(view, step, axis=0)
                for i, r in enumerate(step):
                    want = os.pread(sfd, rb, base + int(r) * rb)
                    if got[i].tobytes() != want:
                        print(f"MISMATCH {name} row {r}", flush=True)
                        sys.exit(1)
                rows_checked += len(step)
    for _, _, view, sfd, _, f, mm in tables:
        del view
    print(f"OK rows={rows_checked} hints={hints}")


if __name__ == "__main__":
    main()

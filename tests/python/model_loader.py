"""Engine-shaped loader: load a model directory as an inference engine does.

Reads config.json, generation_config.json and the tokenizer files, then the
index, then every tensor the index names from its file, mapped (as
safetensors' safe_open does) and viewed with numpy. Prints one JSON object:
each small file's and each tensor's SHA-256, with dtype and shape, so two
runs (MODEL_DIR, the mount) can be compared byte for byte.

usage: model_loader.py DIR
"""
import hashlib
import json
import mmap
import os
import struct
import sys

import numpy as np

SMALL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def main():
    root = sys.argv[1]
    out = {"files": {}, "tensors": {}}
    for name in SMALL_FILES:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        json.loads(data)  # the engine parses them
        out["files"][name] = hashlib.sha256(data).hexdigest()
    with open(os.path.join(root, "model.safetensors.index.json")) as f:
        index = json.load(f)
    by_file = {}
    for name, rel in index["weight_map"].items():
        by_file.setdefault(rel, []).append(name)
    for rel, names in sorted(by_file.items()):
        with open(os.path.join(root, rel), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        buf = np.frombuffer(mm, dtype=np.uint8)
        for name in sorted(names):
            info = header[name]
            begin, end = info["data_offsets"]
            data = buf[8 + n + begin : 8 + n + end]
            out["tensors"][name] = [info["dtype"], info["shape"], hashlib.sha256(data).hexdigest()]
        del buf, data
        mm.close()
    json.dump(out, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main()

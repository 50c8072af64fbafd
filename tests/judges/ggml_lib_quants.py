#!/usr/bin/env python3
"""Judge of hexq's q4_0 / q8_0 / q6_K blocks: ggml itself — the reference quantizers
(quantize_row_{q4_0,q8_0,q6_K}_ref) of the libggml-base.so that llama-quantize calls, through ctypes.

usage: ggml_lib_quants.py LIBGGML_BASE CASES_DIR   (CASES_DIR/<name>.f32 raw little-endian values,
<name>.<type> hexq's blocks for the types it wrote) → JSON {name: {type: equal, <type>_diff_blocks: …}}
"""
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

BLOCK = {"q4_0": (32, 18), "q8_0": (32, 34), "q6_K": (256, 210)}


def main(lib, d):
    g = ctypes.CDLL(lib)
    d = Path(d)
    out = {}
    for f in sorted(d.glob("*.f32")):
        x = np.ascontiguousarray(np.fromfile(f, dtype=np.float32))
        r = {}
        for t, (qk, bs) in BLOCK.items():
            p = d / f"{f.stem}.{t}"
            if not p.exists():
                continue
            fn = getattr(g, f"quantize_row_{t}_ref")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            fn.restype = None
            ref = np.zeros(x.size // qk * bs, np.uint8)
            fn(x.ctypes.data, ref.ctypes.data, x.size)
            ref = ref.tobytes()
            ours = p.read_bytes()
            r[t] = ref == ours
            if ref != ours:
                diff = [i for i in range(len(ref) // bs) if ref[i * bs:(i + 1) * bs] != ours[i * bs:(i + 1) * bs]]
                r[f"{t}_diff_blocks"] = diff[:5]
                r[f"{t}_n_diff"] = len(diff)
                if diff:
                    i = diff[0]
                    r[f"{t}_first"] = [ref[i * bs:(i + 1) * bs].hex(), ours[i * bs:(i + 1) * bs].hex()]
        out[f.stem] = r
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])

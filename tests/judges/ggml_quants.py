#!/usr/bin/env python3
"""Judge of hexq's q4_0/q8_0 blocks: gguf-py's reference quantizers (PyPI `gguf`, gguf.quants.quantize, the
numpy port of ggml's quantize_row_q4_0_ref / quantize_row_q8_0_ref).

usage: ggml_quants.py CASES_DIR   (CASES_DIR/<name>.f32 raw little-endian values, <name>.q4_0 / <name>.q8_0 hexq's
blocks) → JSON {name: {"q4_0": equal, "q8_0": equal, "first_diff_block": …}}
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants


def main(d):
    d = Path(d)
    out = {}
    for f in sorted(d.glob("*.f32")):
        x = np.fromfile(f, dtype=np.float32).reshape(-1, 32)
        r = {}
        for name, t in [("q4_0", GGMLQuantizationType.Q4_0), ("q8_0", GGMLQuantizationType.Q8_0)]:
            with np.errstate(all="ignore"):
                ref = quants.quantize(x, t).tobytes()
            ours = (d / f"{f.stem}.{name}").read_bytes()
            r[name] = ref == ours
            if ref != ours:
                bs = 18 if name == "q4_0" else 34
                diff = [i for i in range(len(ref) // bs) if ref[i * bs:(i + 1) * bs] != ours[i * bs:(i + 1) * bs]]
                r[f"{name}_diff_blocks"] = diff[:5]
                r[f"{name}_n_diff"] = len(diff)
        out[f.stem] = r
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])

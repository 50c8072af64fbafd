#!/usr/bin/env python3
"""Judge of hexq's GPTQ (quantize/src/rounding/gptq.rs): the reference implementation's
`GPTQ.fasterquant` (IST-DASLab/gptq, gptq.py) transcribed to numpy in float64, with a fixed symmetric
per-row grid (scale s_r, integers -8..7) instead of its min-max quantizer.

usage: gptq_reference.py DIR ROWS IN BLOCK DAMP ACTORDER
reads DIR/w.f64 ([rows, in]), DIR/h.f64 ([in, in]), DIR/s.f64 ([rows]); writes DIR/q.f64 ([rows, in]).
"""
import sys

import numpy as np


def main(d, rows, n, blocksize, percdamp, actorder):
    rows, n, blocksize, percdamp = int(rows), int(n), int(blocksize), float(percdamp)
    W = np.fromfile(f"{d}/w.f64").reshape(rows, n).copy()
    H = np.fromfile(f"{d}/h.f64").reshape(n, n).copy()
    s = np.fromfile(f"{d}/s.f64")
    quant = lambda w: np.clip(np.round(w / s), -8, 7) * s  # numpy rounds half to even; inputs avoid ties
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = None
    if actorder == "1":
        perm = np.argsort(-np.diag(H), kind="stable")
        W, H = W[:, perm], H[perm][:, perm]
    Q = np.zeros_like(W)
    H[np.diag_indices(n)] += percdamp * np.mean(np.diag(H))
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper U with H⁻¹ = UᵀU
    for i1 in range(0, n, blocksize):
        i2 = min(i1 + blocksize, n)
        W1 = W[:, i1:i2].copy()
        Q1 = np.zeros_like(W1)
        Err1 = np.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            q = quant(w)
            Q1[:, i] = q
            err1 = (w - q) / Hinv1[i, i]
            W1[:, i:] -= np.outer(err1, Hinv1[i, i:])
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, np.argsort(perm)]
    Q.tofile(f"{d}/q.f64")


if __name__ == "__main__":
    main(*sys.argv[1:])

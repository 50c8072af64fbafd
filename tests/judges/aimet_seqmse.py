#!/usr/bin/env python3
"""Judge of hexq's SeqMSE (quantize/src/rounding/seqmse.rs): aimet-onnx 2.42's `apply_seq_mse` on a
one-MatMul model, int4 weights per output channel (MODE pc) or LPBQ blocks (MODE lpbq: 4-bit weights,
4-bit block scales), over N correlated heavy-tailed input rows; activation quantizers off.

usage: aimet_seqmse.py OUT_DIR IN OUT MODE BLOCK N SEED
writes OUT_DIR/w.f32 ([out, in] row-major) and OUT_DIR/x.f32 ([N, in]) and prints JSON
{"encoding": AIMET's exported param encoding of w}.
"""
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def main(out, n_in, n_out, mode, block, n, seed):
    from aimet_onnx import apply_seq_mse
    from aimet_onnx.quantsim import QuantizationSimModel, set_grouped_blockwise_quantization_for_weights

    n_in, n_out, block, n = int(n_in), int(n_out), int(block), int(n)
    rng = np.random.default_rng(int(seed))
    W = (rng.standard_normal((n_in, n_out)) * np.exp(0.7 * rng.standard_normal((n_in, 1)))).astype(np.float32)
    # Inputs with a few dominant columns (as a trained model's are) and a shared component.
    X = (rng.standard_normal((n, n_in)) * np.exp(rng.standard_normal((1, n_in)))
         + rng.standard_normal((n, 1))).astype(np.float32)
    W.T.astype("<f4").tofile(os.path.join(out, "w.f32"))
    X.astype("<f4").tofile(os.path.join(out, "x.f32"))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n_in])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n_out])],
                          [numpy_helper.from_array(W, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    sim = QuantizationSimModel(m, param_type="int4", activation_type="int16")
    if mode == "lpbq":
        set_grouped_blockwise_quantization_for_weights(sim, ("MatMul",), 4, 8, block)
    for name in ("x", "y"):
        if name in sim.qc_quantize_op_dict:
            sim.qc_quantize_op_dict[name].enabled = False
    data = [{"x": X[i : i + 1]} for i in range(n)]
    apply_seq_mse(sim, data, num_candidates=20)
    sim.compute_encodings(lambda s: [s.run(None, d) for d in data[:4]])
    sim.export(out, "m")
    enc = json.load(open(os.path.join(out, "m.encodings")))["param_encodings"]
    enc = [e for e in enc if e["name"] == "w"][0]
    print(json.dumps({"encoding": enc}))


if __name__ == "__main__":
    main(*sys.argv[1:])

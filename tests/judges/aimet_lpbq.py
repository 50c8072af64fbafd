#!/usr/bin/env python3
"""Judge of hexq's LPBQ (quantize/src/lpbq.rs): aimet-onnx's QuantizationSimModel with grouped blockwise
(LPBQ) weight quantization — `set_grouped_blockwise_quantization_for_weights(sim, "MatMul", bitwidth 4,
decompressed_bw 8, block_size B)` — on a one-MatMul model with heavy-tailed input rows, then AIMET's exported
LPBQ encoding and its quantize-dequantized weight (read through the MatMul with one-hot inputs, activation
quantizers off).

usage: aimet_lpbq.py OUT_DIR IN OUT BLOCK SEED
writes OUT_DIR/w.f32 ([out, in] row-major, the layout hexq quantizes) and prints JSON
{"encoding": AIMET's param encoding, "wq": [out, in] fake-quantized weights}.
"""
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def main(out, n_in, n_out, block, seed):
    from aimet_onnx.quantsim import QuantizationSimModel, set_grouped_blockwise_quantization_for_weights

    n_in, n_out, block = int(n_in), int(n_out), int(block)
    rng = np.random.default_rng(int(seed))
    W = (rng.standard_normal((n_in, n_out)) * np.exp(rng.standard_normal((n_in, 1)))).astype(np.float32)
    W.T.astype("<f4").tofile(os.path.join(out, "w.f32"))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_in, n_in])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n_in, n_out])],
                          [numpy_helper.from_array(W, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    sim = QuantizationSimModel(m, param_type="int4", activation_type="int16")
    set_grouped_blockwise_quantization_for_weights(sim, ("MatMul",), 4, 8, block)
    eye = np.eye(n_in, dtype=np.float32)
    sim.compute_encodings(lambda s: s.run(None, {"x": eye}))
    for name in ("x", "y"):
        if name in sim.qc_quantize_op_dict:
            sim.qc_quantize_op_dict[name].enabled = False
    wq = sim.session.run(None, {"x": eye})[0]  # rows of W, quantize-dequantized: [in, out]
    sim.export(out, "m")
    enc = json.load(open(os.path.join(out, "m.encodings")))["param_encodings"]
    enc = [e for e in enc if e["name"] == "w"][0]
    print(json.dumps({"encoding": enc, "wq": wq.T.ravel().tolist()}))


if __name__ == "__main__":
    main(*sys.argv[1:])

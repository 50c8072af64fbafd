#!/usr/bin/env python3
"""Independent judge of hexq's A16W8 encodings: AIMET (aimet-onnx, QuantizationSimModel, min_max,
int16 activations, int8 per-channel weights) on MatMul subgraphs of the tiny model, calibrated with the
very activations hexq's calibration observed.

in:  cases.json {"model_dir": ..., "cases": [{"x_name", "y_name", "w_tensor", "x": [[...], ...]}]}
out: aimet.json {y_name: {"x": enc, "y": enc, "w": enc}} with enc = {"scale": [...], "offset": [...]}
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file


def main(cases_path, out_path):
    spec = json.loads(Path(cases_path).read_text())
    tensors = load_file(str(Path(spec["model_dir"]) / "model.safetensors"))
    from aimet_onnx.quantsim import QuantizationSimModel

    out = {}
    for c in spec["cases"]:
        w = tensors[c["w_tensor"]].astype(np.float32)  # [out, in]
        x = np.asarray(c["x"], dtype=np.float32)  # [N, in]
        xin = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[1]])
        yout = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[0]])
        node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
        g = helper.make_graph([node], "judge", [xin], [yout], [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        sim = QuantizationSimModel(m, param_type="int8", activation_type="int16", quant_scheme="min_max")
        sim.compute_encodings([{"x": x[i : i + 1]} for i in range(len(x))])
        d = tempfile.mkdtemp()
        sim.export(d, "judge")
        enc = json.loads((Path(d) / "judge.encodings").read_text())
        by = {e["name"]: e for e in enc["activation_encodings"] + enc["param_encodings"]}
        pick = lambda e: {"scale": e["scale"], "offset": e["offset"], "bw": e["bw"], "is_sym": e["is_sym"]}
        ws = np.asarray(by["W"]["scale"], dtype=np.float64)
        qw = np.clip(np.round(w.T.astype(np.float64) / ws), -128, 127) * ws
        yf, yq = x.astype(np.float64) @ w.T.astype(np.float64), x.astype(np.float64) @ qw
        out[c["y_name"]] = {"x": pick(by["x"]), "y": pick(by["y"]), "w": pick(by["W"]),
                            "numpy": {"x": [float(x.min()), float(x.max())], "y_float": [float(yf.min()), float(yf.max())],
                                      "y_qw": [float(yq.min()), float(yq.max())], "rows": int(len(x))}}
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

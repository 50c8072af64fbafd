"""onnxruntime's CPU arithmetic that quantsim mirrors (graph/src/rowmm.rs `dot_m1`, graph/src/ops.rs `logistic`, `softmax_row`):
runs MatMul [1, K] x [K, N] (MLAS's one-row kernel), Sigmoid (MLAS's logistic) and Softmax with graph optimizations off,
as hexq's ort backend runs a QDQ graph, and prints inputs and outputs as f32 bit patterns (JSON on stdout).

Usage: python3 mlas_order.py
"""
import json
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h


def run(nodes, inputs, outputs, feed):
    g = h.make_graph(nodes, "g", inputs, outputs)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feed)[0]


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32).ravel().tolist()


def main():
    rng = np.random.default_rng(20261205)
    cases = []
    # K: multiples of 4, the pair and single tails, more than one 256-input chunk; N past a 16-wide panel.
    for k, n in [(640, 64), (1537, 33), (6, 9), (7, 5), (259, 17), (1536, 40)]:
        a = rng.standard_normal((1, k)).astype(np.float32)
        b = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        vi = lambda name, shape: h.make_tensor_value_info(name, T.FLOAT, shape)
        y = run([h.make_node("MatMul", ["a", "b"], ["y"])], [vi("a", [1, k]), vi("b", [k, n])], [vi("y", [1, n])],
                {"a": a, "b": b})
        cases.append({"k": k, "n": n, "a": bits(a), "b": bits(b), "y": bits(y)})
    # Attention's MatMuls, [1, heads, m, k] x [1, heads, k, n]: m = query heads per KV head (MLAS's FMA
    # kernel in k slices) or 1 (the one-row kernel); q.k^T (k = head_dim) and p.v (k = ring length).
    attn = []
    for m, k, n in [(4, 256, 512), (4, 512, 256), (2, 16, 64), (1, 256, 100), (4, 128, 300), (8, 512, 40)]:
        a = rng.standard_normal((1, 2, m, k)).astype(np.float32)
        b = rng.standard_normal((1, 2, k, n)).astype(np.float32)
        vi = lambda name, shape: h.make_tensor_value_info(name, T.FLOAT, shape)
        y = run([h.make_node("MatMul", ["a", "b"], ["y"])], [vi("a", [1, 2, m, k]), vi("b", [1, 2, k, n])],
                [vi("y", [1, 2, m, n])], {"a": a, "b": b})
        attn.append({"m": m, "k": k, "n": n, "a": bits(a), "b": bits(b), "y": bits(y)})
    x = np.concatenate([np.array([-40, -18.5, -17.9, -1.0, 0.0, 0.5, 17.5, 18.2, 40], np.float32),
                        (rng.standard_normal(4000) * 6).astype(np.float32)])
    vi = lambda name: h.make_tensor_value_info(name, T.FLOAT, [len(x)])
    y = run([h.make_node("Sigmoid", ["x"], ["y"])], [vi("x")], [vi("y")], {"x": x})
    # Softmax rows (attention scores): lengths past the 24- and 8-element loops, masked slots at -1e4.
    soft = []
    for d in (512, 37, 7, 300):
        s = (rng.standard_normal((6, d)) * 3).astype(np.float32)
        s[:3, d // 2:] = -1e4
        vs = lambda name: h.make_tensor_value_info(name, T.FLOAT, [6, d])
        ys = run([h.make_node("Softmax", ["s"], ["y"], axis=-1)], [vs("s")], [vs("y")], {"s": s})
        soft.append({"d": d, "x": bits(s), "y": bits(ys)})
    # ReduceMean over the last axis (the norms' mean of squares): hidden and head widths (multiples of 8).
    means = []
    for d in (640, 256, 1536, 2048):
        v = (rng.standard_normal((40, 1, d)) ** 2 * 3).astype(np.float32)
        ax = h.make_tensor("ax", T.INT64, [1], [-1])
        g = h.make_graph([h.make_node("ReduceMean", ["v", "ax"], ["m"], keepdims=1)], "g",
                         [h.make_tensor_value_info("v", T.FLOAT, [40, 1, d])],
                         [h.make_tensor_value_info("m", T.FLOAT, [40, 1, 1])], [ax])
        mm = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        ym = ort.InferenceSession(mm.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"v": v})[0]
        means.append({"d": d, "x": bits(v), "y": bits(ym)})
    json.dump({"onnxruntime": ort.__version__, "mean": means, "attention": attn, "matmul": cases, "sigmoid": {"x": bits(x), "y": bits(y)},
               "softmax": soft}, sys.stdout)


if __name__ == "__main__":
    main()

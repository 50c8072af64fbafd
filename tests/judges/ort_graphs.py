#!/usr/bin/env python3
"""Independent judge of hexq's exported ONNX: onnx.checker (full_check) and onnxruntime driving the graphs
with a numpy host loop (embedding lookups, tied lm_head, 30·tanh(x/30) softcap), against the transformers
float32 goldens.

usage: ort_graphs.py EXPORT_DIR MODEL_DIR GOLDEN_DIR   (EXPORT_DIR holds decode_wgqa.onnx and trunk.onnx)
prints a JSON report; exits non-zero on any failure.
"""
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from safetensors.numpy import load_file


def main(exp, model, gold):
    exp, model, gold = Path(exp), Path(model), Path(gold)
    cfg = json.loads((model / "config.json").read_text())["text_config"]
    w = load_file(str(model / "model.safetensors"))
    pre = "model.language_model."
    E = w[pre + "embed_tokens.weight"].astype(np.float32)
    P = w[pre + "embed_tokens_per_layer.weight"].astype(np.float32)
    H, L, Pd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["hidden_size_per_layer_input"]
    cap = cfg["final_logit_softcapping"]
    esc, psc = np.float32(np.sqrt(H)), np.float32(np.sqrt(Pd))
    g = json.loads((gold / "golden.json").read_text())
    gt = load_file(str(gold / "golden.safetensors"))
    report = {"checker": {}, "decode": {}, "trunk": {}}

    def logits(h):
        l = h.astype(np.float64) @ E.T.astype(np.float64)
        return (np.tanh(l / cap) * cap) if cap else l

    def sess(name):
        p = str(exp / f"{name}.onnx")
        onnx.checker.check_model(p, full_check=True)
        m = onnx.load(p, load_external_data=False)
        report["checker"][name] = {
            "ok": True,
            "expand_nodes": sum(1 for n in m.graph.node if n.op_type == "Expand"),
            "int32_index_inputs": all(i.type.tensor_type.elem_type == onnx.TensorProto.INT32
                                      for i in m.graph.input if i.name in ("position_ids", "cache_position", "valid_len")),
            "vocab_dims": [t.name for t in m.graph.initializer if cfg["vocab_size"] in t.dims]
                          + [i.name for i in list(m.graph.input) + list(m.graph.output)
                             if cfg["vocab_size"] in [d.dim_value for d in i.type.tensor_type.shape.dim]],
        }
        return ort.InferenceSession(p, providers=["CPUExecutionProvider"])

    def zeros_kv(s):
        return {i.name: np.zeros(i.shape, np.float32) for i in s.get_inputs() if i.name.startswith("past_")}

    def feed_kv(kv, outs, names):
        for n, v in zip(names, outs):
            if n.startswith("present_"):
                kv["past_" + n[len("present_"):]] = v

    dec = sess("decode_wgqa")
    dnames = [o.name for o in dec.get_outputs()]

    def step(kv, tok, pos):
        ins = {"inputs_embeds": (E[tok] * esc)[None, None], "per_layer_inputs": (P[tok] * psc).reshape(1, 1, L, Pd),
               "position_ids": np.array([[pos]], np.int32), "cache_position": np.array([pos], np.int32)}
        ins.update(kv)
        outs = dec.run(None, ins)
        feed_kv(kv, outs, dnames)
        return outs[dnames.index("hidden_states")][0, 0]

    worst = 0.0
    for name, s in g["sequences"].items():
        ids = s["ids"]
        kv = zeros_kv(dec)
        ref = gt[f"{name}.logits"]
        for p, t in enumerate(ids):
            lg = logits(step(kv, t, p))
            worst = max(worst, float(np.abs(lg - ref[p]).max() / np.abs(ref[p]).max()))
        # greedy 8 from the prompt
        kv = zeros_kv(dec)
        for p, t in enumerate(ids):
            h = step(kv, t, p)
        out = []
        for k in range(8):
            nxt = int(np.argmax(logits(h)))
            out.append(nxt)
            h = step(kv, nxt, len(ids) + k)
        report["decode"][name] = {"greedy8": out, "golden": s["greedy8"], "equal": out == s["greedy8"]}
    report["decode"]["max_rel_err"] = worst

    tr = sess("trunk")
    tnames = [o.name for o in tr.get_outputs()]
    seq = tr.get_inputs()[0].shape[1]
    worst = 0.0
    for name, s in g["sequences"].items():
        ids = s["ids"]
        kv = zeros_kv(tr)
        ref = gt[f"{name}.logits"]
        for c0 in range(0, len(ids), seq):
            chunk = ids[c0:c0 + seq]
            pad = chunk + [0] * (seq - len(chunk))
            ins = {"inputs_embeds": (E[pad] * esc)[None], "per_layer_inputs": (P[pad] * psc).reshape(1, seq, L, Pd),
                   "position_ids": np.arange(c0, c0 + seq, dtype=np.int32)[None], "valid_len": np.array([len(chunk)], np.int32)}
            ins.update(kv)
            outs = tr.run(None, ins)
            feed_kv(kv, outs, tnames)
            hid = outs[tnames.index("hidden_states")][0]
            for j in range(len(chunk)):
                lg = logits(hid[j])
                worst = max(worst, float(np.abs(lg - ref[c0 + j]).max() / np.abs(ref[c0 + j]).max()))
    report["trunk"]["max_rel_err"] = worst
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])

#!/usr/bin/env python3
"""Independent judge of hexq's QDQ export: onnxruntime runs <variant>.onnx (QuantizeLinear/DequantizeLinear
from hexq's encodings) with a numpy host loop that reads only the artifact directory (host-model/ files via
their sidecar), and compares with hexq's own quantsim (the IR interpreter with fake-quant) position by
position.

usage: ort_qdq.py EXPORT_DIR CASES_JSON [STEP0_JSON]
  CASES_JSON: {"variant": "decode_wgqa", "prompts": [{"id", "ids", "hidden": [[H]...], "top1"}]}
  STEP0_JSON: {tensor: [values]} — every tensor of hexq's quantsim on the second token of the first prompt (at position 0);
              compared with the same tensors (their dequantized copies) inside onnxruntime, element by element.
prints a JSON report; exits non-zero on a failure to run.
"""
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

NP = {"bf16": None, "f16": np.float16, "f32": np.float32, "int8": np.int8}


def load_host(d):
    meta = json.loads((d / "host-model.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    out = {}
    for t in meta["tensors"]:
        raw = np.fromfile(d / t["file"], dtype=np.uint8)
        assert raw.size == t["bytes"], t
        if t["dtype"] == "bf16":
            v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] in ("f16", "f32"):
            v = raw.view(NP[t["dtype"]]).astype(np.float32)
        elif t["dtype"] == "int8":
            s = np.fromfile(d / t["scales"]["file"], dtype=np.float32)
            v = (raw.view(np.int8).astype(np.float32).reshape(len(s), -1) * s[:, None]).ravel()
        elif t["dtype"] == "int4":
            s = np.fromfile(d / t["scales"]["file"], dtype=np.float32)
            lo = (raw & 0xF).astype(np.int8)
            hi = (raw >> 4).astype(np.int8)
            q = np.stack([np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)], -1).ravel()
            v = (q.astype(np.float32).reshape(len(s), -1) * s[:, None]).ravel()
        out[t["name"]] = (v.reshape(t["shape"]), np.float32(t["row_multiplier"]))
    if meta.get("prefix_token") is not None:
        out["__prefix_token__"] = meta["prefix_token"]
    return cfg, out


def step_feeds(cfg, host, t, pos):
    """One decode step's non-KV inputs for token `t` at `pos`, from the host-model/ tables."""
    E, esc = host["embed_tokens.weight"]
    f = {"inputs_embeds": (E[t] * esc)[None, None].astype(np.float32),
         "position_ids": np.array([[pos]], np.int32), "cache_position": np.array([pos], np.int32)}
    Pd = cfg.get("hidden_size_per_layer_input") or 0
    if Pd:
        P, psc = host["embed_tokens_per_layer.weight"]
        f["per_layer_inputs"] = (P[t] * psc).reshape(1, 1, cfg["num_hidden_layers"], Pd).astype(np.float32)
    return f


def prefix(host, kv, ids):
    """Position 0 as hexq's host loop runs it (host-model.json `prefix_token`): when the ids start with that
    token, its f32 K/V go into ring slot 0 of every past_* buffer and its hidden state is taken as is — no
    graph run. Returns position 0's hidden state [1, 1, H], or None."""
    tok = host.get("__prefix_token__")
    if tok is None or not ids or ids[0] != tok:
        return None
    for name in kv:
        k = "prefix." + name
        if k in host:
            kv[name][:, :, 0, :] = host[k][0][:, :, 0, :]
    return host["prefix.hidden_states"][0].reshape(1, 1, -1)


def decode(session, names, cfg, host, ids):
    """Drive a decode graph token by token from empty KV (present_* fed back as past_*), position 0 from the
    host prefix when the export has one; yields each step's outputs, in `names` order."""
    kv = {i.name: np.zeros(i.shape, np.float32) for i in session.get_inputs() if i.name.startswith("past_")}
    h0 = prefix(host, kv, ids)
    for pos, t in enumerate(ids):
        if pos == 0 and h0 is not None:
            yield [h0 if n == "hidden_states" else kv.get("past_" + n[len("present_"):]) for n in names]
            continue
        outs = session.run(None, {**step_feeds(cfg, host, t, pos), **kv})
        for n, v in zip(names, outs):
            if n.startswith("present_"):
                kv["past_" + n[len("present_"):]] = v
        yield outs


def tensor_by_tensor(path, feeds, dump, enc):
    """Every encoded activation of one decode call: onnxruntime's DequantizeLinear output vs hexq's quantsim
    value. Same arithmetic ⇒ identical, except where an f32 sum order (MatMul, ReduceMean) or a
    transcendental's last ulp lands a value on the other side of a rounding boundary: one step apart."""
    m = onnx.load(path)
    prod = {o for n in m.graph.node for o in n.output}
    outs = {o.name for o in m.graph.output}
    pairs = [(k, k + ".dq" if k + ".dq" in prod else k) for k in dump if k in enc]
    pairs = [(k, c) for k, c in pairs if c in prod]
    for _, c in pairs:
        if c not in outs:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(c))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    res = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    diff = {}
    r = {"tensors": len(pairs), "identical_tensors": 0, "elements": 0, "differing_elements": 0,
         "origins": 0, "origin_max_steps": 0.0}
    for k, c in pairs:
        a, b = np.asarray(dump[k], np.float32).ravel(), res[c].astype(np.float32).ravel()
        d = a != b
        r["elements"] += a.size
        r["differing_elements"] += int(d.sum())
        r["identical_tensors"] += int(not d.any())
        if d.any():
            diff[k] = float(np.abs(a - b).max() / enc[k][0]["scale"])
    # An origin: a tensor that differs although every input of its node agrees. Same arithmetic ⇒ an origin
    # is a value on a rounding boundary (f32 sum order, a transcendental's last ulp): exactly one step apart.
    node_of = {n.output[0]: n for n in m.graph.node}
    producer = lambda k: node_of.get(k + ".float") or node_of[k]  # a graph output's op writes <name>.float
    for k, steps in diff.items():
        n = producer(k)
        ins = [i[:-3] if i.endswith(".dq") else i for i in n.input]
        if not any(i in diff for i in ins):
            r["origins"] += 1
            r["origin_max_steps"] = max(r["origin_max_steps"], steps)
    r["origin_tensors"] = sorted(k for k in diff if not any(
        (i[:-3] if i.endswith(".dq") else i) in diff for i in producer(k).input))[:20]
    return r


def main(exp, cases, step0=None):
    exp = Path(exp)
    spec = json.loads(Path(cases).read_text())
    cfg, host = load_host(exp / "host-model")
    E, _ = host["embed_tokens.weight"]
    cap = cfg.get("final_logit_softcapping")
    path = str(exp / f"{spec['variant']}.onnx")
    onnx.checker.check_model(path, full_check=True)
    m = onnx.load(path, load_external_data=False)
    ops = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    qtypes = sorted({onnx.TensorProto.DataType.Name(t.data_type) for t in m.graph.initializer
                     if t.name.endswith(".zero_point")})
    # Optimizations off, as in hexq's ort backend: onnxruntime's fused QDQ kernels change the arithmetic
    # (integer MatMul with requantization), and the QDQ graph is the specification being judged.
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]

    def head(h):
        l = h.astype(np.float64) @ E.T.astype(np.float64)
        return np.tanh(l / cap) * cap if cap else l

    if step0:
        # onnx.load resolves external data relative to the model file.
        # the prompt's second token: its first (BOS) is the host prefix and never runs through the graph
        feeds = step_feeds(cfg, host, spec["prompts"][0]["ids"][1], 0)
        feeds.update({i.name: np.zeros(i.shape, np.float32) for i in s.get_inputs() if i.name.startswith("past_")})
        enc = json.loads((exp / f"{spec['variant']}.encodings.json").read_text())["activation_encodings"]
        step0_report = tensor_by_tensor(path, feeds, json.loads(Path(step0).read_text()), enc)
    rep = {"variant": spec["variant"], "qdq_ops": {k: ops.get(k, 0) for k in ("QuantizeLinear", "DequantizeLinear")},
           "zero_point_types": qtypes, "prompts": []}
    for p in spec["prompts"]:
        cos = []
        h = None
        for pos, outs in enumerate(decode(s, names, cfg, host, p["ids"])):
            h = outs[names.index("hidden_states")][0, 0].astype(np.float64)
            ref = np.asarray(p["hidden"][pos], np.float64)
            cos.append(float(h @ ref / (np.linalg.norm(h) * np.linalg.norm(ref) + 1e-30)))
        lo = head(h)
        rep["prompts"].append({"id": p["id"], "tokens": len(p["ids"]), "cos_min": min(cos), "cos": cos, "cos_mean": float(np.mean(cos)),
                               "top1_ort": int(lo.argmax()), "top1_hexq": p["top1"],
                               "margin_ort": float(np.sort(lo)[-1] - np.sort(lo)[-2])})
    ps = rep["prompts"]
    rep["cos_min"] = min(x["cos_min"] for x in ps)
    rep["cos_mean"] = float(np.mean([x["cos_mean"] for x in ps]))
    rep["top1_equal"] = sum(x["top1_ort"] == x["top1_hexq"] for x in ps)
    rep["n"] = len(ps)
    if step0:
        rep["step0"] = step0_report
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

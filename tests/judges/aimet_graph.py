#!/usr/bin/env python3
"""Independent judge of hexq's A16W8 encodings on the whole exported graph: aimet-onnx QuantizationSimModel
(min_max, int16 activations, int8 per-channel weights) built on hexq's *float* ONNX export, calibrated by
decode loops this script drives itself (host-model/ lookups, present_* fed back as past_*) over the same
chat-formatted token sequences hexq calibrated on; then every quantizer AIMET has is compared with hexq's
encoding of the same tensor name, in LSBs.

With HEXQ_STATS (hexq's calibration stats of the same graph) a second QuantSim on the same ONNX is given hexq's
observed range of every activation (and the weights themselves) instead of running forward passes: that
separates AIMET's encoding rules (quantizer placement, ties, symmetry, minimum scale, rounding) from the two
engines' f32 forward arithmetic. Reported under "same_ranges".

usage: aimet_graph.py EXPORT_DIR HEXQ_ENCODINGS TOKENS_JSON OUT_JSON [HEXQ_STATS [OTHER_ENCODINGS]]
  TOKENS_JSON: [[ids of prompt 1], [ids of prompt 2], ...]
  OTHER_ENCODINGS: a second hexq encodings file (e.g. calibrated by the other engine), compared against the
  same AIMET forward; reported under "other".
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).parent))
from ort_qdq import decode, load_host  # noqa: E402


def same_ranges(model, stats):
    """AIMET's encodings when every activation quantizer sees exactly hexq's observed [min, max] (tied
    quantizers share one object, so they see the union, as in a forward pass) and every param quantizer its
    weight tensor."""
    from aimet_onnx.quantsim import QuantizationSimModel, compute_encodings
    from onnx import numpy_helper

    sim = QuantizationSimModel(model, param_type="int8", activation_type="int16", quant_scheme="min_max")
    inits = {t.name: t for t in model.graph.initializer}
    missing = []
    with compute_encodings(sim):
        for name, q in sim.qc_quantize_op_dict.items():
            if not q.enabled:
                continue
            if name in sim.activation_names and name in stats:
                r = stats[name]
                q.update_encoding_stats(np.array([r["min"], r["max"]], np.float32))
                continue
            if name in inits:
                q.update_encoding_stats(np.ascontiguousarray(numpy_helper.to_array(inits[name]), np.float32))
                continue
            missing.append(name)
            q.enabled = False
    d = tempfile.mkdtemp()
    sim.export(d, "judge")
    return json.loads((Path(d) / "judge.encodings").read_text()), missing


def compare(ae, ours):
    theirs = {e["name"]: e for e in ae["activation_encodings"] + ae["param_encodings"]}
    mine = {**ours["activation_encodings"], **ours["param_encodings"]}
    rep = {"aimet_quantizers": len(theirs), "hexq_encodings": len(mine), "compared": 0, "within_1_lsb": 0,
           "bitwidth_mismatch": [], "worst": [], "aimet_only": sorted(set(theirs) - set(mine))[:50],
           "hexq_only_count": len(set(mine) - set(theirs))}
    worst = []
    # hexq ties the KV write (past, new row → present) into one encoding because HTP's select needs it
    # (compile-scripts/README.md); aimet-onnx does not tie Where. Those members are listed, not compared.
    ties = ours.get("hexq", {}).get("tie_groups", {})
    kv_write = sorted(m for m, r in ties.items() if r.startswith("present_"))
    rep["kv_write_tied_not_compared"] = kv_write
    # hexq encodes masked softmax inputs from min(scores) - 32 up (quantize/src/lib.rs); AIMET's min-max spans
    # the mask constant. Listed, not compared.
    floored = sorted(ours.get("hexq", {}).get("mask_floored", {}))
    rep["mask_floored_not_compared"] = floored
    for name, a in theirs.items():
        if name not in mine or name in kv_write or name in floored:
            continue
        h = mine[name]
        a_scale = np.atleast_1d(np.asarray(a["scale"], np.float64))
        a_off = np.atleast_1d(np.asarray(a["offset"], np.float64))
        if a["bw"] != h[0]["bitwidth"] or len(a_scale) != len(h):
            rep["bitwidth_mismatch"].append([name, a["bw"], h[0]["bitwidth"], len(a_scale), len(h)])
            continue
        h_scale = np.asarray([x["scale"] for x in h])
        h_min = np.asarray([x["min"] for x in h])
        h_max = np.asarray([x["max"] for x in h])
        a_min = a_off * a_scale
        a_max = a_min + a_scale * (2 ** a["bw"] - 1)
        dev = np.maximum(np.abs(a_min - h_min), np.abs(a_max - h_max))
        lsb = dev / h_scale
        m = float(lsb.max())
        rel = float((dev / (h_max - h_min)).max())
        kind = "params" if name in ours["param_encodings"] else "activations"
        k = rep.setdefault(kind, {"compared": 0, "within_1_lsb": 0, "within_16_lsb": 0, "max_lsb": 0.0, "max_rel_range": 0.0,
                                  "symmetric_both": 0, "symmetric_mismatch": []})
        k["compared"] += 1
        k["within_1_lsb"] += int(m <= 1.0)
        k["within_16_lsb"] += int(m <= 16.0)
        k["max_lsb"] = max(k["max_lsb"], m)
        k["max_rel_range"] = max(k["max_rel_range"], rel)
        a_sym = a["is_sym"] if isinstance(a["is_sym"], bool) else a["is_sym"] == "True"
        h_sym = h[0]["is_symmetric"] in (True, "True")
        if a_sym != h_sym:
            k["symmetric_mismatch"].append(name)
        k["symmetric_both"] += int(a_sym and h_sym)
        rep["compared"] += 1
        rep["within_1_lsb"] += int(m <= 1.0)
        worst.append((m, name, {"aimet": [float(a_min[0]), float(a_max[0]), float(a_scale[0])],
                                "hexq": [float(h_min[0]), float(h_max[0]), float(h_scale[0])]}))
    worst.sort(key=lambda w: -w[0])
    rep["worst"] = worst[:10]
    rep["detail"] = {w[1]: w[2] | {"lsb": w[0]} for w in worst}
    rep["failing"] = [w[1] for w in worst if w[0] > 1.0]
    return rep


def main(exp, hexq_enc, tokens, out, hexq_stats=None, other_enc=None):
    from aimet_onnx.quantsim import QuantizationSimModel

    exp = Path(exp)
    variant = json.loads((exp / "manifest.json").read_text())["variant"]
    cfg, host = load_host(exp / "host-model")
    seqs = json.loads(Path(tokens).read_text())
    model = onnx.load(str(exp / f"{variant}.onnx"))
    sim = QuantizationSimModel(model, param_type="int8", activation_type="int16", quant_scheme="min_max")

    def loops(session):
        # The sim renames quantized outputs (e.g. "<name>_updated"); they keep the float model's order.
        names = [o.name for o in model.graph.output]
        assert len(names) == len(session.get_outputs())
        for ids in seqs:
            for _ in decode(session, names, cfg, host, ids):
                pass

    sim.compute_encodings(loops)
    d = tempfile.mkdtemp()
    sim.export(d, "judge")
    ours = json.loads(Path(hexq_enc).read_text())
    ae = json.loads((Path(d) / "judge.encodings").read_text())
    rep = compare(ae, ours)
    if other_enc:
        rep["other"] = compare(ae, json.loads(Path(other_enc).read_text()))
    if hexq_stats:
        stats = json.loads(Path(hexq_stats).read_text())["tensors"]
        ae, missing = same_ranges(onnx.load(str(exp / f"{variant}.onnx")), stats)
        r = compare(ae, ours)
        r["activations_without_hexq_range"] = missing
        rep["same_ranges"] = r
    Path(out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

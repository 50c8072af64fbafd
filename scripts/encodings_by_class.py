#!/usr/bin/env python3
"""Where the A16W8 error comes from: from one encodings file, write subsets that quantize one class of tensors
and leave the rest in float (hexq's quantsim fake-quantizes exactly the tensors an encodings file names), for
`hexq verify --encodings <subset>` side by side.

  weights      every param encoding, no activation
  activations  every activation encoding, no param
  stream       only the residual stream (inputs_embeds, attn_residual, mlp_residual, hidden_states)
  norm-out     only the RMSNorm outputs (*layernorm.out)
  norm-inner   only RMSNorm's internals (sq, ms, ms_eps, rms, inv_rms, normed)
  mlp          only the MLP's internals (gate/up/down projections, GELU pieces)
  attention    only attention's internals (projections, heads, scores, probs)
  rope         only the rotary pieces

usage: encodings_by_class.py ENC.json OUT_DIR   → OUT_DIR/<class>.enc.json
"""
import copy
import json
import sys
from pathlib import Path

NORM = ("sq", "ms", "ms_eps", "rms", "inv_rms", "normed")
MLP = ("gate_proj", "up_proj", "gated", "u", "x3", "cx3", "inner2", "sigmoid", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "attn", "attn_flat", "attn_heads", "attn_t", "k_heads", "k_t",
        "keys_t", "probs", "q_grouped", "q_heads", "q_t", "scores", "scores_masked", "v_heads", "v_t")
ROPE = ("x1", "x2", "neg_x2", "rot", "rotsin", "xcos")
STREAM = ("inputs_embeds", "attn_residual", "mlp_residual", "hidden_states")
last = lambda k: k.split(".")[-1]
CLASSES = {
    "weights": (lambda k: False, True),
    "activations": (lambda k: True, False),
    "stream": (lambda k: last(k) in STREAM, False),
    "norm-out": (lambda k: k.endswith("layernorm.out"), False),
    "norm-inner": (lambda k: last(k) in NORM, False),
    "mlp": (lambda k: last(k) in MLP, False),
    "attention": (lambda k: last(k) in ATTN, False),
    "rope": (lambda k: last(k) in ROPE, False),
}

enc = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for name, (act, params) in CLASSES.items():
    e = copy.deepcopy(enc)
    e["activation_encodings"] = {k: v for k, v in enc["activation_encodings"].items() if act(k)}
    if not params:
        e["param_encodings"] = {}
    (out / f"{name}.enc.json").write_text(json.dumps(e))
    print(name, len(e["activation_encodings"]), len(e["param_encodings"]))

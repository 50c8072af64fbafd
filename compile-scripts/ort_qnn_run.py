#!/usr/bin/env python3
"""Run a compiled EPContext ONNX (ort_qnn_compile.py) on the QNN HTP simulator through onnxruntime-qnn, driving
a decode loop with the host-model/ files, and compare every step's hidden state with onnxruntime CPU on the
QDQ ONNX it was compiled from (the same quantized graph): the offline answer to "does HTP match quantsim?".

usage: ort_qnn_run.py CTX.onnx QDQ.onnx HOST_MODEL_DIR ARCH   (CTX.onnx: <variant>_<target>.onnx from hexq compile; ARCH 79|81)   → JSON (load time, s/step, per-step cosine)
"""
import sys, json, time, numpy as np, onnxruntime as ort, onnxruntime_qnn as oq
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parent.parent / 'tests' / 'judges'))
from ort_qdq import load_host
from pathlib import Path
ctx, qdq, hostdir, arch = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
ids = [2, 105, 2364, 107, 1000, 1200, 1300, 1400, 300, 301, 302, 303, 106, 107, 105, 4368, 107, 500, 501, 502, 503, 504]
ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
so = ort.SessionOptions(); so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
so.add_provider_for_devices(devs[:1], {"backend_path": oq.get_qnn_htp_path(), "htp_arch": arch})
t0 = time.time(); htp = ort.InferenceSession(ctx, so); t_load = time.time() - t0
cso = ort.SessionOptions(); cso.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # QDQ fusions change the arithmetic
cpu = ort.InferenceSession(qdq, cso, providers=["CPUExecutionProvider"])
cfg, host = load_host(hostdir); E, esc = host['embed_tokens.weight']; P, psc = host['embed_tokens_per_layer.weight']
L, Pd = cfg['num_hidden_layers'], cfg['hidden_size_per_layer_input']
def loop(s):
    names = [o.name for o in s.get_outputs()]
    kv = {i.name: np.zeros(i.shape, np.float32) for i in s.get_inputs() if i.name.startswith('past_')}
    hs = []; t = time.time()
    for pos, tok in enumerate(ids):
        f = {'inputs_embeds': (E[tok]*esc)[None,None].astype(np.float32), 'per_layer_inputs': (P[tok]*psc).reshape(1,1,L,Pd).astype(np.float32),
             'position_ids': np.array([[pos]], np.int32), 'cache_position': np.array([pos], np.int32)}
        f.update(kv)
        out = s.run(None, f)
        for n, v in zip(names, out):
            if n.startswith('present_'): kv['past_' + n[8:]] = v
        hs.append(out[names.index('hidden_states')].ravel().astype(np.float64))
    return hs, (time.time() - t) / len(ids)
hh, th = loop(htp); hc, tc = loop(cpu)
cos = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(hh, hc)]
print(json.dumps({"arch": arch, "load_s": round(t_load, 2), "htp_s_per_step": round(th, 3), "cpu_s_per_step": round(tc, 4),
                  "cos_min": min(cos), "cos_mean": float(np.mean(cos)), "cos": [round(c, 5) for c in cos]}))

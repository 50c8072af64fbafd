#!/usr/bin/env python3
"""Load a compiled EPContext graph (hexq compile) on the QNN HTP backend and time N calls with synthetic inputs
(random embeddings, zero KV, position 0): context load time, seconds per step, whether the output is finite.
For binaries too large for a held-out verify run on the simulator.

usage: ort_qnn_step.py CTX.onnx ARCH N
"""
import sys, time, json, numpy as np, onnxruntime as ort, onnxruntime_qnn as oq
ctx, arch, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
so = ort.SessionOptions(); so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
so.add_provider_for_devices(devs[:1], {"backend_path": oq.get_qnn_htp_path(), "htp_arch": arch})
t0 = time.time(); s = ort.InferenceSession(ctx, so); tl = time.time() - t0
rng = np.random.default_rng(0)
f = {}
for i in s.get_inputs():
    shp = [d if isinstance(d, int) else 1 for d in i.shape]
    f[i.name] = (np.zeros(shp, np.int32) if 'int32' in i.type else (rng.standard_normal(shp).astype(np.float32) * (0.0 if i.name.startswith('past_') else 1.0)))
ts = []
for k in range(n):
    t = time.time(); out = s.run(['hidden_states'], f); ts.append(time.time() - t)
h = out[0].ravel()
print(json.dumps({"load_s": round(tl, 1), "step_s": [round(x, 1) for x in ts], "hidden_finite": bool(np.isfinite(h).all()), "hidden_norm": float(np.linalg.norm(h))}))

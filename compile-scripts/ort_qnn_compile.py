#!/usr/bin/env python3
"""Compile a QDQ ONNX (hexq export --qdq) into a QNN HTP context binary offline with the QNN HTP backend that
PyPI's onnxruntime-qnn ships (x86-64; no device, no QAIRT SDK), as an EPContext ONNX + <name>_qnn.bin, and
report where every node landed. Fails if any node falls back to the CPU.

usage: ort_qnn_compile.py MODEL.onnx OUT_DIR --arch 79|81|75 [--json]
"""
import argparse
import os
import json
import re
import sys
import time
from pathlib import Path

SOC = {"73": "SM8550", "75": "SM8650", "79": "SM8750", "81": "SM8850"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--arch", required=True, choices=sorted(SOC))
    a = ap.parse_args()
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(a.model).stem
    ctx = out / f"{stem}_v{a.arch}_ctx.onnx"
    ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
    if not devs:
        sys.exit(f"no {oq.EP_NAME} device after registering {oq.get_library_path()}")
    so = ort.SessionOptions()
    if os.environ.get("HEXQ_QNN_VERBOSE"):
        so.log_severity_level = 0
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(ctx))
    so.add_session_config_entry("ep.context_embed_mode", "0")
    so.add_provider_for_devices(devs[:1], {"backend_path": oq.get_qnn_htp_path(), "htp_arch": a.arch,
                                           "htp_graph_finalization_optimization_mode": "3"})
    t0 = time.time()
    err = None
    try:
        ort.InferenceSession(a.model, so)
    except Exception as e:  # the EP's message lists the unsupported nodes
        err = str(e)
    rep = {"model": a.model, "arch": a.arch, "seconds": round(time.time() - t0, 2), "ok": err is None}
    if err:
        rep["error"] = err[-4000:]
    else:
        bins = sorted(out.glob(f"{stem}_v{a.arch}_ctx*.bin")) or sorted(out.glob("*.bin"))
        rep["context_onnx"] = str(ctx)
        rep["binaries"] = []
        for b in bins:
            s = b.read_bytes()
            m = re.search(rb"soc_type=(\w+);arch=(\d+)", s)
            rep["binaries"].append({"file": str(b), "bytes": len(s), "soc": m and m.group(1).decode(),
                                    "arch": m and m.group(2).decode()})
    print(json.dumps(rep, indent=1))
    sys.exit(0 if rep["ok"] else 1)


if __name__ == "__main__":
    main()

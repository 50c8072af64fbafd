#!/usr/bin/env python3
"""Compile a QDQ ONNX (`hexq export --qdq`) into a QNN HTP context binary offline, with the QNN HTP backend that
PyPI's onnxruntime-qnn ships (x86-64; no device, no QAIRT SDK): writes OUT/NAME.bin (the QNN context binary) and
OUT/NAME.onnx (the EPContext graph that points at it), and prints a JSON report (seconds, the binary's embedded
soc_type/arch, node placement). Every node must land on HTP: CPU fallback is disabled, and on failure the report
lists the nodes the QNN EP refused and its reasons.

usage: ort_qnn_compile.py MODEL.onnx OUT_DIR --target v79|v81|v75 [--name NAME] [--targets htp_targets.json]
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--target", required=True)
    ap.add_argument("--name")
    ap.add_argument("--targets", default=str(Path(__file__).with_name("htp_targets.json")))
    a = ap.parse_args()
    table = json.loads(Path(a.targets).read_text())
    if a.target not in table or a.target.startswith("_"):
        sys.exit(f"{a.targets}: unknown target {a.target!r} (have {', '.join(k for k in table if not k.startswith('_'))})")
    t = table[a.target]
    import onnx
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = a.name or f"{Path(a.model).stem}_{a.target}"
    work = Path(tempfile.mkdtemp(prefix=".ortqnn-", dir=out))
    ctx = work / f"{name}_ctx.onnx"
    ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
    if not devs:
        sys.exit(f"no {oq.EP_NAME} device after registering {oq.get_library_path()}")
    so = ort.SessionOptions()
    so.log_severity_level = 0  # verbose: the EP names each refused node and its reason only at this level
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(ctx))
    so.add_session_config_entry("ep.context_embed_mode", "0")
    opts = {"backend_path": oq.get_qnn_htp_path(), "htp_arch": str(t["htp_arch"]),
            "htp_graph_finalization_optimization_mode": str(t["optimization_level"]),
            "vtcm_mb": str(t["vtcm_mb"]), "enable_htp_fp16_precision": "1" if t["fp16_relaxed_precision"] else "0"}
    so.add_provider_for_devices(devs[:1], opts)
    # onnxruntime logs the refused nodes on stderr (fd 2): capture it to name them in the report.
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    t0 = time.time()
    err = None
    try:
        ort.InferenceSession(a.model, so)
    except Exception as e:
        err = str(e)
    finally:
        os.dup2(saved, 2)
    log.seek(0)
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read().decode(errors="replace"))
    if os.environ.get("HEXQ_QNN_VERBOSE"):
        sys.stderr.write(text)
    rep = {"model": a.model, "target": a.target, "soc": t["soc"], "htp_arch": t["htp_arch"], "options": opts,
           "onnxruntime": ort.__version__, "seconds": round(time.time() - t0, 2), "ok": err is None}
    m = onnx.load(a.model, load_external_data=False)
    rep["nodes"] = len(m.graph.node)
    # "Validation FAILED for N nodes in OrtNodeUnit (Op) :" / "Operator type: Op Node name: X Node index: i" /
    # "REASON : …", and the error-level "Unsupported nodes in QNN EP: { name: X, type: Op }" summary.
    refused = {}
    for m_ in re.finditer(r"Operator type: (\w+) Node name: (.*?) Node index: \d+\s*\n\s*REASON : ([^\n]*)", text):
        refused.setdefault(m_.group(2).strip(), {"name": m_.group(2).strip(), "op": m_.group(1), "reason": m_.group(3).strip()})
    for n_, o_ in re.findall(r"\{ name: ([^,]+), type: (\w+) \}", text):
        refused.setdefault(n_, {"name": n_, "op": o_})
    if err:
        rep["error"] = err[-2000:]
        rep["nodes_off_htp"] = list(refused.values())
        rep["reasons"] = sorted(set(l.strip()[-400:] for l in text.splitlines()
                                    if re.search(r"\[E:", l)))[:20]
        print(json.dumps(rep, indent=1))
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
        sys.exit(1)
    # The EPContext graph: one EPContext node per compiled partition, all with source QNN; anything else ran on CPU.
    cm = onnx.load(str(ctx))
    ops = [n.op_type for n in cm.graph.node]
    rep["nodes_off_htp"] = [{"name": n.name, "op": n.op_type} for n in cm.graph.node if n.op_type != "EPContext"]
    bins = sorted(work.glob("*.bin"))
    if len(bins) != 1 or ops.count("EPContext") != 1:
        rep["ok"] = False
        rep["error"] = f"expected one EPContext node and one .bin, got {ops} and {[b.name for b in bins]}"
        print(json.dumps(rep, indent=1))
        sys.exit(1)
    binp = out / f"{name}.bin"
    os.replace(bins[0], binp)
    for n in cm.graph.node:
        for at in n.attribute:
            if at.name == "ep_cache_context":
                at.s = binp.name.encode()
    onnx.save(cm, str(out / f"{name}.onnx"))
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    s = binp.read_bytes()
    mm = re.search(rb"soc_type=(\w+);arch=(\d+)", s)
    rep.update({"bin": binp.name, "onnx": f"{name}.onnx", "bytes": len(s),
                "embedded_soc": mm and mm.group(1).decode(), "embedded_arch": mm and int(mm.group(2))})
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()

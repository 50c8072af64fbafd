#!/usr/bin/env python3
"""Compile a QDQ ONNX (`hexq export --qdq`) into a QNN HTP context binary offline, with the QNN HTP backend that
PyPI's onnxruntime-qnn ships (x86-64; no device, no QAIRT SDK): writes OUT/NAME.bin (the QNN context binary) and
OUT/NAME.onnx (the EPContext graph that points at it), and prints a JSON report (seconds, the binary's embedded
soc_type/arch, node placement). Every node must land on HTP: CPU fallback is disabled, and on failure the report
lists the nodes the QNN EP refused and its reasons.

usage: ort_qnn_compile.py MODEL.onnx OUT_DIR --target v79|v81|v75 [--name NAME] [--targets htp_targets.json]
       ort_qnn_compile.py A.onnx B.onnx OUT_DIR --target T --names A_T,B_T --bin-name SHARED_T
         several models → one context binary holding every graph, static tensors stored once (onnxruntime's
         EPContext weight sharing, ep.share_ep_contexts), and one EPContext graph per model pointing at it.
"""
import argparse
import json
import os
import pathlib
import re
import resource
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="one QDQ ONNX, or several to share one context binary")
    ap.add_argument("out")
    ap.add_argument("--target", required=True)
    ap.add_argument("--name", help="one model: the output stem (default MODEL_TARGET)")
    ap.add_argument("--names", help="several models: comma-separated EPContext graph stems, one per model")
    ap.add_argument("--bin-name", help="several models: the shared binary's stem")
    ap.add_argument("--targets", default=str(Path(__file__).with_name("htp_targets.json")))
    a = ap.parse_args()
    table = json.loads(Path(a.targets).read_text())
    if a.target not in table or a.target.startswith("_"):
        sys.exit(f"{a.targets}: unknown target {a.target!r} (have {', '.join(k for k in table if not k.startswith('_'))})")
    t = table[a.target]
    import onnx
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    shared = len(a.models) > 1
    if shared:
        names = a.names.split(",") if a.names else []
        if len(names) != len(a.models) or not a.bin_name:
            sys.exit("several models need --names (one per model) and --bin-name")
    else:
        names = [a.name or f"{Path(a.models[0]).stem}_{a.target}"]
    bin_stem = a.bin_name if shared else names[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".ortqnn-", dir=out)).resolve()
    ort.register_execution_provider_library(oq.EP_NAME, oq.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == oq.EP_NAME]
    if not devs:
        sys.exit(f"no {oq.EP_NAME} device after registering {oq.get_library_path()}")
    opts = {"backend_path": oq.get_qnn_htp_path(), "htp_arch": str(t["htp_arch"]),
            "htp_graph_finalization_optimization_mode": str(t["optimization_level"]),
            "vtcm_mb": str(t["vtcm_mb"]), "enable_htp_fp16_precision": "1" if t["fp16_relaxed_precision"] else "0"}
    rep = {"models": a.models, "target": a.target, "soc": t["soc"], "htp_arch": t["htp_arch"], "options": opts,
           "onnxruntime": ort.__version__, "shared": shared, "ok": True, "graphs": []}
    t0 = time.time()
    for i, (model, name) in enumerate(zip(a.models, names)):
        ctx = work / f"{name}_ctx.onnx"
        so = ort.SessionOptions()
        so.log_severity_level = 0  # verbose: the EP names each refused node and its reason only at this level
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(ctx))
        so.add_session_config_entry("ep.context_embed_mode", "0")
        if shared:
            # onnxruntime's EPContext weight sharing: sessions created with share_ep_contexts add their graphs
            # to one QNN context (identical static tensors stored once); the last one stops sharing and
            # writes the context binary every EPContext graph points at.
            so.add_session_config_entry("ep.share_ep_contexts", "1")
            if i == len(a.models) - 1:
                so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
        so.add_provider_for_devices(devs[:1], opts)
        g = compile_one(ort, onnx, so, model, ctx, i)
        g["name"] = name
        rep["graphs"].append(g)
        if not g["ok"]:
            rep["ok"] = False
            rep["error"] = g.pop("error")
            break
    rep["seconds"] = round(time.time() - t0, 2)
    bins = sorted(work.glob("*.bin"))
    if rep["ok"] and len(bins) != 1:
        rep["ok"] = False
        rep["error"] = f"expected one context binary, got {[b.name for b in bins]}"
    if not rep["ok"]:
        # the single-model report keeps its old top-level fields
        if not shared:
            rep.update({k: rep["graphs"][0][k] for k in ("nodes_off_htp", "reasons", "nodes") if k in rep["graphs"][0]})
        rep["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(rep, indent=1))
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
        sys.exit(1)
    binp = out / f"{bin_stem}.bin"
    os.replace(bins[0], binp)
    for g in rep["graphs"]:
        cm = onnx.load(str(work / f"{g['name']}_ctx.onnx"))
        for n in cm.graph.node:
            for at in n.attribute:
                if at.name == "ep_cache_context":
                    at.s = binp.name.encode()
        onnx.save(cm, str(out / f"{g['name']}.onnx"))
        g["onnx"] = f"{g['name']}.onnx"
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    s = binp.read_bytes()
    mm = re.search(rb"soc_type=(\w+);arch=(\d+)", s)
    rep.update({"bin": binp.name, "bytes": len(s),
                "embedded_soc": mm and mm.group(1).decode(), "embedded_arch": mm and int(mm.group(2))})
    # The graphs the binary holds, read from the binary itself: each EPContext partition name appears in it.
    for g in rep["graphs"]:
        g["in_binary"] = g["partition"].encode() in s
    if not shared:
        g = rep["graphs"][0]
        rep.update({"model": a.models[0], "onnx": g["onnx"], "nodes": g["nodes"], "nodes_off_htp": g["nodes_off_htp"]})
    # for the caller's stage table (hexq build), never written into an artifact
    rep["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(rep, indent=1))


def compile_one(ort, onnx, so, model, ctx, index=0):
    """One session: compile `model` into the EPContext graph `ctx`; node placement and refusals."""
    # onnxruntime logs the refused nodes on stderr (fd 2): capture it to name them in the report.
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    err = None
    t0 = time.time()
    try:
        # From bytes, not from the path: onnxruntime names each compiled partition (and so the QNN graph in
        # the context binary) after a hash of the model's path (core/framework/model_metadef_id_generator.cc),
        # so a path-loaded export compiled in two directories gave two binaries. The external data is found
        # through the folder option instead.
        # The folder is given relatively from inside it (".", then "./." for a second model sharing one
        # context, …): onnxruntime takes it as the model's path and the partition name hashes it, so the
        # name is the same in any directory and distinct for each graph of a shared context.
        data = pathlib.Path(model).read_bytes()
        here = os.getcwd()
        os.chdir(pathlib.Path(model).resolve().parent)
        try:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                        "/".join(["."] * (index + 1)))
            ort.InferenceSession(data, so)
        finally:
            os.chdir(here)
    except Exception as e:
        err = str(e)
    finally:
        os.dup2(saved, 2)
    log.seek(0)
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read().decode(errors="replace"))
    if os.environ.get("HEXQ_QNN_VERBOSE"):
        sys.stderr.write(text)
    m = onnx.load(model, load_external_data=False)
    g = {"model": model, "nodes": len(m.graph.node), "seconds": round(time.time() - t0, 2), "ok": err is None}
    # "Validation FAILED for N nodes in OrtNodeUnit (Op) :" / "Operator type: Op Node name: X Node index: i" /
    # "REASON : …", and the error-level "Unsupported nodes in QNN EP: { name: X, type: Op }" summary.
    refused = {}
    for m_ in re.finditer(r"Operator type: (\w+) Node name: (.*?) Node index: \d+\s*\n\s*REASON : ([^\n]*)", text):
        refused.setdefault(m_.group(2).strip(), {"name": m_.group(2).strip(), "op": m_.group(1), "reason": m_.group(3).strip()})
    for n_, o_ in re.findall(r"\{ name: ([^,]+), type: (\w+) \}", text):
        refused.setdefault(n_, {"name": n_, "op": o_})
    if err:
        g["error"] = err[-2000:]
        g["nodes_off_htp"] = list(refused.values())
        g["reasons"] = sorted(set(l.strip()[-400:] for l in text.splitlines() if re.search(r"\[E:", l)))[:20]
        return g
    # The EPContext graph: one EPContext node per compiled partition, all with source QNN; anything else ran on CPU.
    cm = onnx.load(str(ctx))
    ops = [n.op_type for n in cm.graph.node]
    g["nodes_off_htp"] = [{"name": n.name, "op": n.op_type} for n in cm.graph.node if n.op_type != "EPContext"]
    if ops.count("EPContext") != 1:
        g["ok"] = False
        g["error"] = f"expected one EPContext node, got {ops}"
        return g
    n = [n for n in cm.graph.node if n.op_type == "EPContext"][0]
    g["partition"] = next(at.s.decode() for at in n.attribute if at.name == "partition_name")
    return g


if __name__ == "__main__":
    main()

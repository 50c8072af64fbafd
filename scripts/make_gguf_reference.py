#!/usr/bin/env python3
"""What llama.cpp's own tools write for the tiny fixture, committed as the reference hexq's GGUF writer is
tested against (tests/fixtures/gguf/*.json): every metadata key (order, type, value) and every tensor (name,
type, shape) of

  convert_hf_to_gguf.py tests/fixtures/tiny-gemma4 --outtype f16           → reference.f16.json
  convert_hf_to_gguf.py --outtype q8_0                                     → reference.q8_0.json
and of the bf16 copy (tests/fixtures/tiny-gemma4-bf16, what real checkpoints are):
  convert_hf_to_gguf.py --outtype bf16, then llama-quantize <bf16> Q4_0     → reference.q4_0.json
  … llama-quantize --pure <bf16> Q4_0                                      → reference.q4_0-pure.json
(each tensor with the SHA256 of its data: hexq's must be bit-identical)

llama.cpp: the tree vendored by the llama-cpp-python 0.3.36 sdist (see ../shared/docs/reference-tools.md),
converter run with its own gguf-py on PYTHONPATH; transformers 5.23.0 + torch installed.

usage: make_gguf_reference.py LLAMA_CPP_DIR OUT_DIR
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dump(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    keys = []
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        types = [t.name for t in f.types]
        keys.append({"key": k, "type": types, "value": f.contents()})
    import hashlib

    import numpy as np

    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(x) for x in t.shape],
                "sha256": hashlib.sha256(np.ascontiguousarray(t.data).view(np.uint8).tobytes()).hexdigest()}
               for t in r.tensors]
    return {"alignment": 32, "keys": keys, "tensors": tensors}


def main(llama, out):
    llama, out = Path(llama), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(llama / "gguf-py")}
    import os

    env = {**os.environ, **env}
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        model = ROOT / "tests/fixtures/tiny-gemma4"
        for outtype in ["f16", "q8_0"]:
            subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
                            "--outfile", str(t / f"{outtype}.gguf")], check=True, env=env, capture_output=True)
            (out / f"reference.{outtype}.json").write_text(json.dumps(dump(t / f"{outtype}.gguf"), indent=0))
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(ROOT / "tests/fixtures/tiny-gemma4-bf16"),
                        "--outtype", "bf16", "--outfile", str(t / "bf16.gguf")], check=True, env=env, capture_output=True)
        q = llama / "build/bin/llama-quantize"
        subprocess.run([str(q), str(t / "bf16.gguf"), str(t / "q4_0.gguf"), "Q4_0"], check=True, capture_output=True)
        subprocess.run([str(q), "--pure", str(t / "bf16.gguf"), str(t / "q4_0-pure.gguf"), "Q4_0"], check=True,
                       capture_output=True)
        for n in ["q4_0", "q4_0-pure"]:
            (out / f"reference.{n}.json").write_text(json.dumps(dump(t / f"{n}.gguf"), indent=0))


if __name__ == "__main__":
    if sys.argv[1] == "--dump":  # used by tests/gguf.rs to read hexq's files the same way
        print(json.dumps(dump(sys.argv[2])))
    else:
        main(sys.argv[1], sys.argv[2])

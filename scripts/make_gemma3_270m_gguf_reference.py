#!/usr/bin/env python3
"""What llama.cpp's own tools write from the trained Gemma-3 270M as `hexq import` rebuilds it, committed as the
reference for hexq's GGUF writer (tests/trained.rs): the SHA256 and size of the whole file (hexq's must be
byte-identical) and each tensor type's count, for

  convert_hf_to_gguf.py <import> --outtype f16 | q8_0 | bf16               → f16, q8_0, bf16
  convert_hf_to_gguf.py <import> --outtype f32, then llama-quantize Q4_0   → q4_0 (the default mix)
  … llama-quantize --pure Q4_0                                             → q4_0-pure

The import is the f32 checkpoint tests/common::trained_gemma3() makes: ~/.cache/hexq/gemma3-270m/hf-<sha12>
(`hexq import --gguf gemma-3-270m-Q4_K_M.gguf --out …`; general.name comes from that directory's name). It
carries tokenizer.model, so the converter takes its SentencePiece path (Gemma3Model.set_vocab).
llama.cpp: the tree vendored by the llama-cpp-python 0.3.36 sdist (LLAMA_CPP_DIR, with build/bin/llama-quantize),
converter run with its own gguf-py on PYTHONPATH; torch + transformers + sentencepiece installed.

usage: make_gemma3_270m_gguf_reference.py LLAMA_CPP_DIR IMPORT_DIR
"""
import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/golden-gemma3-270m/gguf.json"


def summary(path):
    sys.path.insert(0, str(LLAMA / "gguf-py"))
    from gguf import GGUFReader

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    types = collections.Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest(), "tensor_types": dict(sorted(types.items()))}


def main(model):
    env = {**os.environ, "PYTHONPATH": str(LLAMA / "gguf-py")}
    convert = [sys.executable, str(LLAMA / "convert_hf_to_gguf.py"), str(model)]
    quantize = str(LLAMA / "build/bin/llama-quantize")
    out = {"source": model.name, "llama_cpp": "llama-cpp-python 0.3.36 sdist"}
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        for ty in ["f16", "q8_0", "bf16", "f32"]:
            subprocess.run(convert + ["--outtype", ty, "--outfile", str(t / f"{ty}.gguf")], check=True, env=env,
                           capture_output=True)
            if ty != "f32":
                out[ty] = summary(t / f"{ty}.gguf")
        for name, extra in [("q4_0", []), ("q4_0-pure", ["--pure"])]:
            subprocess.run([quantize, *extra, str(t / "f32.gguf"), str(t / f"{name}.gguf"), "Q4_0"], check=True,
                           capture_output=True)
            out[name] = summary(t / f"{name}.gguf")
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    LLAMA = Path(sys.argv[1])
    main(Path(sys.argv[2]))

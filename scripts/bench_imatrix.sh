#!/usr/bin/env bash
# Importance-matrix benchmark, both tools in one run on the same weights and the same text chunks:
# `hexq imatrix --text` on the checkpoint vs `llama-imatrix` on hexq's f32 GGUF of it (-fa off, f32 KV:
# the configuration tests/gguf.rs matches entry by entry). Prints wall time and peak RSS of each, and the
# worst relative difference of their Σx² (gguf-py).
# usage: scripts/bench_imatrix.sh CHECKPOINT LLAMA_CPP_DIR WORKDIR [CHUNK=512] [CHUNKS=8]
set -euo pipefail
ck="$1"; llama="$2"; work="$3"; chunk="${4:-512}"; chunks="${5:-8}"
root="$(cd "$(dirname "$0")/.." && pwd)"
hexq="$root/target/release/hexq"
mkdir -p "$work"
# The text: every held-out and calibration prompt's content, one after another (hexq-authored, CC0).
python3 - "$root" "$work/text.txt" <<'PY'
import json, sys
out = []
for f in ("datasets/heldout.jsonl", "datasets/calibration.jsonl"):
    for line in open(f"{sys.argv[1]}/{f}", encoding="utf-8"):
        for m in json.loads(line).get("messages", []):
            out.append(m["content"])
open(sys.argv[2], "w", encoding="utf-8").write("\n\n".join(out))
PY
"$hexq" gguf --model "$ck" --type f32 --out "$work/f32.gguf" --force > /dev/null
t() { /usr/bin/time -f "%e %M" -o "$work/$1.time" "${@:2}" > "$work/$1.log" 2>&1; read -r s k < "$work/$1.time"; printf "| %s | %.1f s | %.2f GiB |\n" "$1" "$s" "$(echo "$k/1048576" | bc -l)"; }
echo "chunks of $chunk tokens, at most $chunks; $(nproc) threads each"
echo "| tool | wall | peak RSS |"
echo "|---|---|---|"
cat "$ck"/*.safetensors > /dev/null
t "hexq imatrix --text" "$hexq" imatrix --model "$ck" --text "$work/text.txt" --chunk "$chunk" --chunks "$chunks" \
  --out "$work/hexq.imatrix.gguf" --force
cat "$work/f32.gguf" > /dev/null
t "llama-imatrix" "$llama/build/bin/llama-imatrix" -m "$work/f32.gguf" -f "$work/text.txt" -c "$chunk" -b "$chunk" \
  --chunks "$chunks" --no-ppl -t "$(nproc)" -fa off -ctk f32 -ctv f32 -o "$work/llama.imatrix.gguf"
PYTHONPATH="$llama/gguf-py" python3 - "$work/hexq.imatrix.gguf" "$work/llama.imatrix.gguf" <<'PY'
import sys, numpy as np
from gguf import GGUFReader
def read(p):
    r = GGUFReader(p)
    return {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}
a, b = read(sys.argv[1]), read(sys.argv[2])
worst = max((float(np.max(np.abs(a[k] - b[k]) / np.maximum(np.abs(b[k]), 1e-30))), k) for k in b if k in a)
print(f"tensors: {len(a)} vs {len(b)}; same names: {sorted(a) == sorted(b)}; worst relative difference {worst[0]:.2e} ({worst[1]})")
PY

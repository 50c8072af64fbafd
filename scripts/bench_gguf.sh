#!/usr/bin/env bash
# GGUF benchmark, both tools in one run on the same checkpoint: hexq gguf --pure vs llama.cpp's
# convert_hf_to_gguf.py (--outtype bf16) + llama-quantize --pure Q4_0. Prints wall time and peak RSS of each
# step, the file sizes, and whether every tensor of the two outputs is bit-identical (gguf-py).
# MIX=default: llama-quantize's default Q4_0 mix instead of --pure (q6_K token embeddings), on both sides.
# usage: [MIX=default] scripts/bench_gguf.sh CHECKPOINT LLAMA_CPP_DIR WORKDIR
set -euo pipefail
ck="$1"; llama="$2"; work="$3"
pure=(--pure); [ "${MIX:-pure}" = default ] && pure=()
hexq="$(cd "$(dirname "$0")/.." && pwd)/target/release/hexq"
mkdir -p "$work"
# Every step starts with its input in the page cache (cat first), so the figures compare the tools, not the disk.
warm() { cat "$@" > /dev/null; }
t() { /usr/bin/time -f "%e %M" -o "$work/$1.time" "${@:2}" > "$work/$1.log" 2>&1; read -r s k < "$work/$1.time"; printf "| %s | %.1f s | %.2f GiB |\n" "$1" "$s" "$(echo "$k/1048576" | bc -l)"; }
echo "| step | wall | peak RSS |"
echo "|---|---|---|"
warm "$ck"/*.safetensors
t hexq-gguf "$hexq" gguf --model "$ck" --type q4_0 "${pure[@]}" --out "$work/hexq.gguf" --force
warm "$ck"/*.safetensors
t llama-convert env PYTHONPATH="$llama/gguf-py" python3 "$llama/convert_hf_to_gguf.py" "$ck" --outtype bf16 --outfile "$work/bf16.gguf"
warm "$work/bf16.gguf"
t llama-quantize "$llama/build/bin/llama-quantize" "${pure[@]}" "$work/bf16.gguf" "$work/llama.gguf" Q4_0
ls -l "$work/hexq.gguf" "$work/llama.gguf" | awk '{printf "%s %.3f GiB\n", $NF, $5/1073741824}'
python3 - "$work/hexq.gguf" "$work/llama.gguf" <<'PY'
import sys, hashlib, numpy as np
from gguf import GGUFReader
a, b = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
h = lambda t: (t.tensor_type.name, tuple(int(x) for x in t.shape), hashlib.sha256(np.ascontiguousarray(t.data).view(np.uint8)).hexdigest())
ta = {t.name: h(t) for t in a.tensors}; tb = {t.name: h(t) for t in b.tensors}
diff = [n for n in tb if ta.get(n) != tb[n]]
types = {}
for v in ta.values():
    types[v[0]] = types.get(v[0], 0) + 1
print(f"tensors: {len(ta)} vs {len(tb)}; differing: {len(diff)} {diff[:5]}; types {types}")
PY

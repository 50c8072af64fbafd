#!/usr/bin/env bash
# Calibration throughput, side by side on the same checkpoint and the same token sequences (issue 20):
#   1. hexq calibrate (batched engine) — it also writes the exact id sequences its decode loops fed;
#   2. aimet-onnx QuantizationSimModel.compute_encodings on hexq's float ONNX export, replaying those
#      sequences as decode loops (tests/judges/aimet_graph.py, the judge the tests use), then its encodings
#      compared with hexq's (within 1 LSB);
#   3. transformers' CPU float forward over the same sequences (one full-sequence forward each).
# Prints one table: wall seconds, tokens, tokens/s, peak RSS. Not a test: a benchmark (timings vary).
#
# usage: scripts/bench_calibrate.sh MODEL_DIR N_PROMPTS [CONTEXT=4096] [BATCH=16]
# needs: python3 with aimet-onnx, onnxruntime, torch, transformers (.ci/requirements.txt + torch/transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
M="$1"; N="$2"; C="${3:-4096}"; B="${4:-16}"
cargo build --release -q
H="$PWD/target/release/hexq"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
t() { /usr/bin/time -f "%e %M" -o "$1" "${@:2}"; }

echo "== hexq calibrate (batch $B)" >&2
t "$work/hexq.time" "$H" calibrate --model "$M" --limit "$N" --context "$C" --batch "$B" \
  --tokens-out "$work/tokens.json" --out "$work/stats.json"
"$H" quantize --model "$M" --stats "$work/stats.json" --out "$work/enc.json" 2> /dev/null
echo "== float export for aimet-onnx" >&2
t "$work/export.time" "$H" export --model "$M" --variant decode_wgqa --context "$C" --out "$work/exp" > /dev/null 2>&1
echo "== aimet-onnx compute_encodings (same sequences)" >&2
t "$work/aimet.time" python3 tests/judges/aimet_graph.py "$work/exp" "$work/enc.json" "$work/tokens.json" "$work/aimet.json"
echo "== transformers float forward (same sequences)" >&2
t "$work/hf.time" python3 - "$M" "$work/tokens.json" <<'EOF'
import json, sys, torch, transformers
torch.set_num_threads(torch.get_num_threads())
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    for ids in json.load(open(sys.argv[2])):
        m(torch.tensor([ids]))
EOF

python3 - "$work" <<'EOF'
import json, sys
w = sys.argv[1]
tokens = sum(len(s) for s in json.load(open(f"{w}/tokens.json")))
rep = json.load(open(f"{w}/aimet.json"))
def row(name, f):
    s, kb = open(f"{w}/{f}").read().split()
    s = float(s)
    return f"| {name} | {s:.1f} | {tokens} | {tokens / s:.2f} | {int(kb) / 2**20:.2f} |"
print("| tool | wall s | tokens | tokens/s | peak RSS GiB |")
print("|---|---|---|---|---|")
print(row("hexq calibrate", "hexq.time"))
print(row("aimet-onnx compute_encodings", "aimet.time"))
print(row("transformers float forward", "hf.time"))
s, _ = open(f"{w}/export.time").read().split()
print(f"\n(hexq's float export for aimet-onnx: {float(s):.1f} s, not counted.) Encodings: "
      f"{rep['within_1_lsb']} of {rep['compared']} AIMET quantizers within 1 LSB of hexq's.")
EOF

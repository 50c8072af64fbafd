#!/usr/bin/env bash
# The ARM build of the runtime and CLI (issue 21): cross-compile for aarch64 Linux with Debian's toolchain,
# then run the runtime's tests and the CLI under qemu-user, with the aarch64 onnxruntime wheel from PyPI
# (CPU EP) behind the ort backend. Prints what ran. Needs (Debian):
#   apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
# and `rustup target add aarch64-unknown-linux-gnu` (done here when rustup is present).
# Linker and qemu runner: .cargo/config.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
T=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu

for tool in aarch64-linux-gnu-gcc qemu-aarch64; do
  command -v "$tool" > /dev/null || {
    echo "scripts/aarch64.sh: $tool not found — apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user" >&2
    exit 1
  }
done
if command -v rustup > /dev/null && ! rustup target list --installed | grep -qx "$T"; then
  rustup target add "$T"
fi

echo "== cross-compiling hexq (runtime + CLI) for $T"
# No debug line tables for the ARM build (only the host build's backtraces need them): a quicker link. The
# host build below keeps whatever the caller's build had (CI: none; the profile's default: line tables).
HOST_DEBUG="${CARGO_PROFILE_RELEASE_DEBUG:-line-tables-only}"
export CARGO_PROFILE_RELEASE_DEBUG=false
# opt-level 1 for the check (HEXQ_ARM_OPT_LEVEL=3 for a shipping build): on 2 cores the cross build takes
# 3 min 40 s instead of 5 min 45 s, and the tiny model's runs under qemu need no more; the ids compared
# below are the same at either level (no fast-math: the float operations and their order are the source's).
export CARGO_PROFILE_RELEASE_OPT_LEVEL="${HEXQ_ARM_OPT_LEVEL:-1}"
cargo build --release --target "$T" -p hexq
CARGO_PROFILE_RELEASE_DEBUG=$HOST_DEBUG CARGO_PROFILE_RELEASE_OPT_LEVEL=3 cargo build --release -p hexq # the host build makes the export the ort backend runs

# onnxruntime's aarch64 wheel, the same version as the host's (PyPI), unpacked once.
ORT_VER="$(python3 -c 'import onnxruntime; print(onnxruntime.__version__)')"
ORT_DIR="$HOME/.cache/hexq/onnxruntime-$ORT_VER-aarch64"
if [ ! -f "$ORT_DIR/libonnxruntime.so.$ORT_VER" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --python-version 3.11 "onnxruntime==$ORT_VER" -d "$tmp"
  mkdir -p "$ORT_DIR.tmp"
  python3 - "$tmp"/onnxruntime-*.whl "$ORT_DIR.tmp" <<'EOF'
import sys, zipfile, os
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    if os.path.basename(n).startswith("libonnxruntime"):
        with open(os.path.join(sys.argv[2], os.path.basename(n)), "wb") as f:
            f.write(z.read(n))
EOF
  rm -rf "$tmp" "$ORT_DIR"
  mv "$ORT_DIR.tmp" "$ORT_DIR"
fi
ARM_ORT="$ORT_DIR/libonnxruntime.so.$ORT_VER"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# qemu's -L prefix: the aarch64 libraries, and an ARM /proc/cpuinfo. qemu-user 7.2 (Debian 12) shows the
# host's x86 /proc/cpuinfo to the guest; onnxruntime's cpuinfo then finds no ARM processor and dereferences
# NULL (SIGSEGV at session creation). qemu looks a guest's absolute paths up under -L first, so a
# proc/cpuinfo there is what onnxruntime reads (qemu ≥ 8.1 emulates it itself).
mkdir -p "$work/root/proc"
ln -s "$SYSROOT/lib" "$work/root/lib"
for i in 0 1; do
  printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' "$i"
done > "$work/root/proc/cpuinfo"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $work/root"
target/release/hexq export --variant decode_wgqa --context 256 --seq 16 --out "$work/decode" > /dev/null

echo "== runtime tests under qemu-aarch64 (cargo's runner, .cargo/config.toml)"
ORT_DYLIB_PATH="$ARM_ORT" HEXQ_TEST_EXPORT="$work/decode" HEXQ_REQUIRE_ORT_EXPORT=1 \
  cargo test --release --target "$T" -p hexq-runtime 2>&1 | grep -E '^(test |test result|running|error|thread)'

echo "== the aarch64 CLI under qemu vs the host build: generated ids per backend"
arm=(env ORT_DYLIB_PATH="$ARM_ORT" qemu-aarch64 -L "$work/root" "target/$T/release/hexq")
status=0
for b in cpu graph ort; do
  extra=()
  [ "$b" = graph ] && extra=(--context 256 --seq 16)
  [ "$b" = ort ] && extra=(--artifacts "$work/decode")
  host_ids="$(target/release/hexq run --backend "$b" "${extra[@]}" --prompt 'What is the capital of France?' --max-tokens 8 --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_ids"])')"
  arm_ids="$("${arm[@]}" run --backend "$b" "${extra[@]}" --prompt 'What is the capital of France?' --max-tokens 8 --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_ids"])')"
  if [ "$host_ids" = "$arm_ids" ]; then
    echo "$b: identical $arm_ids"
  else
    echo "$b: DIFFERENT host $host_ids aarch64 $arm_ids"
    status=1
  fi
done

echo "== hexq serve under qemu: /health and one chat completion"
"${arm[@]}" serve --port 0 --json > "$work/serve.out" 2> /dev/null &
pid=$!
for _ in $(seq 100); do [ -s "$work/serve.out" ] && break; sleep 0.2; done
python3 - "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$work/serve.out")" <<'PY' || status=1
import json, sys, urllib.request
url = sys.argv[1]
print("health:", json.load(urllib.request.urlopen(url + "/health")))
req = urllib.request.Request(url + "/v1/chat/completions", method="POST",
    data=json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}).encode())
r = json.load(urllib.request.urlopen(req))
print("completion:", r["usage"], "predicted_per_second %.1f" % r["timings"]["predicted_per_second"])
PY
kill "$pid"
file "target/$T/release/hexq" | cut -d, -f1-2
exit $status

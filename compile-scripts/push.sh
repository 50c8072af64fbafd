#!/usr/bin/env bash
# Stage files on a device over adb: each file split into chunks, chunks pushed in parallel and checked one by one
# (size + SHA256 on the device, retried), the file assembled on the device only after every chunk has arrived
# intact, and the assembled file's SHA256 checked against the host's. A single adb stream over a Device Cloud
# tunnel runs ~1 MB/s, so parallel chunks matter; assembling before every chunk landed is how the published build
# ended up with a truncated context binary — this refuses to.
#
# usage: push.sh [-s SERIAL] [-j JOBS] [-c CHUNK_MB] [-r RETRIES] FILE... DEVICE_DIR
# exit: 0 all files staged and verified; 1 a chunk or file failed verification (nothing assembled for it);
#       2 usage.
set -euo pipefail

SERIAL=""; JOBS=4; CHUNK_MB=64; RETRIES=3
while getopts "s:j:c:r:h" o; do
  case $o in
    s) SERIAL=$OPTARG ;; j) JOBS=$OPTARG ;; c) CHUNK_MB=$OPTARG ;; r) RETRIES=$OPTARG ;;
    h) sed -n '2,10p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 2 ]; then echo "usage: push.sh [-s SERIAL] [-j JOBS] [-c CHUNK_MB] FILE... DEVICE_DIR" >&2; exit 2; fi
DEST=${!#}
FILES=("${@:1:$#-1}")
ADB=(adb); [ -n "$SERIAL" ] && ADB=(adb -s "$SERIAL")
export SERIAL RETRIES

sha() { sha256sum "$1" | cut -d' ' -f1; }
rsha() { "${ADB[@]}" shell "sha256sum '$1' 2>/dev/null" | tr -d '\r' | cut -d' ' -f1; }

# One chunk: push, then check its size and hash on the device; retry on mismatch.
push_chunk() {
  local f=$1 remote=$2 want=$3 adb=(adb); [ -n "$SERIAL" ] && adb=(adb -s "$SERIAL")
  local i
  for ((i = 1; i <= RETRIES; i++)); do
    if "${adb[@]}" push "$f" "$remote" >/dev/null 2>&1; then
      got=$("${adb[@]}" shell "sha256sum '$remote' 2>/dev/null" | tr -d '\r' | cut -d' ' -f1)
      [ "$got" = "$want" ] && { echo "ok $remote"; return 0; }
    fi
  done
  echo "FAILED $remote (after $RETRIES tries)" >&2
  return 1
}
export -f push_chunk

for f in "${FILES[@]}"; do
  [ -f "$f" ] || { echo "push.sh: $f: no such file" >&2; exit 1; }
  name=$(basename "$f")
  want=$(sha "$f")
  size=$(stat -c %s "$f")
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  split -b "${CHUNK_MB}M" -d -a 4 "$f" "$work/$name.part"
  parts=("$work/$name".part*)
  stage="$DEST/.hexq-push-$name"
  "${ADB[@]}" shell "mkdir -p '$stage' && rm -f '$stage'/*" >/dev/null
  echo "push.sh: $name: $size bytes in ${#parts[@]} chunks, $JOBS in parallel" >&2
  for p in "${parts[@]}"; do echo "$p $stage/$(basename "$p") $(sha "$p")"; done |
    xargs -P "$JOBS" -L 1 bash -c 'push_chunk "$0" "$1" "$2"' >/dev/null || true
  # Refuse to assemble unless every chunk is on the device with the right hash.
  missing=()
  for p in "${parts[@]}"; do
    r="$stage/$(basename "$p")"
    [ "$(rsha "$r")" = "$(sha "$p")" ] || missing+=("$(basename "$p")")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "push.sh: $name: ${#missing[@]} of ${#parts[@]} chunks missing or corrupt on the device (${missing[*]}); not assembling" >&2
    exit 1
  fi
  list=$(for p in "${parts[@]}"; do printf "'%s' " "$stage/$(basename "$p")"; done)
  "${ADB[@]}" shell "cat $list > '$DEST/$name.tmp' && mv '$DEST/$name.tmp' '$DEST/$name' && rm -rf '$stage'" >/dev/null
  got=$(rsha "$DEST/$name")
  if [ "$got" != "$want" ]; then
    "${ADB[@]}" shell "rm -f '$DEST/$name'" >/dev/null
    echo "push.sh: $name: assembled SHA256 $got != $want; removed" >&2
    exit 1
  fi
  echo "$want  $DEST/$name"
  rm -rf "$work"
  trap - EXIT
done

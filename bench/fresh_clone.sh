#!/usr/bin/env bash
# The README's setup, then `kaiten serve` to /ready and to the first streamed token, from a fresh
# clone of this checkout with every cache in a new folder (.venv, pip's cache, the C++ kernels,
# Inductor, XDG_CACHE_HOME, KAITEN_MODELS_DIR): issue 61's "fresh clone" figure
# (bench/results/cold_start/README.md).
#   bash bench/fresh_clone.sh [WORKDIR]      # default /tmp/kaiten-fresh; prints three lines of seconds
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/tmp/kaiten-fresh}"
port="${PORT:-18222}"
rm -rf "$work"; mkdir -p "$work/cache"
git clone -q "$src" "$work/clone"
cd "$work/clone"
export XDG_CACHE_HOME="$work/cache/xdg" TORCH_EXTENSIONS_DIR="$work/cache/ext" \
  TORCHINDUCTOR_CACHE_DIR="$work/cache/inductor" PIP_CACHE_DIR="$work/cache/pip" KAITEN_MODELS_DIR="$work/cache/models"
now() { date +%s.%N; }
t0=$(now)
bash scripts/setup.sh >"$work/setup.log" 2>&1
t1=$(now)
.venv/bin/kaiten serve --port "$port" >"$work/serve.log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -sf "localhost:$port/ready" >/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "kaiten serve exited: $work/serve.log" >&2; exit 1; }
  sleep 0.1
done
t2=$(now)
curl -sN "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "Hello", "max_tokens": 1, "stream": true}' | head -c 1 >/dev/null
t3=$(now)
echo "setup $(echo "$t1 - $t0" | bc) s"
echo "kaiten serve to /ready $(echo "$t2 - $t1" | bc) s, to the first token $(echo "$t3 - $t1" | bc) s"
echo "setup and serve to the first token $(echo "$t3 - $t0" | bc) s"

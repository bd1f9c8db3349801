#!/usr/bin/env bash
# Creates .venv in the repo root and installs Kaiten with the given extras.
#   scripts/setup.sh            runtime only
#   scripts/setup.sh test       runtime + test tools (+ redis-server, chromium via apt)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v g++ >/dev/null || need_apt+=(g++)            # builds the C++ CPU ops (below) and Inductor's code
if [[ "$extras" == *test* ]]; then
  [ -x /usr/bin/chromium ] || need_apt+=(chromium chromium-driver)
  command -v nginx >/dev/null || need_apt+=(nginx-light)               # tests run docker/nginx.conf
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 \
    || need_apt+=(docker-compose)                                      # `config` parses compose files
  command -v prometheus >/dev/null || need_apt+=(prometheus)           # scrapes a running system in tests
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null \
      || echo "setup: could not install ${need_apt[*]} with apt; tests that need them will skip or fail" >&2
  else
    echo "setup: please install ${need_apt[*]} (apt-get install ${need_apt[*]})" >&2
  fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.kaiten-installed-${extras:-base}-$(sha1sum pyproject.toml | cut -c1-12)"
# The C++ CPU ops (kernels/cpu_ops_build.py) build in the background of the rest of the install,
# once torch and ninja are there, into the cache `kaiten serve` loads them from.
build_kernels() {
  PYTHONPATH="$PWD" .venv/bin/python -m shared.cli kernels >.venv/kaiten-kernels.log 2>&1 &
  kernels_pid=$!
}
kernels_pid=""
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: the CPU wheel on disk. An unpinned torch would pull a CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0" "ninja==1.13.0"
  build_kernels
  spec="."; [ -n "$extras" ] && spec=".[$extras]"
  .venv/bin/python -m pip install -q -e "$spec"
  touch "$stamp"
else
  build_kernels
fi
# The default model (or $KAITEN_MODEL) fetched and converted beside the kernels' build, so `kaiten
# serve` finds it (6 s of a fresh start: bench/results/cold_start/README.md).
PYTHONPATH="$PWD" .venv/bin/python -m shared.cli convert >.venv/kaiten-model.log 2>&1 &
model_pid=$!
# its one line: where the ops are, or what failed (the engine then runs on torch's ops)
wait "$kernels_pid" || echo "setup: the engine will use torch's ops instead (full log: .venv/kaiten-kernels.log)" >&2
grep '^kaiten kernels:' .venv/kaiten-kernels.log >&2 || tail -n 5 .venv/kaiten-kernels.log >&2
wait "$model_pid" && echo "setup: model ready in $(tail -n 1 .venv/kaiten-model.log)" >&2 \
  || echo "setup: the model could not be prepared now; kaiten serve will try again (log: .venv/kaiten-model.log)" >&2

#!/usr/bin/env bash
# Proves the compose deployment end to end on this machine: builds the images (local Debian
# stand-ins for redis, nginx and python:3.11-slim where Docker Hub is out of reach; Kaiten's slim
# image for the gateways and its CPU engine image with the local CPU torch wheel), runs
#   docker compose --profile cpu up -d --scale gateway=3
# and drives it through nginx with real clients (scripts/compose_check.py), then `down -v`.
#   bash scripts/compose-check.sh        (as root; needs .venv from scripts/setup.sh test)
# Starts dockerd on its own socket (scripts/dockerd.sh) when none answers, and stops it at the end. The Docker data
# root, the Debian root filesystem and the torch wheel stay in $KAITEN_CACHE_DIR (default
# ~/.cache/kaiten), so a second run rebuilds nothing that is unchanged. Exits non-zero on failure,
# with the build log's tail or the containers' state and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${KAITEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kaiten}"
export KAITEN_CACHE_DIR="$CACHE"
PROJECT="kaiten-check"
PY=.venv/bin/python
T0=$SECONDS
log() { echo "[compose-check $((SECONDS - T0))s] $*"; }
die() { log "FAIL: $*"; exit 1; }
[ -x "$PY" ] || die "no .venv (run scripts/setup.sh test first)"

# ------------------------------------------------------------------ the Docker engine
STARTED_DOCKERD=""
COMPOSE=()
UP=""
show_state() {   # what a failed run leaves to read: the containers and their last log lines
  log "containers:"
  timeout 60 "${COMPOSE[@]}" ps -a 2>&1 || true
  log "logs (last 40 lines of each service):"
  for svc in $(timeout 60 "${COMPOSE[@]}" --profile cpu config --services 2>/dev/null); do
    timeout 60 "${COMPOSE[@]}" logs --no-color --tail 40 "$svc" 2>&1 || true
  done
}
cleanup() {
  local rc=$?
  if [ ${#COMPOSE[@]} -gt 0 ] && docker info >/dev/null 2>&1; then
    [ "$rc" = 0 ] || [ -z "$UP" ] || show_state
    timeout 120 "${COMPOSE[@]}" --profile cpu down -v --timeout 10 >/dev/null 2>&1 || true
  fi
  [ -z "$STARTED_DOCKERD" ] || bash scripts/dockerd.sh stop
  [ "$rc" != 0 ] || rm -f "${BUILD_LOG:-}"
  log "done (exit $rc)"
}
trap cleanup EXIT

if ! timeout 10 docker info >/dev/null 2>&1; then   # the machine's engine, else Kaiten's own
  DOCKER_HOST=$(bash scripts/dockerd.sh host)
  export DOCKER_HOST
  if ! timeout 10 docker info >/dev/null 2>&1; then
    bash scripts/dockerd.sh start || die "no Docker engine"
    STARTED_DOCKERD=1
  fi
fi

if timeout 10 docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
  COMPOSE=(docker-compose)
else
  die "neither \`docker compose\` nor docker-compose is installed"
fi
COMPOSE_CMD="${COMPOSE[*]}"   # compose_check.py adds the project and file itself
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml --project-directory .)

# ------------------------------------------------------------------ base images
have() { docker image inspect "$1" >/dev/null 2>&1; }
pullable() { have "$1" || timeout 180 docker pull -q "$1" >/dev/null 2>&1; }

debian_base() {   # kaiten-local/debian:bookworm, bootstrapped from the mirror apt already uses
  have kaiten-local/debian:bookworm && return
  local rootfs="$CACHE/debian-bookworm-minbase.tar"
  [ -s "$rootfs" ] || bootstrap_rootfs "$rootfs"
  log "importing $rootfs"
  docker import - kaiten-local/debian:bookworm <"$rootfs" >/dev/null
}

bootstrap_rootfs() {   # FILE: a tar of a minimal Debian bookworm root filesystem
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    timeout 300 apt-get install -y -qq debootstrap >/dev/null 2>&1 \
      || { timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq debootstrap >/dev/null; }
  fi
  local mirror root
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -1)
  root=$(mktemp -d /tmp/kaiten-bookworm.XXXXXX)
  log "debootstrap bookworm from ${mirror:-http://deb.debian.org/debian}"
  timeout 600 debootstrap --variant=minbase bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >/dev/null \
    || die "debootstrap (log: $root/debootstrap/debootstrap.log)"
  mkdir -p "$(dirname "$1")"
  tar -C "$root" -cf "$1.part" . && mv "$1.part" "$1"
  rm -rf "$root"
}

BUILD_LOG=$(mktemp /tmp/kaiten-build.XXXXXX.log)
build() {   # image dockerfile context [build args]: layers are cached between runs
  log "building $1"
  timeout 1800 docker build -t "$1" -f "$2" "${@:4}" "$3" >"$BUILD_LOG" 2>&1 \
    || { tail -40 "$BUILD_LOG"; die "docker build $1 (log: $BUILD_LOG)"; }
}

build_local() {   # image dockerfile context: a local stand-in, kept while its sources are unchanged
  local sum
  sum=$(cat "$2" "$3"/* | sha256sum | cut -c1-16)
  if [ "$(docker image inspect -f '{{index .Config.Labels "kaiten.source"}}' "$1" 2>/dev/null)" = "$sum" ]; then
    log "kept $1 (built from the same sources)"
    return
  fi
  build "$1" "$2" "$3" --label "kaiten.source=$sum"
}

official_python=python:3.11-slim official_redis=redis:7-alpine official_nginx=nginx:1.27-alpine
if [ -z "${PYTHON_IMAGE:-}" ] && ! pullable "$official_python"; then PYTHON_IMAGE=kaiten-local/python:3.11; fi
if [ -z "${REDIS_IMAGE:-}" ] && ! pullable "$official_redis"; then REDIS_IMAGE=kaiten-local/redis:7; fi
if [ -z "${NGINX_IMAGE:-}" ] && ! pullable "$official_nginx"; then NGINX_IMAGE=kaiten-local/nginx:1.22; fi
export PYTHON_IMAGE="${PYTHON_IMAGE:-$official_python}" REDIS_IMAGE="${REDIS_IMAGE:-$official_redis}"
export NGINX_IMAGE="${NGINX_IMAGE:-$official_nginx}"
case "$PYTHON_IMAGE$REDIS_IMAGE$NGINX_IMAGE" in *kaiten-local/*) debian_base ;; esac
if [ "$PYTHON_IMAGE" = kaiten-local/python:3.11 ]; then
  # The host's CA bundle (which pip here trusts) goes into this local test image only.
  ctx=$(mktemp -d /tmp/kaiten-python-ctx.XXXXXX)
  cp "${KAITEN_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" "$ctx/ca.crt"
  build_local "$PYTHON_IMAGE" docker/local/python.Dockerfile "$ctx"
  rm -rf "$ctx"
fi
if [ "$REDIS_IMAGE" = kaiten-local/redis:7 ]; then build_local "$REDIS_IMAGE" docker/local/redis.Dockerfile docker/local; fi
if [ "$NGINX_IMAGE" = kaiten-local/nginx:1.22 ]; then build_local "$NGINX_IMAGE" docker/local/nginx.Dockerfile docker/local; fi
log "images: $PYTHON_IMAGE, $REDIS_IMAGE, $NGINX_IMAGE"

# ------------------------------------------------------------------ Kaiten's image
# torch from a local wheel (the CPU build, ~190 MB, instead of PyPI's CUDA build of several GB),
# downloaded once into the cache and linked into the build context.
if ! ls docker/wheels/torch-2.13.0*-cp311-*.whl >/dev/null 2>&1; then
  if ! ls "$CACHE"/wheels/torch-2.13.0*-cp311-*.whl >/dev/null 2>&1; then
    log "downloading the torch wheel into $CACHE/wheels/"
    timeout 900 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$CACHE/wheels" "torch==2.13.0" || die "pip download torch"
  fi
  cp -l "$CACHE"/wheels/torch-2.13.0*-cp311-*.whl docker/wheels/ 2>/dev/null \
    || cp "$CACHE"/wheels/torch-2.13.0*-cp311-*.whl docker/wheels/
fi
build kaiten:latest docker/Dockerfile . --target slim --build-arg BASE_IMAGE="$PYTHON_IMAGE"
build kaiten-cpu:latest docker/Dockerfile . --target engine --build-arg BASE_IMAGE="$PYTHON_IMAGE" \
  --build-arg FIND_LINKS=/wheels --build-arg ENGINE_DEVICE=cpu
docker image prune -f >/dev/null   # the images an earlier build left untagged: the cache stays bounded
# The slim image (gateways, tokenizer, model-init) must not carry torch, xgrammar or triton.
docker run --rm --entrypoint python kaiten:latest -c \
  'import importlib.util as u, sys; bad = [m for m in ("torch", "xgrammar", "triton") if u.find_spec(m)]; sys.exit(f"the slim image has {bad}" if bad else 0)' \
  || die "the slim image carries engine dependencies"
log "image sizes: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^kaiten(-cpu)?:latest ' | sort | paste -sd, - | sed 's/,/, /g') (base $PYTHON_IMAGE: $(docker image inspect -f '{{.Size}}' "$PYTHON_IMAGE" | awk '{printf "%.0fMB", $1/1e6}'))"

# ------------------------------------------------------------------ up, checks, down
export KAITEN_HTTP_HOST=127.0.0.1
# One torch thread for the engine: this machine's few cores are shared, and OpenMP threads that
# spin-wait on a busy core slow every step down.
export KAITEN_CPU_NUM_THREADS="${KAITEN_CPU_NUM_THREADS:-1}"
KAITEN_HTTP_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export KAITEN_HTTP_PORT
timeout 120 "${COMPOSE[@]}" --profile cpu down -v --timeout 10 >/dev/null 2>&1 || true   # leftovers of an earlier run
log "${COMPOSE[*]} --profile cpu up -d --scale gateway=3 (nginx on 127.0.0.1:$KAITEN_HTTP_PORT)"
UP=1   # from here on, a failure shows the containers and their logs
timeout 600 "${COMPOSE[@]}" --profile cpu up -d --no-build --scale gateway=3 || die "compose up"
timeout 1200 "$PY" scripts/compose_check.py --base-url "http://127.0.0.1:$KAITEN_HTTP_PORT" \
  --compose "$COMPOSE_CMD" --project "$PROJECT" || die "compose_check.py exited $?"
log "PASS"

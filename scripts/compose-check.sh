#!/usr/bin/env bash
# Proves the compose deployment end to end on this machine: builds the images (local Debian
# stand-ins for redis, nginx and python:3.11-slim where Docker Hub is out of reach), runs
#   docker compose --profile cpu up -d --scale gateway=3
# and drives it through nginx with real clients (scripts/compose_check.py), then `down -v`.
#   bash scripts/compose-check.sh        (as root; needs .venv from scripts/setup.sh test)
# Starts dockerd (data root $KAITEN_DOCKER_ROOT, default /var/lib/kaiten-docker, which keeps the
# images cached between runs) when none answers, and stops it at the end. Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER_ROOT="${KAITEN_DOCKER_ROOT:-/var/lib/kaiten-docker}"
PROJECT="kaiten-check"
PY=.venv/bin/python
T0=$SECONDS
log() { echo "[compose-check $((SECONDS - T0))s] $*"; }
die() { log "FAIL: $*"; exit 1; }
[ -x "$PY" ] || die "no .venv (run scripts/setup.sh test first)"

# ------------------------------------------------------------------ the Docker engine
DOCKERD_PID=""
COMPOSE=()
cleanup() {
  local rc=$?
  if [ ${#COMPOSE[@]} -gt 0 ] && docker info >/dev/null 2>&1; then
    timeout 120 "${COMPOSE[@]}" down -v --timeout 10 >/dev/null 2>&1 || true
  fi
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping the dockerd this script started (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    timeout 60 tail --pid="$DOCKERD_PID" -f /dev/null || kill -9 "$DOCKERD_PID" 2>/dev/null || true
  fi
  [ "$rc" != 0 ] || rm -f "${BUILD_LOG:-}"
  log "done (exit $rc)"
}
trap cleanup EXIT

if ! timeout 10 docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || die "no Docker engine answers and dockerd is not installed"
  [ "$(id -u)" = 0 ] || die "starting dockerd needs root"
  mkdir -p "$DOCKER_ROOT"
  log "starting dockerd (data root $DOCKER_ROOT)"
  dockerd --data-root "$DOCKER_ROOT" --pidfile /var/run/kaiten-dockerd.pid >"$DOCKER_ROOT.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do timeout 5 docker info >/dev/null 2>&1 && break; sleep 1; done
  timeout 10 docker info >/dev/null 2>&1 || die "dockerd did not answer within 60 s (see $DOCKER_ROOT.log)"
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
  timeout 600 debootstrap --variant=minbase bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >/dev/null
  tar -C "$root" -c . | docker import - kaiten-local/debian:bookworm >/dev/null
  rm -rf "$root"
}

BUILD_LOG=$(mktemp /tmp/kaiten-build.XXXXXX.log)
build() {   # image dockerfile context [build args]: layers are cached between runs
  log "building $1"
  timeout 1800 docker build -t "$1" -f "$2" "${@:4}" "$3" >"$BUILD_LOG" 2>&1 \
    || { tail -40 "$BUILD_LOG"; die "docker build $1 (log: $BUILD_LOG)"; }
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
  build "$PYTHON_IMAGE" docker/local/python.Dockerfile "$ctx"
  rm -rf "$ctx"
fi
[ "$REDIS_IMAGE" = kaiten-local/redis:7 ] && build "$REDIS_IMAGE" docker/local/redis.Dockerfile docker/local
[ "$NGINX_IMAGE" = kaiten-local/nginx:1.22 ] && build "$NGINX_IMAGE" docker/local/nginx.Dockerfile docker/local
log "images: $PYTHON_IMAGE, $REDIS_IMAGE, $NGINX_IMAGE"

# ------------------------------------------------------------------ Kaiten's image
# torch from a local wheel (the CPU build, ~190 MB, instead of PyPI's CUDA build of several GB).
if ! ls docker/wheels/torch-2.13.0*-cp311-*.whl >/dev/null 2>&1; then
  log "downloading the torch wheel into docker/wheels/"
  timeout 900 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d docker/wheels "torch==2.13.0" || die "pip download torch"
fi
build kaiten:latest docker/Dockerfile . --build-arg BASE_IMAGE="$PYTHON_IMAGE" --build-arg FIND_LINKS=/wheels

# ------------------------------------------------------------------ up, checks, down
export KAITEN_HTTP_HOST=127.0.0.1
# One torch thread for the engine: this machine's few cores are shared, and OpenMP threads that
# spin-wait on a busy core slow every step down.
export KAITEN_CPU_NUM_THREADS="${KAITEN_CPU_NUM_THREADS:-1}"
KAITEN_HTTP_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export KAITEN_HTTP_PORT
timeout 120 "${COMPOSE[@]}" down -v --timeout 10 >/dev/null 2>&1 || true   # leftovers of an earlier run
log "${COMPOSE[*]} --profile cpu up -d --scale gateway=3 (nginx on 127.0.0.1:$KAITEN_HTTP_PORT)"
timeout 600 "${COMPOSE[@]}" --profile cpu up -d --no-build --scale gateway=3 || die "compose up"
timeout 1200 "$PY" scripts/compose_check.py --base-url "http://127.0.0.1:$KAITEN_HTTP_PORT" \
  --compose "$COMPOSE_CMD" --project "$PROJECT" || {
  rc=$?
  timeout 60 "${COMPOSE[@]}" logs --tail 30 2>&1 | tail -150 || true
  die "compose_check.py exited $rc"
}
log "PASS"

#!/usr/bin/env bash
# Kaiten's own Docker engine for the checks, on a machine that runs none (as root):
#   export DOCKER_HOST=$(bash scripts/dockerd.sh host)   where clients find it
#   bash scripts/dockerd.sh start   starts it, unless it already answers
#   bash scripts/dockerd.sh stop    stops it (found by its pidfile)
# It listens on its own socket, not the default one, so only the clients told (DOCKER_HOST) use
# it: other test runs on the machine keep their Redis processes. The data root lives in the cache
# ($KAITEN_CACHE_DIR, default ~/.cache/kaiten), so built images outlive the engine and later runs
# reuse them. Its log: $KAITEN_CACHE_DIR/dockerd.log.
set -euo pipefail
CACHE="${KAITEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kaiten}"
ROOT="$CACHE/docker"
RUN=/var/run/kaiten-docker
SOCKET="unix://$RUN.sock"
PIDFILE=/var/run/kaiten-dockerd.pid
LOG="$CACHE/dockerd.log"
log() { echo "[dockerd] $*"; }

answers() { DOCKER_HOST="$SOCKET" timeout 10 docker info >/dev/null 2>&1; }

start() {
  if answers; then log "Kaiten's Docker engine already answers ($SOCKET)"; return; fi
  command -v dockerd >/dev/null || { log "dockerd is not installed"; exit 1; }
  [ "$(id -u)" = 0 ] || { log "starting dockerd needs root"; exit 1; }
  mkdir -p "$ROOT"
  log "starting dockerd on $SOCKET (data root $ROOT, log $LOG)"
  setsid dockerd -H "$SOCKET" --exec-root "$RUN" --data-root "$ROOT" --pidfile "$PIDFILE" \
    >"$LOG" 2>&1 < /dev/null &
  for _ in $(seq 60); do
    answers && { log "up: $(DOCKER_HOST="$SOCKET" docker version -f 'Docker {{.Server.Version}}')"; return; }
    sleep 1
  done
  tail -20 "$LOG"
  log "dockerd did not answer within 60 s"
  exit 1
}

stop() {
  [ -s "$PIDFILE" ] || return 0
  local pid
  pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping dockerd (pid $pid)"
    kill "$pid"
    timeout 60 tail --pid="$pid" -f /dev/null || kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
}

case "${1:-}" in
  host) echo "$SOCKET" ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 host|start|stop" >&2; exit 2 ;;
esac

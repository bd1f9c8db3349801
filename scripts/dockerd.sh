#!/usr/bin/env bash
# A Docker engine for the checks on a machine that runs none (as root):
#   bash scripts/dockerd.sh start   starts dockerd when no engine answers; no-op when one does
#   bash scripts/dockerd.sh stop    stops it again, only if `start` started it (its pidfile)
# The data root lives in the cache ($KAITEN_CACHE_DIR, default ~/.cache/kaiten), so built images
# outlive the engine and later runs reuse them. Its log: $KAITEN_CACHE_DIR/dockerd.log.
set -euo pipefail
CACHE="${KAITEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kaiten}"
ROOT="$CACHE/docker"
PIDFILE=/var/run/kaiten-dockerd.pid
LOG="$CACHE/dockerd.log"
log() { echo "[dockerd] $*"; }

answers() { timeout 10 docker info >/dev/null 2>&1; }

start() {
  if answers; then log "a Docker engine already answers"; return; fi
  command -v dockerd >/dev/null || { log "no Docker engine answers and dockerd is not installed"; exit 1; }
  [ "$(id -u)" = 0 ] || { log "starting dockerd needs root"; exit 1; }
  mkdir -p "$ROOT"
  log "starting dockerd (data root $ROOT, log $LOG)"
  setsid dockerd --data-root "$ROOT" --pidfile "$PIDFILE" >"$LOG" 2>&1 < /dev/null &
  for _ in $(seq 60); do answers && { log "up: $(docker version -f 'Docker {{.Server.Version}}')"; return; }; sleep 1; done
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
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac

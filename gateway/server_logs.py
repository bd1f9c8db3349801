"""What uvicorn logs for the gateway: no line per readiness or liveness probe (unless DEBUG), and
no secret from a query string (a browser can only send a WebSocket key as ``?api_key=``).

``install(level)`` adds the filters to uvicorn's loggers; call it after uvicorn configured them.
"""
from __future__ import annotations

import logging
from urllib.parse import unquote_plus

PROBE_PATHS = frozenset({"/ready", "/health"})
SECRET_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token", "access_token", "ticket"})
REDACTED = "[redacted]"


def redact_query(target: str) -> str:
    """``/v1/chat/ws?api_key=abc&x=1`` -> ``/v1/chat/ws?api_key=[redacted]&x=1``."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    items = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        items.append(f"{name}={REDACTED}" if eq and unquote_plus(name).lower() in SECRET_PARAMS else item)
    return f"{path}?{'&'.join(items)}"


class RedactQuerySecrets(logging.Filter):
    """Rewrites every string argument of a record that carries a query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "?" in a for a in record.args):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        return True


class DropProbes(logging.Filter):
    """Drops access lines of GET /ready and GET /health (uvicorn's args: client, method, path, ...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in PROBE_PATHS
        return True


def install(level: int) -> None:
    access = logging.getLogger("uvicorn.access")
    if level > logging.DEBUG:
        access.addFilter(DropProbes())
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(RedactQuerySecrets())

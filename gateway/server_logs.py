"""What uvicorn logs for the gateway: no line per readiness or liveness probe (unless DEBUG), and
no secret: query-string keys (``?api_key=``), bearer tokens, the WebSocket's
``kaiten.bearer.<key>`` subprotocol, and the values of credential headers, which uvicorn's
WebSocket handshake logs one per line at DEBUG.

``install(level)`` adds the filters to uvicorn's loggers; call it after uvicorn configured them.
"""
from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

PROBE_PATHS = frozenset({"/ready", "/health"})
SECRET_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token", "access_token", "ticket"})
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"})
REDACTED = "[redacted]"

_QUERY_ITEM = re.compile(r"(?<=[?&])([^=&?#\s\"']+)=([^&#\s\"']*)")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s,\"']+")
_BEARER_SUBPROTOCOL = re.compile(r"(kaiten\.bearer\.)[A-Za-z0-9_=-]+")


def _redact_item(m: re.Match) -> str:
    return f"{m.group(1)}={REDACTED}" if unquote_plus(m.group(1)).lower() in SECRET_PARAMS else m.group(0)


def redact_query(target: str) -> str:
    """``/v1/chat/ws?api_key=abc&x=1`` -> ``/v1/chat/ws?api_key=[redacted]&x=1``."""
    return _QUERY_ITEM.sub(_redact_item, target) if "?" in target else target


def redact_text(text: str) -> str:
    """Every secret this module knows, anywhere in `text`."""
    text = redact_query(text)
    text = _BEARER.sub(rf"\g<1>{REDACTED}", text)
    return _BEARER_SUBPROTOCOL.sub(rf"\g<1>{REDACTED}", text)


class RedactSecrets(logging.Filter):
    """Rewrites the string arguments of a record (keeping their number: uvicorn's access formatter
    unpacks them); a value that follows a credential header's name is replaced whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            out = list(args)
            for i, a in enumerate(args):
                if not isinstance(a, str):
                    continue
                after_header = i > 0 and isinstance(args[i - 1], str) and args[i - 1].lower() in SECRET_HEADERS
                out[i] = REDACTED if after_header else redact_text(a)
            record.args = tuple(out)
        elif not args and isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
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
        logging.getLogger(name).addFilter(RedactSecrets())

"""Which web pages may drive a key-less gateway's WebSocket: its own page (same origin), the
configured ``allowed_origins`` ("*": any), and clients that are no browser (they send no Origin)."""
from __future__ import annotations

from urllib.parse import urlsplit


def origin_allowed(origin: str | None, host: str, allowed: tuple[str, ...]) -> bool:
    if origin is None:
        return True
    if "*" in allowed or origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return True
    parts = urlsplit(origin)
    host = host.lower()
    if ":" in host.rsplit("]", 1)[-1]:            # Host with a port: the same host and port
        return parts.netloc.lower() == host
    return (parts.hostname or "") == host.strip("[]")   # no port: a proxy that passes nginx's $host

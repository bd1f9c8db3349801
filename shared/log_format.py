"""How every kaiten process logs to stderr: ``--log-level`` and ``--log-format`` (``text``, the
default, or ``json``: one JSON object per line with time, level, logger, message and, when there is
one, the exception's traceback; uvicorn's access lines add client, method, path and status).

    add_log_flags(parser)                         # --log-level, --log-format (and their KAITEN_* variables)
    setup_logging(args.log_level, args.log_format)
    uvicorn.Config(..., log_config=uvicorn_log_config(args.log_format))
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from datetime import datetime, timezone
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line (tracebacks too: their newlines are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(ACCESS_FIELDS, record.args))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=os.environ.get("KAITEN_LOG_LEVEL", "INFO"),
                        help="log level (env KAITEN_LOG_LEVEL, default INFO)")
    parser.add_argument("--log-format", type=str.lower, choices=LOG_FORMATS,
                        default=os.environ.get("KAITEN_LOG_FORMAT", "text"),
                        help="text, or json: one object per line (env KAITEN_LOG_FORMAT, default text)")


def setup_logging(level: str, fmt: str) -> None:
    """The root logger writes `fmt` lines to stderr at `level` (replacing any earlier handler)."""
    level, fmt = level.upper(), fmt.lower()
    if level not in LOG_LEVELS or fmt not in LOG_FORMATS:
        raise SystemExit(f"invalid log settings: level {level!r} (one of {', '.join(LOG_LEVELS)}), "
                         f"format {fmt!r} (one of {', '.join(LOG_FORMATS)}); see KAITEN_LOG_LEVEL/KAITEN_LOG_FORMAT")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if fmt == "json":            # what Python itself writes to stderr becomes records too
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
    else:
        logging.getLogger("kaiten").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def uvicorn_log_config(fmt: str) -> dict | None:
    """uvicorn's own handlers for text (its usual lines); none for json, so its records reach the
    root logger's JSON handler."""
    if fmt.lower() == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG
    return LOGGING_CONFIG


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if not issubclass(args.exc_type, SystemExit):          # as threading's own hook: SystemExit is quiet
        name = args.thread.name if args.thread is not None else "?"
        logging.getLogger("kaiten").critical("uncaught exception in thread %s", name,
                                             exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

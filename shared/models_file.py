"""The models file of ``kaiten serve --models-file`` and ``kaiten gateway --models-file``: a JSON
file naming several models, how many engines each gets and the LoRA adapters they load::

    {"models": [
        {"model": "models/SmolLM2-135M-Instruct", "served_model_name": "smol", "engines": 2,
         "lora_modules": {"sql": "/adapters/sql"}, "engine_args": ["--max-num-seqs", "64"]},
        {"model": "/models/other"}
    ]}

``model`` is required (a directory, a GGUF file or a cached repo id, as ``--model``); the rest is
optional: ``served_model_name`` (default: the directory's name), ``engines`` (default 1),
``lora_modules`` (adapter name -> directory, as ``--lora-modules name=path``), ``chat_template``
(a file or the template itself) and ``engine_args`` (more ``kaiten engine`` flags for its engines).
JSON rather than YAML: the gateway's slim image has no YAML parser among its dependencies.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KEYS = ("model", "served_model_name", "engines", "lora_modules", "chat_template", "engine_args")


@dataclass(slots=True)
class ModelEntry:
    model: str
    served_model_name: str = ""
    engines: int = 1
    lora_modules: dict[str, str] = field(default_factory=dict)
    chat_template: str = ""
    engine_args: list[str] = field(default_factory=list)


def load_models_file(path: str | Path) -> list[ModelEntry]:
    """The file's models; ValueError says what is wrong (and where)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read the models file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the models file {path} is not valid JSON: {e}") from None
    return parse_models(data, str(path))


def parse_models(data, where: str = "models file") -> list[ModelEntry]:
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ValueError(f'{where}: expected {{"models": [{{"model": ...}}, ...]}} with at least one model')
    entries = [_entry(m, f"{where}: models[{i}]") for i, m in enumerate(data["models"])]
    names = [e.served_model_name or Path(e.model).name for e in entries]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"{where}: two models are named {dup!r}; give one a served_model_name")
    return entries


def _entry(m, where: str) -> ModelEntry:
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(m) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {list(KEYS)}")
    checks = (("model", str, True), ("served_model_name", str, False), ("engines", int, False),
              ("lora_modules", dict, False), ("chat_template", str, False), ("engine_args", list, False))
    for key, typ, required in checks:
        if key not in m:
            if required:
                raise ValueError(f"{where}: '{key}' is required")
            continue
        if not isinstance(m[key], typ) or isinstance(m[key], bool):
            raise ValueError(f"{where}: '{key}' must be a {typ.__name__}, got {m[key]!r:.80}")
    if not m["model"]:
        raise ValueError(f"{where}: 'model' must not be empty")
    if m.get("engines", 1) < 1:
        raise ValueError(f"{where}: 'engines' must be at least 1")
    loras = m.get("lora_modules", {})
    if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in loras.items()):
        raise ValueError(f"{where}: 'lora_modules' maps adapter names to directories (strings)")
    if not all(isinstance(a, str) for a in m.get("engine_args", [])):
        raise ValueError(f"{where}: 'engine_args' must be a list of strings")
    return ModelEntry(**m)

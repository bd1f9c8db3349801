"""The models a gateway serves: one ``ServedModel`` per model (its tokenizer, chat template,
generation defaults, context length, metrics label, engines and stream), kept in a ``ModelRegistry``
that resolves a request's ``model`` field.

A model is configured (``--model``, repeatable, or a models file) or found: an engine's heartbeat
announces the model it serves (its served name, as its stream is named) and the directory it
loaded; a gateway that can read that directory loads the model's tokenizer in the background and
serves it too. After every poll of the heartbeats (``refresh``) each model takes its engines' view
and the adapters they announce; a request naming an adapter (as vLLM: ``"model": "<adapter>"``)
resolves to the adapter's base model and ``lora_name``. A lookup is one dict read, however many
models there are.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import names
from shared.generation_defaults import GenerationDefaults, load_generation_defaults

from .api.errors import APIError
from .api.openai_api import ModelContext
from .backend.engines import EMPTY_VIEW, EngineMonitor, ModelView

log = logging.getLogger("kaiten.gateway")

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_model_dir(model: str) -> str:
    """--model as a directory: a directory, a GGUF file (converted once), a cached HF repo id, or ""
    for the default model (shared.model_source)."""
    from shared.model_source import resolve_model
    return str(resolve_model(model))


def load_chat_template(value: str) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM's rule)."""
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _model_config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


@dataclass(slots=True, eq=False)
class ServedModel:
    name: str                                  # the served name (the API's, and its engines' streams')
    model_dir: str = ""
    aliases: tuple[str, ...] = ()              # every name it answers to, `name` first
    tokenizer: Any = None                      # prompts: in-process, or the tokenizer service
    text_tokenizer: Any = None                 # tokenizer_service.ChatTokenizer: outputs, token strings
    chat_template: str | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    metrics: Any = None                        # gateway.metrics.ModelMetrics
    cfg_max_len: int | None = None
    cfg_vocab: int | None = None
    created: int = 0
    view: ModelView = field(default_factory=lambda: EMPTY_VIEW)   # its engines at the last poll
    announced: str = ""                        # the alias its engines announce: their stream's name

    @property
    def stream(self) -> str:
        return names.request_stream(self.announced or self.name)

    def refresh(self, monitor: EngineMonitor) -> None:
        """Take the view of the alias with the most live engines (engines started with another
        --served-model-name than the gateway's announce the directory's name)."""
        best = max(self.aliases, key=lambda a: len(monitor.view(a).live))
        view = monitor.view(best)
        if not view.live:
            best = next((a for a in self.aliases if a in monitor.views), self.name)
            view = monitor.view(best)
        self.view, self.announced = view, best

    def _engines_min(self, name: str) -> int | None:
        """The smallest value of heartbeat field `name` among the live engines (None: none says)."""
        return min((int(e.get(name)) for e in self.view.live if e.get(name)), default=None)

    def max_model_len(self) -> int:
        n = self._engines_min("max_model_len") or self.cfg_max_len
        if n:
            return n
        tl = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tl, int) and 0 < tl < 10**7:
            return tl
        return DEFAULT_MAX_MODEL_LEN

    def vocab_size(self) -> int:
        return (self._engines_min("vocab_size") or self.cfg_vocab
                or int(getattr(self.tokenizer, "vocab_size", 0) or 0) or 2**31)

    def context(self, requested: str, lora_name: str, max_n: int) -> ModelContext:
        return ModelContext(name=requested, max_model_len=self.max_model_len(), vocab_size=self.vocab_size(),
                            max_n=max_n, tokenizer=self.tokenizer, chat_template=self.chat_template,
                            defaults=self.defaults, lora_name=lora_name, served=self)


@dataclass(slots=True)
class ModelSpec:
    """How a gateway is told about one model: its directory and, optionally, its served name."""
    model_dir: str
    served_model_name: str = ""
    chat_template: str = ""
    dir_alias: bool = True            # also answer to the directory's name (not for a found model)
    tokenizer_url: str = ""           # the tokenizer service for its prompts ("": in-process); the
                                      # service tokenizes one model: the gateway's first


class ModelRegistry:
    def __init__(self, metrics: Any, generation_config: str = "auto"):
        self.metrics = metrics
        self.generation_config = generation_config
        self.models: dict[str, ServedModel] = {}        # served name -> model, in the order added
        self._by_alias: dict[str, ServedModel] = {}
        self._adapters: dict[str, tuple[ServedModel, str]] = {}   # adapter -> (base model, path)
        self._finding: set[str] = set()                  # announced names tried (found or not)
        self._bg: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ adding
    def add(self, spec: ModelSpec, generation_config: str | None = None) -> ServedModel:
        """Load a model's tokenizer and facts and serve it (blocking)."""
        return self._insert(self.build(spec, generation_config))

    def build(self, spec: ModelSpec, generation_config: str | None = None) -> ServedModel:
        """A model's tokenizer and facts (blocking: a thread may run it); not served yet."""
        from tokenizer_service import ChatTokenizer, make_tokenizer
        model_dir = spec.model_dir
        name = spec.served_model_name or (Path(model_dir).name if model_dir else "model")
        dir_name = Path(model_dir).name if model_dir and spec.dir_alias else ""
        aliases = [name] + ([dir_name] if dir_name and dir_name != name else [])
        cfg = _model_config(model_dir) if model_dir else {}
        text_tokenizer = ChatTokenizer.from_pretrained(model_dir)
        return ServedModel(
            name=name, model_dir=model_dir, aliases=tuple(aliases), text_tokenizer=text_tokenizer,
            tokenizer=make_tokenizer(model_dir, spec.tokenizer_url, text_tokenizer),
            chat_template=load_chat_template(spec.chat_template),
            defaults=load_generation_defaults(model_dir, generation_config or self.generation_config),
            metrics=self.metrics.model(name), cfg_max_len=int(cfg.get("max_position_embeddings") or 0) or None,
            cfg_vocab=int(cfg.get("vocab_size") or 0) or None, created=int(time.time()))

    def _insert(self, model: ServedModel) -> ServedModel:
        """Serve `model`. Served names must differ; the directory's name is a fallback alias only:
        one directory served under two names keeps it for the first, and a served name takes it over."""
        other = self._by_alias.get(model.name)
        if other is not None and other.name == model.name:
            raise ValueError(f"two models are named {model.name!r}: give one a --served-model-name")
        if other is not None:
            other.aliases = tuple(a for a in other.aliases if a != model.name)
        model.aliases = tuple(a for a in model.aliases if a == model.name or a not in self._by_alias)
        self.models[model.name] = model
        for a in model.aliases:
            self._by_alias[a] = model
        self._finding.update(model.aliases)
        return model

    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    # ------------------------------------------------------------------ lookup
    def resolve(self, requested: str | None) -> tuple[ServedModel, str]:
        """(model, lora_name) for a request's `model` field; None: the first model. 404 if unknown."""
        if requested is None:
            return self.default, ""
        model = self._by_alias.get(requested)
        if model is not None:
            return model, ""
        adapter = self._adapters.get(requested)
        if adapter is not None:
            return adapter[0], requested
        raise APIError(404, f"The model '{requested}' does not exist. Available: {', '.join(self.names())}",
                       param="model", code="model_not_found")

    def get(self, name: str) -> ServedModel | None:
        return self._by_alias.get(name)

    def names(self) -> list[str]:
        return list(self.models) + list(self._adapters)

    def adapters(self) -> dict[str, tuple[ServedModel, str]]:
        return self._adapters

    # ------------------------------------------------------------------ after every poll
    def refresh(self, monitor: EngineMonitor) -> None:
        adapters: dict[str, tuple[ServedModel, str]] = {}
        for model in self.models.values():
            model.refresh(monitor)
            for adapter, path in model.view.adapters.items():
                if adapter not in self._by_alias:
                    adapters.setdefault(adapter, (model, str(path)))
        self._adapters = adapters
        for announced, view in monitor.views.items():
            if announced not in self._finding and view.live:
                self._finding.add(announced)
                self._find(announced, view)

    def _find(self, announced: str, view: ModelView) -> None:
        """A model an engine serves and this gateway does not: serve it too, if its directory is here."""
        path = next((e.heartbeat.get("model_path") for e in view.live if e.heartbeat.get("model_path")), "")
        if not path or not Path(str(path)).is_dir():
            log.warning("engines serve model %r from %r, a directory this gateway cannot read: not serving it",
                        announced, path)
            return

        async def load() -> None:
            try:
                spec = ModelSpec(str(path), announced, dir_alias=False)
                model = self._insert(await asyncio.to_thread(self.build, spec))
                await asyncio.wait_for(model.tokenizer.start(), 10.0)
                log.info("serving model %r found in the engines' heartbeats (%s)", announced, path)
            except Exception as e:
                log.warning("cannot serve model %r from %s: %s: %s", announced, path, type(e).__name__, e)
        task = asyncio.get_running_loop().create_task(load())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def start(self) -> None:
        for model in self.models.values():
            try:
                await asyncio.wait_for(model.tokenizer.start(), 10.0)
            except Exception as e:      # the tokenizer service may come up later
                log.warning("tokenizer of %s not ready yet: %s: %s", model.name, type(e).__name__, e)

    async def aclose(self) -> None:
        for task in list(self._bg):
            task.cancel()
        for model in self.models.values():
            try:
                await model.tokenizer.aclose()
            except Exception:
                pass

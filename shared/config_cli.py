"""Command-line flags generated from a config dataclass (shared/config.py), for every process's CLI.

Each field ``some_name`` becomes ``--some-name`` (dest ``some_name``) whose help ends with the
field's variable and default, read from the dataclass, so the help cannot drift from the config:

    bool        --x / --no-x
    list        --x A [B ...]                  (the variable: comma-separated)
    tuple       --x A,B                        (comma-separated, as the variable)
    int, float  --x N                          (int | None: an int)
    str         --x TEXT

Every flag defaults to None ("not given"): ``config.with_overrides(**config_overrides(args, cls))``
keeps the environment's value (``from_env()``) for each flag not given.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable


def env_name(cls, name: str) -> str:
    """The environment variable of `cls`'s field `name` (as ``from_env`` reads it)."""
    return cls.ENV_NAMES.get(name, "KAITEN_" + name.upper())


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _comma_separated(text: str) -> tuple[str, ...] | None:
    """A tuple field's value, as its variable takes it; "" is not given (None)."""
    return tuple(x for x in text.split(",") if x) or None


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *,
                     only: Iterable[str] | None = None, skip: Iterable[str] = (),
                     help: dict[str, str] | None = None, overrides: dict[str, dict] | None = None) -> None:
    """Add a flag for each field of `cls` (those in `only`, if given, in the dataclass's order) but
    those in `skip`. `help[name]` says what the field does (the variable and default are added);
    `overrides[name]` changes that flag's add_argument keywords ("flag" renames it)."""
    help, overrides = help or {}, overrides or {}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = (set(help) | set(overrides) | set(only or ()) | set(skip)) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
    wanted = set(only) if only is not None else names
    for f in dataclasses.fields(cls):
        if f.name not in wanted or f.name in skip:
            continue
        default = _default(f)
        kw: dict[str, Any] = {"dest": f.name, "default": None}
        if isinstance(default, (list, tuple)):
            about = f"(env {env_name(cls, f.name)}, comma-separated)"
        else:
            about = f"(env {env_name(cls, f.name)}, default {default!r})"
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, list):
            kw.update(nargs="+", metavar="VALUE")
        elif isinstance(default, tuple):
            kw["type"] = _comma_separated
        else:
            kw["type"] = int if f.type == "int | None" else type(default) if isinstance(default, (int, float)) else str
        text = help.get(f.name)
        if text or not isinstance(default, bool):
            kw["help"] = f"{text} {about}" if text else about
        extra = dict(overrides.get(f.name, {}))
        flag = extra.pop("flag", "--" + f.name.replace("_", "-"))
        if extra.get("action") == "append":          # one value per flag, kept as given
            kw.pop("type", None)
        parser.add_argument(flag, **{**kw, **extra})


def config_overrides(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The values of `cls`'s fields given on the command line (None where not given)."""
    given = vars(args)
    out = {}
    for f in dataclasses.fields(cls):
        value = given.get(f.name)
        out[f.name] = tuple(value) if isinstance(value, list) and isinstance(_default(f), tuple) else value
    return out

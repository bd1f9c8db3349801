"""Command-line flags generated from a config dataclass (shared/config.py), for every process's CLI.

Each field ``some_name`` becomes ``--some-name`` (dest ``some_name``) whose help names the field's
variable and default, read from the dataclass, so the help cannot drift from the config:

    bool        --x / --no-x
    list        --x A [B ...]                  (the variable: comma-separated)
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


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *,
                     skip: Iterable[str] = ()) -> None:
    """Add a flag for each field of `cls` but those in `skip`."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = _default(f)
        kw: dict[str, Any] = {"dest": f.name, "default": None}
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, list):
            kw.update(nargs="+", metavar="VALUE", help=f"(env {env_name(cls, f.name)}, comma-separated)")
        else:
            kw["type"] = int if f.type == "int | None" else type(default) if isinstance(default, (int, float)) else str
            kw["help"] = f"(env {env_name(cls, f.name)}, default {default!r})"
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def config_overrides(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The values of `cls`'s fields given on the command line (None where not given)."""
    given = vars(args)
    return {f.name: given.get(f.name) for f in dataclasses.fields(cls)}

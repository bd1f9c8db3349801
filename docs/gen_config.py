"""Writes docs/configuration.md from the code: every flag of every `kaiten` command (their argparse
parsers) and every environment variable (the config dataclasses in shared/config.py, the variables
the launcher and the kernels read, and docker-compose.yml's). tests/system/test_docs_site.py fails
when the committed page differs from what this prints.

    python docs/gen_config.py            # rewrites docs/configuration.md
    python docs/gen_config.py --check    # exit 1 when the page is stale
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"

# Variables read outside the config dataclasses, with what reads them (checked against the sources by
# tests/system/test_docs_site.py: every KAITEN_* name in the code is on the page).
OTHER_VARIABLES = [
    ("KAITEN_MODELS_DIR", "where the default model and GGUF files are converted (`shared/config.py`)", "`models/` in the checkout"),
    ("HF_HUB_CACHE, HF_HOME", "the Hugging Face cache a repo id is looked up in, else `$HF_HOME/hub`, else "
     "`~/.cache/huggingface/hub`; nothing is downloaded (`shared/model_source.py`)", "`~/.cache/huggingface/hub`"),
    ("KAITEN_CPU_ISA", "build the C++ kernels for this ISA instead of the CPU's own: `avx512bf16`, `avx512`, `avx2` "
     "or `default` (portable code), e.g. to run the AVX2 build on an AVX-512 CPU (`kernels/cpu_ops_build.py`)", "the CPU's"),
    ("TORCH_EXTENSIONS_DIR", "where the C++ CPU ops' builds are cached (`kernels/cpu_ops_build.py`; "
     "the engine image's are in `/opt/kaiten/kernels`)",
     "`~/.cache/kaiten/torch_extensions`"),
    ("TORCHINDUCTOR_CACHE_DIR", "Inductor's cache of the compiled CPU forward (`engine_worker/model/compiled_forward.py`)",
     "`~/.cache/kaiten/inductor`"),
    ("XDG_CACHE_HOME", "where `--dtype auto` keeps its measured GEMM rates, `kaiten/gemm_rate_cache.json` "
     "(`engine_worker/model/dtype_choice.py`)", "`~/.cache`"),
    ("CXX", "the C++ compiler that builds the C++ CPU ops", "`c++`"),
    ("KAITEN_LOG_LEVEL, KAITEN_LOG_FORMAT", "every process's log level and format (`--log-level`, `--log-format`)",
     "`INFO`, `text`"),
    ("KAITEN_ENGINES_PER_MODEL, KAITEN_READY_TIMEOUT, KAITEN_STOP_TIMEOUT, KAITEN_MODELS_FILE",
     "`kaiten serve` only: see its flags above", "see above"),
]
# Set by `kaiten serve` in its engines' environment, read by no code today (see the report of issue 62).
UNREAD_VARIABLES = {"KAITEN_DRAIN_TIMEOUT"}

COMMANDS = [   # (command, module, how to get its parser, the config classes its flags fill)
    ("kaiten serve", "shared.launcher", "build_parser", ("EngineConfig", "GatewayConfig")),
    ("kaiten engine", "engine_worker.cli", "build_parser", ("EngineConfig", "WorkerConfig")),
    ("kaiten gateway", "gateway.cli", "build_parser", ("GatewayConfig",)),
    ("kaiten tokenizer", "tokenizer_service.service", "main", ("TokenizerServiceConfig",)),
    ("kaiten generate", "engine_worker.engine.offline", "main", ()),
    ("kaiten convert", "shared.convert_cli", "main", ()),
]


class _Parser(Exception):
    pass


def parser_of(module, attr: str) -> argparse.ArgumentParser:
    """The command's parser: its build_parser(), or the one its main() builds (caught at parse_args)."""
    if attr == "build_parser":
        return module.build_parser()
    original = argparse.ArgumentParser.parse_args

    def grab(self, *args, **kwargs):
        raise _Parser(self)
    argparse.ArgumentParser.parse_args = grab
    try:
        getattr(module, attr)(["x"])
    except _Parser as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{module.__name__}.{attr} built no parser")


def field_comments(cls) -> dict[str, str]:
    """Each field's trailing comment in the class source, with the comment lines that continue it."""
    source = inspect.getsource(cls)
    comments: dict[str, list[str]] = {}
    current = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and current != tok.string:
            line = tok.line.strip()
            current = tok.string if re.match(rf"{tok.string}\s*:", line) else None
        elif tok.type == tokenize.COMMENT and current:
            comments.setdefault(current, []).append(tok.string.lstrip("#").strip())
    return {k: " ".join(v) for k, v in comments.items()}


def env_name(cls, field: str) -> str:
    return cls.ENV_NAMES.get(field, f"KAITEN_{field.upper()}")


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def show(value) -> str:
    if value in ("", None, (), []):
        return "empty" if value is not None else "none"
    return f"`{value}`"


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


ENV_IN_HELP = re.compile(r"\s*\((?:env )([A-Z_][A-Z0-9_]*)[^()]*\)")


def flag_rows(parser: argparse.ArgumentParser, classes) -> list[str]:
    fields = {f.name: (cls, f) for cls in classes for f in dataclasses.fields(cls)}
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            names = ", ".join(f"`{o}`" for o in action.option_strings)
            rows.append(f"| {names} | | | {cell(action.help or '')} |")
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}` (positional)"
        if action.choices:
            names += " " + "\\|".join(f"`{c}`" for c in action.choices)
        help_text = action.help or ""
        m = ENV_IN_HELP.search(help_text)
        env = m.group(1) if m else ""
        help_text = ENV_IN_HELP.sub("", help_text)
        default = action.default
        if action.dest in fields and action.default is None:     # the command's own default wins
            cls, f = fields[action.dest]
            env = env or env_name(cls, f.name)
            default = default_of(f)
            help_text = help_text or field_comments(cls).get(f.name, "")
        if isinstance(action, argparse._StoreTrueAction) or isinstance(action, argparse.BooleanOptionalAction):
            default = default if isinstance(default, bool) else False
        rows.append(f"| {names} | {f'`{env}`' if env else ''} | {show(default)} | {cell(help_text)} |")
    return rows


def config_rows(cls) -> list[str]:
    comments = field_comments(cls)
    return [f"| `{env_name(cls, f.name)}` | `{f.name}` | {show(default_of(f))} | {cell(comments.get(f.name, ''))} |"
            for f in dataclasses.fields(cls)]


def compose_rows() -> list[str]:
    text = (ROOT / "docker-compose.yml").read_text()
    found: dict[str, str] = {}
    for name, default in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)(?::?-([^}]*))?\}", text):
        found.setdefault(name, default)
    return [f"| `{name}` | {show(default)} |" for name, default in sorted(found.items())]


def render() -> str:
    saved = dict(os.environ)           # parsers read their defaults from the environment: take none
    for key in list(os.environ):
        if key.startswith("KAITEN_") or key in ("REDIS_URL", "TOKENIZER_URL"):
            del os.environ[key]
    try:
        import importlib

        from shared import config
        out = ["# Configuration", "",
               "<!-- Generated by docs/gen_config.py from the commands' parsers and the config dataclasses in "
               "shared/config.py; do not edit by hand. -->", "",
               "Every setting is a flag of the command that uses it and an environment variable; a flag given "
               "on the command line wins over the variable. `kaiten serve` hands the flags named as in "
               "`vllm serve` to the child that uses them ([Getting started](getting-started.md)); every other "
               "engine or gateway setting reaches its children through the environment they inherit.", ""]
        for command, module_name, attr, class_names in COMMANDS:
            module = importlib.import_module(module_name)
            parser = parser_of(module, attr)
            classes = [getattr(config, n) for n in class_names]
            out += [f"## `{command}`", "", cell(parser.description or ""), "",
                    "| flag | variable | default | what it does |", "|---|---|---|---|",
                    *flag_rows(parser, classes), ""]
        out += ["## Environment variables", "",
                "Each field of the config dataclasses in `shared/config.py` is read from its variable by "
                "`from_env()` (booleans: `1`, `true`, `yes`, `on`; lists: comma-separated), then overridden by "
                "the flag that has its name.", ""]
        for cls in (config.EngineConfig, config.WorkerConfig, config.GatewayConfig, config.TokenizerServiceConfig):
            out += [f"### {cls.__name__}", "", cell((cls.__doc__ or "").strip()) if cls.__doc__ and
                    not cls.__doc__.startswith(cls.__name__) else "", "",
                    "| variable | field | default | meaning |", "|---|---|---|---|", *config_rows(cls), ""]
        spec = config.SpeculativeConfig
        out += ["### `--speculative-config` keys", "", cell(spec.__doc__ or ""), "",
                "| key | default | meaning |", "|---|---|---|",
                *[f"| `{f.name}` | {show(default_of(f))} | {cell(field_comments(spec).get(f.name, ''))} |"
                  for f in dataclasses.fields(spec)], ""]
        out += ["### Other variables", "", "| variable | what it does | default |", "|---|---|---|",
                *[f"| `{name}` | {cell(what)} | {default} |" for name, what, default in OTHER_VARIABLES], ""]
        out += ["## Docker Compose variables", "",
                "`docker-compose.yml` reads these from the environment or an `.env` file beside it "
                "([Deployment](deployment.md)).", "", "| variable | default |", "|---|---|", *compose_rows(), ""]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print("docs/configuration.md is stale: run python docs/gen_config.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

"""The `kaiten` command. Each subcommand lives with the component it runs."""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("shared.launcher", "Serve MODEL: Redis (if needed), one engine worker and one gateway, like vllm serve"),
    "up": ("shared.launcher", "The same as serve"),
    "engine": ("engine_worker.cli", "Run one engine worker on a Redis stream"),
    "gateway": ("gateway.cli", "Run one OpenAI-compatible gateway"),
    "tokenizer": ("tokenizer_service.service", "Run the tokenizer service"),
    "generate": ("engine_worker.engine.offline", "Generate offline, without Redis (the engine as a library)"),
    "convert": ("shared.convert_cli", "Convert the default model or a GGUF file into a model directory, once"),
    "kernels": ("kernels.cpu_ops_build", "Build the C++ CPU ops for this CPU, once (setup.sh and the engine image do)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        from shared.version import kaiten_version
        print(f"kaiten {kaiten_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: kaiten [--version] {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, text) in SUBCOMMANDS.items():
            print(f"  {name:<10} {text}")
        print("\n  kaiten COMMAND --help    that command's flags")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    if module.__name__ == "shared.launcher":
        return module.main(argv[1:], prog=f"kaiten {argv[0]}") or 0
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())

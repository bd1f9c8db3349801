"""The background compile's child process (engine_worker/model/background_compile.py starts it):
builds the engine's model as the engine does, with a KV pool of a few blocks (its block count is a
dynamic size of the graph), compiles the forward's layers (and, asked to, their graphs for steps
with adapter tokens) into Inductor's caches on disk, and exits 0; the engine then loads the graphs
from those caches in seconds.

    python -m engine_worker.model.compile_child  < an EngineConfig as JSON {"config": ..., "lora": bool}

A failure is one line on stderr and exit status 1."""
from __future__ import annotations

import json
import logging
import sys

CHILD_KV_MEMORY = "32MiB"           # a few blocks: the pool's size is not part of the graph


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="compile child: %(message)s")
    spec = json.loads(sys.stdin.read())
    try:
        from engine_worker.model.background_compile import compiled_marker
        from engine_worker.model.model_runner import ModelRunner
        from shared.config import EngineConfig
        config = EngineConfig(**spec["config"]).with_overrides(kv_cache_memory=CHILD_KV_MEMORY, offline=True,
                                                               enforce_eager=False)
        runner = ModelRunner(config, config.model)
        if runner.compiled is None:         # ModelRunner warned why
            return 1
        markers = [compiled_marker(runner.compiled, False)]
        if spec["lora"]:
            runner.enable_lora()
            markers.append(compiled_marker(runner.compiled, True))
        for marker in markers:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    except Exception as e:      # one line for the engine's log; a traceback is no help there
        print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

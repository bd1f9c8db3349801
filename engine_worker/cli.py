"""`kaiten engine`: one engine worker serving the Redis request stream (engine_worker/worker.py).

    kaiten engine [--model DIR] [--redis-url URL] [--engine-id ID] [--dtype ...] [--device ...] ...

Configuration: ``EngineConfig.from_env()`` and ``WorkerConfig.from_env()`` (``KAITEN_*``,
``REDIS_URL``), then the CLI flags that were given. An empty ``--model`` means the default model
(``shared.gguf_convert.ensure_default_model()``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine_worker.consumer_id import default_engine_id
from engine_worker.startup_report import StartupReport
from engine_worker.worker import EngineWorker
from shared.config import EngineConfig, WorkerConfig
from shared.config_cli import add_config_flags, config_overrides
from shared.log_format import add_log_flags, setup_logging
from shared.startup_stages import StartupStages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaiten engine", description="Run one engine worker on the Redis request stream.")
    parser.add_argument("--model", default=None, help="a model directory, a GGUF file or a Hugging Face repo id "
                        "in the local cache (env KAITEN_MODEL; default: the default SmolLM2)")
    parser.add_argument("--redis-url", dest="redis_url", default=None, help="Redis URL (env REDIS_URL)")
    parser.add_argument("--engine-id", dest="engine_id", default=None,
                        help="consumer name; stable per deployment (env KAITEN_ENGINE_ID; default: hostname)")
    add_log_flags(parser)
    parser.add_argument("--healthcheck", action="store_true",
                        help="exit 0 if this engine's heartbeat is in Redis (for container healthchecks)")
    add_config_flags(parser.add_argument_group("engine"), EngineConfig, skip={"model", "offline"})
    add_config_flags(parser.add_argument_group("worker"), WorkerConfig, skip={"redis_url", "engine_id"})
    return parser


def configs_from_args(args: argparse.Namespace, resolve_model: bool = True) -> tuple[EngineConfig, WorkerConfig]:
    ecfg = EngineConfig.from_env().with_overrides(**config_overrides(args, EngineConfig))
    wcfg = WorkerConfig.from_env().with_overrides(**config_overrides(args, WorkerConfig))
    if resolve_model:
        from shared.model_source import resolve_model as resolve
        ecfg = ecfg.with_overrides(model=str(resolve(ecfg.model)))
    return ecfg, wcfg


def healthcheck(wcfg: WorkerConfig) -> int:
    """0 when the heartbeat of this host's engine (or of --engine-id) is fresh in Redis.

    Containers use the lighter ``python -m shared.healthcheck engine`` (no torch import)."""
    from shared.healthcheck import engine_heartbeat
    ok, why = engine_heartbeat(wcfg.redis_url, wcfg.engine_id or default_engine_id(), wcfg.heartbeat_ttl)
    print(("healthy: " if ok else "unhealthy: ") + why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format)
    if args.healthcheck:
        return healthcheck(configs_from_args(args, resolve_model=False)[1])
    from shared.model_source import MODEL_ERRORS
    try:
        ecfg, wcfg = configs_from_args(args, resolve_model=False)
    except ValueError as e:
        print(f"kaiten engine: {e}", file=sys.stderr)
        return 2
    stages = StartupStages(wcfg.served_model_name or (Path(ecfg.model).name if ecfg.model else ""))
    startup = StartupReport(wcfg.redis_url, stages).start()   # from the first second: "starting"
    try:
        with stages.stage("conversion"):   # a GGUF file or the default model, converted once
            ecfg, wcfg = configs_from_args(args)
        stages.set_model(wcfg.served_model_name or Path(ecfg.model).name)
        ecfg.speculative()                 # a bad --speculative-config fails here, saying why
        ecfg.lora_module_paths()           # and a bad --lora-modules entry
        worker = EngineWorker(ecfg, wcfg, startup=startup)
    except (ValueError, *MODEL_ERRORS) as e:    # a model this engine cannot run (a rope type, ...)
        startup.finish()
        print(f"kaiten engine: {e}", file=sys.stderr)
        return 2
    except BaseException:
        startup.finish()
        raise
    worker.install_signal_handlers()
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())

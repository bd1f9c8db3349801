"""`kaiten serve` (alias `kaiten up`): the whole server on one machine, like `vllm serve`.

    kaiten serve [MODEL] [--host H] [--port P] [--redis-url URL] [vLLM-style flags]
    kaiten serve --model A --model B [--engines-per-model N]      # several models, one gateway
    kaiten serve --models-file models.json                         # names, engines and adapters per model

1. resolves the model (``shared.model_source``: a directory, a GGUF file converted once, a repo id
   in the local Hugging Face cache, or the default SmolLM2 converted once);
2. starts a local ``redis-server`` on a free port (no persistence) unless ``REDIS_URL``/``--redis-url``
   is given; with more than one engine and no ``--kv-store-url``, a second one (``maxmemory``
   KAITEN_KV_STORE_MAXMEMORY, default 2gb, ``allkeys-lru``) as the engines' shared KV store;
3. runs the engines of each model (one by default, ``--engines-per-model`` or the models file's
   ``engines``) and one ``kaiten gateway`` serving every model as child processes (the gateway
   tokenizes and detokenizes in-process: no tokenizer service, no ``TOKENIZER_URL``); the first
   engine serves its /metrics on ``KAITEN_METRICS_PORT``, else on 8002 or, where that is taken, a
   free port, and every other engine on a free port;
4. logs the start-up's stages with their times as the engines pass them (model conversion, kernel
   build, weights, KV cache, compilation: ``shared.startup_watch``), waits until the gateway answers
   ``GET /ready``, then prints the URL and a curl line to try;
5. stops every child cleanly on Ctrl-C/SIGTERM (gateway first, Redis last); if any child dies,
   stops the rest and exits non-zero.

Children run in their own sessions, so a Ctrl-C reaches only the launcher, which then stops them
in order; each child also gets SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.generation_defaults import GenerationDefaults, load_generation_defaults
from shared.log_format import setup_logging
from shared.model_source import MODEL_ERRORS, resolve_model
from shared.models_file import ModelEntry, load_models_file
from shared.redis_conn import redact_url
from shared.startup_watch import StartupWatch
from shared.up_flags import EPILOG, add_child_flags, child_args, child_env
from shared.version import kaiten_version

log = logging.getLogger("kaiten.up")   # the name from before serve; log filters keep working


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:
            pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    stop_signal: int = signal.SIGTERM

    def start(self) -> "Child":
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent,
                                     stdin=subprocess.DEVNULL)
        log.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


@dataclass
class Supervisor:
    """Starts children in order, watches them, stops them in reverse order."""
    children: list[Child] = field(default_factory=list)
    stop_timeout: float = 15.0
    stopping: threading.Event = field(default_factory=threading.Event)
    failed: Child | None = None

    def add(self, child: Child) -> Child:
        self.children.append(child.start())
        return child

    def check(self) -> Child | None:
        """The first child that has exited, if any."""
        for c in self.children:
            if c.poll() is not None:
                return c
        return None

    def wait(self, poll_interval: float = 0.2) -> int:
        """Block until asked to stop (0) or a child dies (1); then stop everything."""
        while not self.stopping.is_set():
            dead = self.check()
            if dead is not None:
                self.failed = dead
                log.error("%s exited with code %s; stopping the rest", dead.name, dead.poll())
                break
            self.stopping.wait(poll_interval)
        self.stop_all()
        return 1 if self.failed is not None else 0

    def stop_all(self) -> None:
        """SIGTERM each child, last started first, waiting for each; SIGKILL what outlives the timeout."""
        for c in reversed(self.children):
            if not c.alive():
                continue
            log.info("stopping %s (pid %d)", c.name, c.pid)
            c.signal(c.stop_signal)
            try:
                c.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", c.name, self.stop_timeout)
                c.signal(signal.SIGKILL)
                c.proc.wait(5)


def start_local_redis(port: int | None = None, workdir: str | None = None, name: str = "redis",
                      extra: tuple[str, ...] = ()) -> tuple[Child, str]:
    """A redis-server child on 127.0.0.1 (no persistence), `extra` its further arguments. Returns it
    and its URL once it answers."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: install it (apt-get install redis-server, "
                           "or bash scripts/setup.sh) or point REDIS_URL at a Redis")
    port = port or free_port()
    workdir = workdir or tempfile.mkdtemp(prefix="kaiten-redis-")
    child = Child(name, [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                         "--dir", workdir, "--loglevel", "warning", *extra]).start()
    url = f"redis://127.0.0.1:{port}/0"
    wait_redis(url, child)
    return child, url


KV_STORE_MAXMEMORY = "2gb"      # the KV store `serve` starts: its default bound


def start_kv_store(args: argparse.Namespace, entries: list[ModelEntry], sup: Supervisor) -> None:
    """More than one engine and no --kv-store-url (KAITEN_KV_STORE_URL): start a Redis of its own
    for the engines' shared KV chunks, bounded by KAITEN_KV_STORE_MAXMEMORY, least recently used
    evicted; the engines get its URL."""
    if args.kv_store_url or os.environ.get("KAITEN_KV_STORE_URL") or sum(e.engines for e in entries) < 2:
        return
    memory = os.environ.get("KAITEN_KV_STORE_MAXMEMORY", KV_STORE_MAXMEMORY)
    child, args.kv_store_url = start_local_redis(name="kv-store", extra=("--maxmemory", memory,
                                                                          "--maxmemory-policy", "allkeys-lru"))
    sup.children.append(child)
    log.info("KV store at %s (maxmemory %s, allkeys-lru)", args.kv_store_url, memory)


def wait_redis(url: str, child: Child | None = None, timeout: float = 20.0) -> None:
    from shared.redis_conn import redis_client
    r = redis_client(url, retries=0, socket_timeout=1.0, socket_connect_timeout=1.0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if r.ping():
                return
        except Exception as e:
            if child is not None and not child.alive():
                raise RuntimeError(f"redis-server exited with code {child.poll()}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis at {redact_url(url)} does not answer: {e}") from None
        time.sleep(0.05)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


READY_POLL_S = 0.1


def wait_http_ready(url: str, sup: Supervisor, timeout: float, on_wait=None) -> bool:
    """Poll ``url`` until it answers 2xx; False if a child dies, a stop is asked or time runs out.
    `on_wait()` runs between polls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not sup.stopping.is_set():
        if sup.check() is not None:
            return False
        if http_ok(url):
            return True
        if on_wait is not None:
            on_wait()
        sup.stopping.wait(READY_POLL_S)
    return False


def _kaiten(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def engine_metrics_port(gateway_port: int) -> int:
    """The engine's /metrics port: KAITEN_METRICS_PORT where set (0: none), else the default
    (8002) unless it is taken or the gateway's, else a free port."""
    from shared.config import WorkerConfig
    cfg = WorkerConfig.from_env()
    if os.environ.get("KAITEN_METRICS_PORT"):
        return cfg.metrics_port
    port = cfg.metrics_port
    return port if port != gateway_port and port_is_free(cfg.metrics_host, port) else free_port(cfg.metrics_host)


GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")   # CUDA's and ROCm's


def _cuda_available() -> bool:
    """torch.cuda.is_available(), asked only where a GPU driver is installed: importing torch
    took 1.1 s of a 9 s start on a CPU host, before the engine was launched."""
    if not any(os.path.exists(f) for f in GPU_DRIVER_FILES):
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def banner(base: str, name: str, defaults: GenerationDefaults, keyed: bool = False,
           others: list[str] = ()) -> str:
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    auth = " -H 'Authorization: Bearer <your --api-key>'" if keyed else ""
    more = f"Models: {', '.join([name, *others])}\n" if others else ""
    return (f"\nKaiten is up: {base}  (chat page: {base}/ , OpenAI API: {base}/v1)\n{more}"
            f"Default sampling for fields a request leaves unset ({name}): {defaults.describe()}\n"
            f"Try:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
            f"Ctrl-C stops it.\n")


def _env(name: str, default, typ=str):
    raw = os.environ.get(name, "")
    return typ(raw) if raw else default


def build_parser(prog: str = "kaiten serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run Redis (if needed), the engine workers of each model "
                                "and one gateway serving them all; Ctrl-C stops them all. `kaiten serve` and `kaiten up` are the same "
                                "command.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kaiten {kaiten_version()}")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a model directory, a GGUF file (converted once into KAITEN_MODELS_DIR) or a Hugging Face "
                        "repo id in the local cache (env KAITEN_MODEL; default: the default SmolLM2, converted once)")
    p.add_argument("--model", action="append", default=None,
                   help="the same as MODEL (env KAITEN_MODEL); repeat to serve several models behind one gateway "
                        "(--served-model-name names the first)")
    p.add_argument("--models-file", default=os.environ.get("KAITEN_MODELS_FILE", ""),
                   help="a JSON file of models to serve as well: served names, engines per model, LoRA adapters "
                        "(shared/models_file.py) (env KAITEN_MODELS_FILE)")
    p.add_argument("--engines-per-model", type=int, default=_env("KAITEN_ENGINES_PER_MODEL", 1, int),
                   help="engines for each MODEL / --model (env KAITEN_ENGINES_PER_MODEL, default 1; the models "
                        "file says its own)")
    p.add_argument("--host", default=_env("KAITEN_HOST", "127.0.0.1"),
                   help="gateway address (env KAITEN_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("KAITEN_PORT", 8000, int),
                   help="gateway port (env KAITEN_PORT, default 8000)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""),
                   help="use this Redis instead of starting one (env REDIS_URL)")
    p.add_argument("--ready-timeout", type=float, default=_env("KAITEN_READY_TIMEOUT", 900.0, float),
                   help="seconds to wait for the gateway's /ready (env KAITEN_READY_TIMEOUT, default 900)")
    p.add_argument("--stop-timeout", type=float, default=_env("KAITEN_STOP_TIMEOUT", 20.0, float),
                   help="seconds each child gets to stop (env KAITEN_STOP_TIMEOUT, default 20)")
    add_child_flags(p)
    return p


def model_entries(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[ModelEntry], list[ModelEntry]]:
    """MODEL and each --model (MODEL alone, or the first --model, is the one --served-model-name
    names; "" is the default model), then the models file's; at least one."""
    given = ([args.model_tag] if args.model_tag else []) + [m for m in args.model or [] if m != args.model_tag]
    if args.models_file:
        try:
            from_file = load_models_file(args.models_file)
        except ValueError as e:
            parser.error(str(e))
    else:
        from_file = []
    if not given and not from_file:
        given = [os.environ.get("KAITEN_MODEL", "")]
    if args.engines_per_model < 1:
        parser.error("--engines-per-model must be at least 1")
    if args.served_model_name and not given:
        parser.error("--served-model-name names the first --model, and none is given: name the models file's "
                     "models with its served_model_name")
    first_name = args.served_model_name or ""
    cli = [ModelEntry(m, first_name if i == 0 else "", args.engines_per_model) for i, m in enumerate(given)]
    return cli, from_file


def main(argv: list[str] | None = None, prog: str = "kaiten serve") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cli, from_file = model_entries(args, parser)
    entries = cli + from_file
    setup_logging(args.log_level or os.environ.get("KAITEN_LOG_LEVEL", "INFO"),
                  args.log_format or os.environ.get("KAITEN_LOG_FORMAT", "text"))
    sup = Supervisor(stop_timeout=args.stop_timeout)

    def on_signal(signum, frame):
        if not sup.stopping.is_set():
            log.info("%s: stopping", signal.Signals(signum).name)
        sup.stopping.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    if not port_is_free(args.host if args.host not in ("",) else "0.0.0.0", args.port):
        print(f"{prog}: port {args.port} on {args.host} is in use; pick another with --port", file=sys.stderr)
        return 2

    started = time.monotonic()
    try:
        dirs = [str(resolve_model(e.model)) for e in entries]
    except MODEL_ERRORS as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    log.info("start-up: model conversion took %.1f s", time.monotonic() - started)   # 0 once converted
    if sup.stopping.is_set():
        return 130
    for e, d in zip(entries, dirs):
        log.info("model %s: %s (%d engine%s)", e.served_model_name or Path(d).name, d, e.engines,
                 "" if e.engines == 1 else "s")

    try:
        redis_url = args.redis_url
        if redis_url:
            wait_redis(redis_url)
        else:
            redis_child, redis_url = start_local_redis()
            sup.children.append(redis_child)
        log.info("redis at %s", redact_url(redis_url))
        start_kv_store(args, entries, sup)
        metrics_port = engine_metrics_port(args.port)
        for i, (entry, model) in enumerate(zip(entries, dirs)):
            for k in range(entry.engines):
                name = "engine" if len(entries) == 1 and entry.engines == 1 else f"engine {i}.{k}"
                port = metrics_port if (i, k) == (0, 0) or metrics_port == 0 else free_port()
                env = _child_env(KAITEN_MODEL=model, REDIS_URL=redis_url)
                # The gateway stops first, so there is nobody left to drain in-flight requests for.
                env.setdefault("KAITEN_DRAIN_TIMEOUT", "1")
                if i > 0:                        # KAITEN_SERVED_MODEL_NAME names the first model only
                    env["KAITEN_SERVED_MODEL_NAME"] = ""
                sup.add(Child(name, _kaiten(*engine_args(args, entry, model, redis_url, port, i == 0)), env))
        cli_dirs = dirs[:len(cli)]
        sup.add(Child("gateway", _kaiten("gateway", "--host", args.host, "--port", str(args.port),
                                         *gateway_model_args(args, cli_dirs), *child_args(args, "gateway")),
                      _child_env(KAITEN_MODEL=cli_dirs[0] if cli_dirs else "", KAITEN_HOST=args.host,
                                 KAITEN_PORT=str(args.port), REDIS_URL=redis_url, TOKENIZER_URL="",
                                 **child_env(args, "gateway"))))
    except Exception as e:
        print(f"{prog}: {e}", file=sys.stderr)
        sup.stop_all()
        return 1

    base = f"http://{probe_host}:{args.port}"
    deadline = time.monotonic() + args.ready_timeout
    watch = StartupWatch(redis_url, sum(e.engines for e in entries))
    ready = wait_http_ready(f"{base}/ready", sup, max(1.0, deadline - time.monotonic()), watch.poll)
    watch.close()
    if ready:
        log.info("start-up: ready in %.1f s", time.monotonic() - started)
        gen_mode = args.generation_config or os.environ.get("KAITEN_GENERATION_CONFIG", "auto")
        names = [e.served_model_name or Path(d).name for e, d in zip(entries, dirs)]
        if not entries[0].served_model_name:
            names[0] = os.environ.get("KAITEN_SERVED_MODEL_NAME") or names[0]
        keyed = bool(args.api_key or os.environ.get("KAITEN_API_KEYS"))
        print(banner(base, names[0], load_generation_defaults(dirs[0], gen_mode), keyed, names[1:]), flush=True)
    elif not sup.stopping.is_set() and sup.check() is None:
        log.error("the gateway was not ready after %.0f s", args.ready_timeout)
        sup.stop_all()
        return 1
    return sup.wait()


# Flags of `serve` that name one model's things: the first model's only (adapters fit one base model).
FIRST_MODEL_ONLY = frozenset({"lora_modules"})


def engine_args(args: argparse.Namespace, entry: ModelEntry, model: str, redis_url: str, metrics_port: int,
                first: bool) -> list[str]:
    """One engine of `entry`: its model, served name and adapters, then serve's engine flags and
    the file's engine_args (last, so they win)."""
    out = ["engine", "--model", model, "--redis-url", redis_url, "--metrics-port", str(metrics_port)]
    if entry.served_model_name:
        out += ["--served-model-name", entry.served_model_name]
    if entry.lora_modules:
        out += ["--lora-modules", *(f"{k}={v}" for k, v in entry.lora_modules.items())]
    out += child_args(args, "engine", FIRST_MODEL_ONLY if entry.lora_modules or not first else frozenset())
    if args.device is None and "KAITEN_DEVICE" not in os.environ and _cuda_available():
        out += ["--device", "cuda"]
    return out + list(entry.engine_args)


def gateway_model_args(args: argparse.Namespace, cli_dirs: list[str]) -> list[str]:
    """--model for every model given on the command line (resolved), and the models file."""
    out = [a for d in cli_dirs for a in ("--model", d)]
    if args.models_file:
        out += ["--models-file", args.models_file]
    return out


if __name__ == "__main__":
    sys.exit(main())

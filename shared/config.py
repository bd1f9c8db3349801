"""Configuration from environment variables; the CLI overrides any field.

Each process has one dataclass. ``from_env()`` reads ``KAITEN_*`` variables (plus ``REDIS_URL``
and ``TOKENIZER_URL``), and ``with_overrides(**kw)`` applies CLI flags that were given.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CPU_TOKEN_BUDGET = 1024          # measured: see EngineConfig.token_budget
OFFLINE_TOKEN_BUDGET = 2048      # the offline LLM's default on any device: see EngineConfig.token_budget


def default_models_dir() -> Path:
    return Path(os.environ.get("KAITEN_MODELS_DIR", Path(__file__).resolve().parent.parent / "models"))


def parse_memory(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    s = value.strip().lower().replace(" ", "")
    units = {"gib": 2**30, "gb": 10**9, "g": 2**30, "mib": 2**20, "mb": 10**6, "m": 2**20,
             "kib": 2**10, "kb": 10**3, "k": 2**10, "b": 1}
    for suffix, mult in units.items():
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(float(s))


def _from_env(cls, env_names: dict[str, str]):
    values = {}
    for f in dataclasses.fields(cls):
        var = env_names.get(f.name, f"KAITEN_{f.name.upper()}")
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            values[f.name] = raw.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int):
            values[f.name] = int(raw)
        elif isinstance(default, float):
            values[f.name] = float(raw)
        elif isinstance(default, (tuple, list)):
            values[f.name] = type(default)(x for x in raw.split(",") if x)
        elif f.type == "int | None":
            values[f.name] = int(raw)
        else:
            values[f.name] = raw
    return cls(**values)


class _EnvConfig:
    ENV_NAMES: dict[str, str] = {}

    @classmethod
    def from_env(cls):
        return _from_env(cls, cls.ENV_NAMES)

    def with_overrides(self, **overrides):
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


SPECULATIVE_KEYS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min"), "draft_model": ("model",)}
SPECULATIVE_METHODS = tuple(SPECULATIVE_KEYS)


def _check_method(method) -> None:
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported (EAGLE and suffix speculation "
                         f"are not implemented); choose one of {', '.join(SPECULATIVE_METHODS)}")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method": "draft_model", "model": DIR,
    "num_speculative_tokens": 3}."""
    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str = ""                       # the draft model (same tokenizer as the target)

    @classmethod
    def parse(cls, text: str | dict) -> SpeculativeConfig | None:
        """The config from its JSON text (or map); None for "" or null. ValueError says what is wrong."""
        import json
        if isinstance(text, str):
            if not text.strip():
                return None
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if text is None:
            return None
        if not isinstance(text, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r:.100}")
        if "method" not in text:
            raise ValueError(f"speculative_config needs a 'method' (one of {', '.join(SPECULATIVE_METHODS)})")
        _check_method(text["method"])
        known = {"method", "num_speculative_tokens", *SPECULATIVE_KEYS[text["method"]]}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} for method {text['method']!r}; "
                             f"known: {sorted(known)}")
        config = cls(**text)
        config.validate()
        return config

    def validate(self) -> None:
        _check_method(self.method)
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method 'draft_model' needs a 'model' (the draft model's "
                             "directory or name)")


@dataclass(slots=True)
class EngineConfig(_EnvConfig):
    model: str = ""                      # model directory; "" means the default SmolLM2
    dtype: str = "auto"                  # auto | bfloat16 | float32 | float16 (auto: bf16 on CUDA; on
                                         # the CPU whichever GEMMs run faster here, measured once)
    quantization: str = "auto"           # auto: a GGUF's quantized matrices multiplied as stored (CPU);
                                         # none: dequantized to dtype at load
    device: str = "cpu"
    num_threads: int = 0                 # torch CPU threads; 0 = torch's default (one per core).
                                         # Use 1 when several engines share few cores: OpenMP
                                         # threads that spin-wait on a busy CPU cost ~10 ms per op.
    block_size: int = 16
    kv_cache_memory: str = "auto"        # KV pool budget: bytes, "2GiB", or auto: 1GiB on the CPU,
                                         # on CUDA gpu_memory_utilization minus the profiled peak
    kv_cache_dtype: str = "auto"         # auto | float16 | bfloat16 | float32 (auto: fp16 when serving
                                         # a GGUF's quantized weights as stored, else the model's dtype)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU's memory this engine may use
    enforce_eager: bool = False          # CUDA: no CUDA graphs for decode steps; CPU: no
                                         # torch.compile (the eager model, for debugging)
    max_cuda_graph_batch: int = 512      # CUDA: largest decode batch captured (capped by max_num_seqs)
    max_num_batched_tokens: int = 0      # per-step token budget (prefill chunks + decodes); 0: auto,
                                         # see token_budget()
    max_num_seqs: int = 256              # running batch cap
    max_model_len: int = 0               # 0: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    pack_cpu_weights: bool = True        # CPU fp32: oneDNN-packed projections (faster decode); deterministic packs anyway
    attention_backend: str = "auto"      # auto | cpu (C++) | torch | triton | flash_attn
    deterministic: bool = True           # batch-invariant numerics: a request's tokens do not depend
                                         # on its batch, chunks or prefix hits (docs/deterministic.md)
    offline: bool = False                # the offline LLM (throughput) rather than a server (latency)
    speculative_config: str = ""         # JSON, as vLLM's --speculative-config; "": no speculation
    lora_modules: list[str] = dataclasses.field(default_factory=list)   # LoRA adapters served from
                                         # the start, "name=path" (PEFT directories)
    max_loras: int = 4                   # adapter slots: distinct adapters in one batch; 0: no LoRA
    max_cpu_loras: int | None = None     # adapters kept loaded in memory (LRU); None: max_loras
    max_lora_rank: int = 16              # the largest adapter rank the slots hold
    kv_store_url: str = ""               # a Redis shared by the engines for KV chunks (docs/kv_store.md), any
                                         # --redis-url form; "": none. Its own Redis, not the queue's
    kv_store_chunk_tokens: int = 0       # tokens in a stored chunk (whole blocks); 0: the fewest blocks
                                         # holding 256 KiB of KV (measured: bench/results/kv_store)
    tensor_parallel_size: int = 1        # ranks (processes on this host) one engine's model is split
                                         # over: on the CPU, or one GPU a rank (docs/tensor_parallel.md)
    tensor_parallel_backend: str = "auto"  # the ranks' all-reduce: auto (shm on the CPU, nccl on CUDA) |
                                         # shm (shared memory) | gloo (CPU, torch.distributed) | nccl (CUDA)
    cpu_binding: str = ""                # each rank's cores, "0-3|4-7"; "": this process's split
                                         # evenly (NUMA-aware); "none": not pinned
    ENV_NAMES = {"model": "KAITEN_MODEL"}

    def lora_module_paths(self) -> dict[str, str]:
        """lora_modules as {name: path}; ValueError for an entry that is not name=path."""
        out: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules entry {entry!r} is not name=path")
            if name in out:
                raise ValueError(f"--lora-modules names the adapter {name!r} twice")
            out[name] = path
        return out

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def token_budget(self) -> int:
        """max_num_batched_tokens, or its default. The offline LLM has nobody waiting on a token:
        OFFLINE_TOKEN_BUDGET, so prompts are prefilled in few steps and the batch of decodes
        reaches its full size sooner (vLLM's LLM class does the same). A server: 2048 on a GPU; on
        the CPU 1024 (vLLM's CPU server takes 2048): one long prompt is prefilled in chunks while
        other requests keep decoding, and a burst of prompts in few steps. Measured on a 2-core
        Xeon with AMX (bf16, the GGUF's Q4_1 matrices as stored), `vllm bench serve` at
        concurrency 32 (256-token prompts, 128 out), 3 rounds, medians: budget 256 484.6 tok/s,
        TTFT p50 550 ms, p99 3168; 1024 507.7, 712, 2339; 2048 505.2, 1066, 2110. In-process
        prefill (bench/weights/quant_prefill.py) 0.221 ms a prompt token at 256, 0.187 at 1024, 0.190 at
        2048. Before the panel GEMMs (dequantized chunks into a library GEMM) 256 was ahead, and
        fp32 on a loaded 2-core machine took 0.85 s a step at 128 tokens, 6.9 s at 1024."""
        if self.max_num_batched_tokens > 0:
            return self.max_num_batched_tokens
        if self.offline:
            return OFFLINE_TOKEN_BUDGET
        return 2048 if self.device.startswith("cuda") else CPU_TOKEN_BUDGET


@dataclass(slots=True)
class WorkerConfig(_EnvConfig):
    redis_url: str = DEFAULT_REDIS_URL
    engine_id: str = ""                  # "" -> hostname-pid-random
    served_model_name: str = ""          # the model's name in the API and in its stream names;
                                         # "" -> the directory's name (as the gateway's default)
    heartbeat_interval: float = 0.5      # seconds between heartbeats (gateways move a silent engine's
                                         # requests after 2.5 of them at least: GatewayConfig.failover_timeout)
    heartbeat_ttl: float = 5.0           # heartbeat key TTL; a worker silent this long is dead
    claim_idle_ms: int = 10_000          # janitor claims entries idle this long (dead worker's)
    max_deliveries: int = 3              # after this many deliveries an entry is dead-lettered
    janitor_interval: float = 5.0        # seconds between janitor runs (claims, orphans)
    idle_block_ms: int = 100             # XREADGROUP BLOCK while the engine is idle
    abort_lookback: float = 300.0        # at start, replay aborts this many seconds old
    redis_retry_max: float = 5.0         # cap of the reconnect backoff while Redis is down (s)
    io_thread: bool = True               # run the per-step Redis round on a thread, overlapping the step
    orphan_check_interval: float = 0.25  # seconds between checks for dead gateways and deadlines
    loop_stall_timeout: float = 300.0    # withhold the heartbeat when the loop is stuck this long (s)
    metrics_host: str = "127.0.0.1"      # the engine's Prometheus /metrics address (0.0.0.0 in containers)
    metrics_port: int = 8002             # its port; 0: no /metrics (several engines on a host: one port each)
    ENV_NAMES = {"redis_url": "REDIS_URL"}


@dataclass(slots=True)
class GatewayConfig(_EnvConfig):
    redis_url: str = DEFAULT_REDIS_URL
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = ""                      # model directory (tokenizer, served model name)
    served_model_name: str = ""          # "" -> directory name
    extra_models: tuple[str, ...] = ()   # more models served (--model given again)
    models_file: str = ""                # a JSON file of more models (shared/models_file.py)
    chat_template: str = ""              # a Jinja template file or text; "" -> the tokenizer's own
    tokenizer_url: str = ""              # "" -> prompts tokenized in-process (outputs always are)
    api_keys: tuple[str, ...] = ()
    max_queued_requests: int = 256       # admission control: waiting requests across engines
    max_queued_tokens: int = 262_144     # admission control: waiting prompt tokens
    max_body_bytes: int = 4 * 2**20
    max_n: int = 16
    request_timeout: float = 600.0       # server-side deadline per request (seconds)
    engine_timeout: float = 10.0         # no heartbeat from any engine this long -> error
    failover_timeout: float = 1.5        # a request's engine silent this long -> move the request
                                         # to another engine (at least 2.5 heartbeat intervals)
    max_failovers: int = 2               # moves per request; then the client gets engine_lost
    redis_grace: float = 10.0            # reply channel lost (a Redis restart): continue the requests
                                         # in flight if it is back within this long, else fail them
    redis_max_connections: int = 16      # the gateway's command pool (pub/sub has its own); a full
                                         # pool makes commands wait for a connection, not open more
    generation_config: str = "auto"      # default sampling: auto (the model's generation_config.json)
                                         # | vllm (OpenAI defaults) | a directory holding one
    sse_keepalive: float = 0.0           # seconds without a frame before a ": keep-alive" SSE comment; 0: off
    allowed_origins: tuple[str, ...] = ()  # key-less WebSocket: Origins besides the page's own ("*": any)
    max_json_depth: int = 64             # deeper request JSON is refused (400)
    routing: str = "prefix"              # prefix: cache-aware (gateway/backend/placement.py) | queue: the shared stream
    routing_cache_threshold: float = 0.5  # route by prefix when an engine holds this share of the prompt
    routing_balance_abs_threshold: int = 8      # ... unless it is busier than the least loaded engine
    routing_balance_rel_threshold: float = 1.5  # by more than this many requests and this many times
    routing_spill_timeout: float = 5.0   # routed but not admitted this long: moved to the shared stream
    ENV_NAMES = {"redis_url": "REDIS_URL", "tokenizer_url": "TOKENIZER_URL", "api_keys": "KAITEN_API_KEYS"}


@dataclass(slots=True)
class TokenizerServiceConfig(_EnvConfig):
    host: str = "127.0.0.1"
    port: int = 8001
    model: str = ""
    ENV_NAMES = {"model": "KAITEN_MODEL"}

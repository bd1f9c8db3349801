"""The flags `kaiten serve` (alias `up`) hands on to its children, named as in `vllm serve`.

Each flag is given to one child as the same flag, only when it was given to `serve`; otherwise the
child reads its ``KAITEN_*`` variable from the environment it inherits. The API key travels in the
gateway's environment (``KAITEN_API_KEYS``), never on a command line that `ps` shows.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from shared.log_format import LOG_FORMATS, LOG_LEVELS


@dataclass(slots=True, frozen=True)
class ChildFlag:
    flag: str
    env: str
    child: str                               # "engine" | "gateway"
    help: str
    type: Callable | None = str              # None: a switch (no value)
    nargs: str | None = None                 # "+": one or more values

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _speculative_config(text: str) -> str:
    """Checked by `serve` before any child starts; handed on as given."""
    from shared.config import SpeculativeConfig
    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


CHILD_FLAGS = (
    ChildFlag("--dtype", "KAITEN_DTYPE", "engine",
              "auto | bfloat16 | float16 | float32 (auto: bf16 on CUDA; on the CPU whichever of bf16 "
              "and fp32 runs the model's GEMMs faster, measured once and cached)"),
    ChildFlag("--quantization", "KAITEN_QUANTIZATION", "engine",
              "auto: a GGUF model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights as stored (CPU); none: dequantized "
              "to --dtype (default auto)"),
    ChildFlag("--device", "KAITEN_DEVICE", "engine", "cpu | cuda | cuda:N (default: cuda when torch sees a GPU)"),
    ChildFlag("--max-model-len", "KAITEN_MAX_MODEL_LEN", "engine", "context length (default: the model's)", int),
    ChildFlag("--max-num-seqs", "KAITEN_MAX_NUM_SEQS", "engine", "most requests in one batch (default 256)", int),
    ChildFlag("--max-num-batched-tokens", "KAITEN_MAX_NUM_BATCHED_TOKENS", "engine",
              "tokens per step (default 2048 on a GPU, 1024 on the CPU)", int),
    ChildFlag("--kv-cache-memory", "KAITEN_KV_CACHE_MEMORY", "engine",
              "KV cache budget: bytes or e.g. 2GiB (default auto)"),
    ChildFlag("--kv-cache-dtype", "KAITEN_KV_CACHE_DTYPE", "engine",
              "auto | float16 | bfloat16 | float32 (auto: float16 when serving a GGUF's quantized weights "
              "as stored, as llama.cpp does; else --dtype)"),
    ChildFlag("--gpu-memory-utilization", "KAITEN_GPU_MEMORY_UTILIZATION", "engine",
              "CUDA: fraction of the GPU's memory the engine may use (default 0.9)", float),
    ChildFlag("--enforce-eager", "KAITEN_ENFORCE_EAGER", "engine",
              "no CUDA graphs, no torch.compile (the eager model)", None),
    ChildFlag("--no-deterministic", "KAITEN_DETERMINISTIC", "engine",
              "batch-invariant numerics off, as KAITEN_DETERMINISTIC=0: each kernel its fastest plan for the "
              "step's rows, so a request's tokens may depend on its batch (on CPUs with AMX, prompts and large "
              "batches on bf16 tiles; docs/deterministic.md)", None),
    ChildFlag("--speculative-config", "KAITEN_SPECULATIVE_CONFIG", "engine",
              'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 5, '
              '"prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3} '
              '(default: none)', _speculative_config),
    ChildFlag("--lora-modules", "KAITEN_LORA_MODULES", "engine",
              "LoRA adapters to serve, as name=path (PEFT directories); requests pick one by its name",
              nargs="+"),
    ChildFlag("--max-loras", "KAITEN_MAX_LORAS", "engine",
              "most LoRA adapters in one batch (adapter slots; default 4; 0: no LoRA)", int),
    ChildFlag("--max-cpu-loras", "KAITEN_MAX_CPU_LORAS", "engine",
              "LoRA adapters kept loaded in memory, least recently used evicted (default: --max-loras)", int),
    ChildFlag("--max-lora-rank", "KAITEN_MAX_LORA_RANK", "engine", "the largest LoRA rank served (default 16)", int),
    ChildFlag("--tensor-parallel-size", "KAITEN_TENSOR_PARALLEL_SIZE", "engine",
              "processes (ranks) each engine's model is split over, on this host's CPU or one GPU a rank "
              "(default 1; docs/tensor_parallel.md)", int),
    ChildFlag("--tensor-parallel-backend", "KAITEN_TENSOR_PARALLEL_BACKEND", "engine",
              "the ranks' all-reduce: auto (shm on the CPU, nccl on CUDA), shm, gloo (CPU) or nccl (CUDA) "
              "(default auto)"),
    ChildFlag("--cpu-binding", "KAITEN_CPU_BINDING", "engine",
              'each rank\'s cores, "0-3|4-7" (default: the cores split evenly, NUMA-aware; none: not pinned)'),
    ChildFlag("--kv-store-url", "KAITEN_KV_STORE_URL", "engine",
              "a Redis the engines share KV chunks through (docs/kv_store.md); any --redis-url form or "
              "redis+cluster:// (default: with more than one engine, one started for it)"),
    ChildFlag("--served-model-name", "KAITEN_SERVED_MODEL_NAME", "gateway",
              "the model's name in the API (default: the directory's name)"),
    ChildFlag("--allowed-origins", "KAITEN_ALLOWED_ORIGINS", "gateway",
              "without an API key, web pages of these origins may use the WebSocket besides the gateway's "
              "own page (comma-separated, * for any)"),
    ChildFlag("--routing", "KAITEN_ROUTING", "gateway",
              "prefix: each request to the engine holding most of its prompt's KV blocks, load permitting; "
              "queue: the shared stream (default prefix)"),
    ChildFlag("--generation-config", "KAITEN_GENERATION_CONFIG", "gateway",
              "default sampling: auto (the model's generation_config.json), vllm (the OpenAI defaults) "
              "or a directory (default auto)"),
)


def add_child_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("passed to the engine and the gateway (as in vllm serve)")
    group.add_argument("--api-key", dest="api_key", action="append", default=None,
                       help="require this key (Authorization: Bearer KEY); repeat for more "
                            "(env KAITEN_API_KEYS, comma-separated)")
    for f in CHILD_FLAGS:
        if f.type is None:
            group.add_argument(f.flag, dest=f.dest, action="store_true", default=None, help=f"{f.help} (env {f.env})")
        else:
            group.add_argument(f.flag, dest=f.dest, type=f.type, nargs=f.nargs, default=None,
                               help=f"{f.help} (env {f.env})")
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None,
                       help="every process's log level (env KAITEN_LOG_LEVEL, default INFO)")
    group.add_argument("--log-format", type=str.lower, choices=LOG_FORMATS, default=None,
                       help="every process's log format: text, or json (one object per line) "
                            "(env KAITEN_LOG_FORMAT, default text)")


def child_args(args: argparse.Namespace, child: str, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags given to `serve` that belong to `child` (but those whose dest is in `skip`), as
    that child's command-line arguments."""
    out: list[str] = []
    for f in CHILD_FLAGS:
        value = getattr(args, f.dest)
        if f.child != child or value is None or f.dest in skip:
            continue
        if f.type is None:
            out.append(f.flag)
        else:
            out += [f.flag, *map(str, value if isinstance(value, list) else [value])]
    if args.log_level is not None:
        out += ["--log-level", args.log_level]
    if args.log_format is not None:
        out += ["--log-format", args.log_format]
    return out


def child_env(args: argparse.Namespace, child: str) -> dict[str, str]:
    """Environment entries `child` gets from `serve`'s flags (the API keys, for the gateway)."""
    if child == "gateway" and args.api_key:
        return {"KAITEN_API_KEYS": ",".join(args.api_key)}
    return {}


EPILOG = """\
Each flag above also reads the variable it names. Other variables:
  KAITEN_MODELS_DIR   where the default model and GGUF files are converted (default ./models)
  HF_HUB_CACHE        the Hugging Face cache a repo id is looked up in (else $HF_HOME/hub,
                      else ~/.cache/huggingface/hub); nothing is downloaded
  KAITEN_NUM_THREADS  torch CPU threads of the engine (0: one per core)
  KAITEN_KV_STORE_MAXMEMORY  maxmemory of the KV store serve starts (default 2gb)
  KAITEN_METRICS_PORT the engine's Prometheus /metrics port (default 8002, or a free one if
                      that is taken; 0: none); the gateway's is GET /metrics on --port
Every flag of `kaiten engine --help` and `kaiten gateway --help` has a KAITEN_* variable too.
"""

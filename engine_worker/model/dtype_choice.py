"""--dtype auto on the CPU: bf16 or fp32, whichever runs the model's GEMMs faster on this machine.

bf16 halves the bytes of weights and KV cache, but only CPUs with bf16 instructions multiply in it
at speed: without AVX512-BF16 torch and oneDNN emulate it, and even with them (Intel without AMX)
a bf16 GEMM may run slower than an fp32 one. So the choice is measured, not read from the CPU's
flags: the projections of one layer at the model's shapes, on a few row counts (decode and
prefill), in each dtype, through the layers the engine would use (oneDNN-packed where supported),
on one thread.
The rates are measured once per CPU model, torch version and shape set, and kept in the cache
file gemm_rate_cache.json under ~/.cache/kaiten (XDG_CACHE_HOME if set).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ROWS = (1, 16, 128)           # a decode step, a small batch, a prefill chunk
REPEATS = 7
# The default model's (SmolLM2-135M) projections (N, K): qkv, o, gate_up, down.
DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


@dataclass(slots=True)
class GemmRates:
    bf16: float               # GFLOP/s over the shapes and rows
    fp32: float


def faster_dtype(rates: GemmRates) -> torch.dtype:
    """bf16 only where it is strictly faster: fp32 is exact, so a tie goes to it."""
    return torch.bfloat16 if rates.bf16 > rates.fp32 else torch.float32


def cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kaiten" / "gemm_rate_cache.json"


def cache_key(shapes) -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | torch {torch.__version__} | one thread | " + " ".join(f"{n}x{k}" for n, k in shapes)


def measure_rates(shapes) -> GemmRates:
    """GFLOP/s of y = x W^T over `shapes` x ROWS in each dtype: the median of REPEATS passes, the
    dtypes' passes alternating (drift touches both alike), on one thread. The choice is between the
    core's bf16 and fp32 instructions; a team of threads measured while another process holds a
    core waits at every barrier (2 threads once measured 10.7 GFLOP/s in both dtypes, where one
    thread reaches 160 in bf16 and 93 in fp32), and that result would be cached for good."""
    from engine_worker.model.packed_linear import PackedLinear
    passes = {}
    for dtype in (torch.bfloat16, torch.float32):
        packed = PackedLinear.supported(torch.device("cpu"), dtype)
        layers = [PackedLinear(w, None) if packed else (lambda x, w=w: F.linear(x, w))
                  for w in (torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes)]
        inputs = [[torch.randn(m, k, dtype=dtype) for m in ROWS] for _, k in shapes]
        passes[dtype] = lambda layers=layers, inputs=inputs: [layer(x) for layer, xs in zip(layers, inputs) for x in xs]
    times = {dtype: [] for dtype in passes}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for i in range(REPEATS + 1):                        # the first round warms up
                for dtype, one_pass in passes.items():
                    t0 = time.perf_counter()
                    one_pass()
                    if i:
                        times[dtype].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    flops = sum(2 * n * k * m for n, k in shapes for m in ROWS)
    rates = {dtype: flops / statistics.median(t) / 1e9 for dtype, t in times.items()}
    return GemmRates(bf16=rates[torch.bfloat16], fp32=rates[torch.float32])


def cpu_auto_dtype(shapes=DEFAULT_SHAPES, path: Path | None = None) -> torch.dtype:
    """The faster dtype for `shapes` here, from the cache or measured (and then cached)."""
    path = path or cache_path()
    key = cache_key(shapes)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    source = f"cached in {path}"
    if key in cache:
        rates = GemmRates(**cache[key])
    else:
        rates = measure_rates(shapes)
        cache[key] = asdict(rates)
        source = f"measured, now cached in {path}"
        _write_atomically(path, json.dumps(cache, indent=1))
    dtype = faster_dtype(rates)
    log.info("dtype auto: %s (GEMM rate at the model's shapes: bf16 %.1f, fp32 %.1f GFLOP/s; %s)",
             str(dtype).removeprefix("torch."), rates.bf16, rates.fp32, source)
    return dtype


def _write_atomically(path: Path, text: str) -> None:
    """Engines starting together each write a whole file; a reader never sees half of one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("could not write the GEMM rate cache %s: %s", path, e)

"""CppAttention: the fused C++ paged-attention kernel for the CPU (kernels/csrc/paged_attention_cpu.cpp).

One kernel call per layer covers the whole step, decodes and prefill chunks alike: it reads K/V
in place from the paged cache (no gather copy), processes the G query heads of a kv head together
with an online softmax in fp32, and spreads (sequence, kv head, query tile) work items over the
torch threads. float32 and bfloat16.

The extension is compiled on first use with torch.utils.cpp_extension (needs a C++ compiler with
OpenMP, and ninja), once per process, and cached on disk: TORCH_EXTENSIONS_DIR if set, else
~/.cache/kaiten/torch_extensions, under the torch version. The build targets the CPU it runs on
(AVX-512 with bf16, AVX-512, AVX2, else at::vec's portable code; KAITEN_CPU_ISA forces one), and
the capability and a digest of the sources, flags, compiler and Python ABI are part of the
extension's name: machines and kernel versions that share the cache get builds of their own, and
every checkout and venv of the same kernels (a worktree, a CI clone) imports the one build. cpp_attention_available() says whether the kernel can be used;
get_attention_backend("auto") falls back to the torch backend when it cannot.

The extension also registers dispatcher ops for compiled graphs (kaiten_cpu::paged_attention,
::write_kv, ::packed_linear from csrc/packed_linear_cpu.cpp, oneDNN's linear on a packed weight,
::quant_linear from csrc/quant_linear_cpu.cpp, GGUF-quantized weights multiplied as stored, and
::bf16_linear from csrc/bf16_linear_cpu.cpp, bf16-stored weights widened to fp32 on the way in,
::lora_add_ from csrc/lora_cpu.cpp, batched LoRA in place);
cpu_ops_loaded() says whether they are there.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kernels.interface import AttentionMetadata

__all__ = ["CppAttention", "cpp_attention_available", "cpu_ops_loaded", "load_extension"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "packed_linear_cpu.cpp", _CSRC / "quant_linear_cpu.cpp",
            _CSRC / "bf16_linear_cpu.cpp", _CSRC / "lora_cpu.cpp", _CSRC / "argmax_cpu.cpp"]
# The loaded extension module, or the reason it could not be built (per process).
_EXTENSION_CACHE: dict[str, object] = {}
_BUILT = ".kaiten-built"     # in a build directory, once its build has finished: the library's file name


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"]
_ISA_FLAGS = {
    # every AVX512-BF16 CPU has VNNI; the AMX code runs only where the CPU and the kernel allow it
    "avx512bf16": _AVX512 + ["-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
    "default": [],                 # at::vec's portable code
}


def cpu_capability() -> tuple[str, list[str]]:
    """(name, compiler flags) of the vector ISA to build for: at::vec picks its implementation
    from the CPU_CAPABILITY_* macro, the -m flags let the compiler emit it. KAITEN_CPU_ISA
    (avx512bf16, avx512, avx2, default) forces one, e.g. to test the AVX2 build."""
    forced = os.environ.get("KAITEN_CPU_ISA")
    if forced:
        if forced not in _ISA_FLAGS:
            raise ValueError(f"KAITEN_CPU_ISA={forced!r}: expected one of {', '.join(_ISA_FLAGS)}")
        return forced, _ISA_FLAGS[forced]
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        isa = "avx512bf16" if "avx512_bf16" in flags else "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        isa = "avx2"
    else:
        isa = "default"
    return isa, _ISA_FLAGS[isa]


def build_flags(isa_flags: list[str]) -> dict[str, list[str]]:
    """cpp_extension.load's compiler and linker flags for the kernels built with one ISA's flags.
    -fopenmp: at::parallel_for is inline OpenMP code; the extension joins torch's libgomp."""
    return {"extra_cflags": ["-O3", "-fopenmp", *isa_flags], "extra_ldflags": ["-fopenmp"]}


def int8_activations_built() -> bool:
    """Whether the extension's build multiplies int8-rounded activations (quant_linear's int8
    method: AVX-512 and AVX2 builds; the portable one takes the exact method for those rows)."""
    return int8_x_levels(8) > 0


def int8_x_levels(bits: int) -> int:
    """The integer levels of x's int8 rounding against `bits`-bit weights, as the loaded build
    says (quant_linear's x_levels): 7 bits (63) against int8 weights where it has no
    AVX512-VNNI, else 127; 0 where it has no int8 method. Loads the extension."""
    load_extension()
    return torch.ops.kaiten_cpu.int8_x_levels(bits)


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "kaiten" / "torch_extensions"
    # the torch version too: an extension is tied to the libtorch it was built against
    path = Path(root) / f"torch-{torch.__version__}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _kernel_files() -> dict[str, bytes]:
    """The extension's sources and the headers they include, by path under csrc/."""
    files = [*_SOURCES, *sorted(_CSRC.glob("**/*.h"))]
    return {str(p.relative_to(_CSRC)): p.read_bytes() for p in files}


def _compiler_id(cxx: str) -> bytes:
    """The compiler's own version line: a build from another compiler is another build."""
    out = subprocess.run([cxx, "--version"], capture_output=True, timeout=30)
    return out.stdout.split(b"\n", 1)[0]


def kernel_digest(files: dict[str, bytes], cflags: list[str], cxx: str) -> str:
    """A digest of kernel sources (by path under csrc/), their flags, the compiler and the Python
    ABI, part of a build's name (the torch version names the folder above it): checkouts with
    different kernels (another branch, an older release) never load each other's build from the
    shared cache, and checkouts of the same kernels share one."""
    key = b"".join(name.encode() + b"\0" + data for name, data in files.items())
    key += " ".join(cflags).encode() + _compiler_id(cxx) + sys.implementation.cache_tag.encode()
    return hashlib.sha1(key).hexdigest()[:12]


def stage_files(folder: Path, files: dict[str, bytes]) -> None:
    """Kernel sources copied into a build's folder, which cpp_extension then builds from: its
    build.ninja names sources by absolute path, so building from the checkout would tie the build
    to one folder. A file is written only when its bytes differ, so ninja (by mtime) finds a
    finished build up to date."""
    for name, data in files.items():
        dst = folder / name
        if not dst.exists() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)


def _import_built(build_dir: Path, name: str):
    """The finished build's module, imported as it is, or None where there is none. cpp_extension.load
    would run ninja again, which rebuilds whenever its command changed: torch's include paths name
    the venv, so every venv (a CI clone's) would rebuild the same kernels. The digest in the name
    already covers what the build depends on."""
    marker = build_dir / _BUILT
    if not marker.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, build_dir / marker.read_text())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder per build directory, through a lock the kernel drops when its holder dies.
    cpp_extension's own lock is a plain file that a build killed midway leaves behind, and every
    later load would wait on it for ever; holding this lock, such a file can only be stale."""
    with open(build_dir / ".kaiten-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def _put_venv_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary sits next to the venv's
    python, which is not on PATH when the venv is not activated."""
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


def load_extension():
    """The compiled extension (built on first use, then loaded from the cache); raises on failure."""
    if "module" in _EXTENSION_CACHE:
        return _EXTENSION_CACHE["module"]
    if "error" in _EXTENSION_CACHE:
        raise RuntimeError(_EXTENSION_CACHE["error"])
    from torch.utils import cpp_extension

    try:
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
        _put_venv_ninja_on_path()
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (pip install ninja, or apt-get install ninja-build)")
        cap, cflags = cpu_capability()
        files = _kernel_files()
        name = f"kaiten_paged_attention_{cap.replace('+', '_')}_{kernel_digest(files, cflags, cxx)}"
        build_dir = _build_dir(name)
        with _build_lock(build_dir):
            module = _import_built(build_dir, name)
            if module is None:
                log.info("building the CPU attention kernel (%s) in %s ...", cap, build_dir)
                stage_files(build_dir / "src", files)
                sources = [str(build_dir / "src" / p.relative_to(_CSRC)) for p in _SOURCES]
                module = cpp_extension.load(name=name, sources=sources, **build_flags(cflags),
                                            build_directory=str(build_dir), verbose=False)
                (build_dir / _BUILT).write_text(Path(module.__file__).name)
    except Exception as e:  # noqa: BLE001 - any build or load failure means "not available"
        _EXTENSION_CACHE["error"] = f"{type(e).__name__}: {e}"
        raise
    _register_fakes()
    _EXTENSION_CACHE["module"] = module
    return module


def _register_fakes() -> None:
    """Shapes of the extension's dispatcher ops (kaiten_cpu::...) for torch.compile's tracing."""
    torch.library.register_fake("kaiten_cpu::paged_attention")(
        lambda q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, scale, window=0, invariant=True:
        torch.empty_like(q))
    torch.library.register_fake("kaiten_cpu::write_kv")(
        lambda key, value, k_cache, v_cache, slot_mapping: None)
    torch.library.register_fake("kaiten_cpu::write_kv_attention")(
        lambda q, key, value, k_cache, v_cache, slot_mapping, cu_seqlens_q, seqlens_k, block_tables, scale, window=0,
        invariant=True: torch.empty_like(q))
    torch.library.register_fake("kaiten_cpu::packed_linear")(
        lambda x, packed, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))
    torch.library.register_fake("kaiten_cpu::quant_linear")(
        lambda x, tiles, n, k, bits, group, has_mins, min_dense_rows, int8_rows=0: x.new_empty((*x.shape[:-1], n)))
    torch.library.register_fake("kaiten_cpu::bf16_linear")(
        lambda x, weight, bias, min_dense_rows: x.new_empty((*x.shape[:-1], weight.shape[0])))
    torch.library.register_fake("kaiten_cpu::lora_add_")(
        lambda y, x, a, b, splits, token_index, bounds: None)


def cpu_ops_loaded() -> bool:
    """Whether the extension's dispatcher ops (kaiten_cpu::paged_attention, ::write_kv,
    ::packed_linear, ::quant_linear, ::bf16_linear, ::lora_add_, ::argmax_rows) are registered in this process. A
    compiled graph calls them directly: an op defined in Python costs about 15 us a call in its
    wrappers (PackedLinear; CppAttention exists only with them). Traced by Dynamo as one guard on
    _EXTENSION_CACHE."""
    return "module" in _EXTENSION_CACHE


def cpp_attention_available() -> bool:
    """Whether the C++ kernel builds and loads here (the first call may compile it)."""
    if "module" in _EXTENSION_CACHE:
        return True
    if "error" in _EXTENSION_CACHE:
        return False
    try:
        load_extension()
        return True
    except Exception:  # noqa: BLE001
        log.warning("the CPU attention kernel is unavailable, using the torch backend: %s",
                    _EXTENSION_CACHE["error"])
        return False


class CppAttention:
    """CPU paged attention through the fused C++ kernel's dispatcher ops (kaiten_cpu::...).
    Stateless, so one instance may serve several threads; the ops have fake kernels, so a compiled
    model calls them directly (compile_safe), without a Python-defined op in between.
    deterministic: each row's result independent of the batch, the chunking and the threads (the
    kernel's `invariant`; docs/deterministic.md), else the fastest plan."""

    name = "cpu"
    cuda_graph_safe = False
    compile_safe = True
    any_kv_dtype = True         # fp32 or bf16 queries; an fp32, bf16 or fp16 cache

    def __init__(self, deterministic: bool = True) -> None:
        load_extension()
        self.deterministic = deterministic

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        torch.ops.kaiten_cpu.write_kv(*_kv_args(key, value, k_cache, v_cache, slot_mapping))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        out = torch.ops.kaiten_cpu.paged_attention(_kernel_q(q), k_cache, v_cache, *_metadata(meta), float(scale),
                                                   int(window), self.deterministic)
        return out.to(q.dtype)

    def write_kv_and_attention(self, q, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                               window: int = 0):
        """One op, kaiten_cpu::write_kv_attention."""
        kv = _kv_args(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.ops.kaiten_cpu.write_kv_attention(_kernel_q(q), *kv, *_metadata(meta), float(scale), int(window),
                                                      self.deterministic)
        return out.to(q.dtype)


def _kernel_q(q: torch.Tensor) -> torch.Tensor:
    """q in a dtype the kernel takes (fp32 or bf16; anything else widened to fp32)."""
    return q if q.dtype in (torch.float32, torch.bfloat16) else q.to(torch.float32)


def _kv_args(key, value, k_cache, v_cache, slot_mapping) -> tuple:
    """write_kv's arguments: the rows in the cache's dtype, the slots as int64."""
    return key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping.to(torch.int64)


def _metadata(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _int32(meta.cu_seqlens_q), _int32(meta.seqlens_k), _int32(meta.block_tables)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)

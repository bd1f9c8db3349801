"""Builds and loads every C++ CPU op of kernels/csrc as one shared library, registered with the
dispatcher (kaiten_cpu::paged_attention, ::write_kv, ::write_kv_attention, ::packed_linear,
::quant_linear, ::bf16_linear, ::lora_add_, ::argmax_rows, ::int8_x_levels,
::shm_all_reduce_).

The sources include ATen's and torch/library.h's headers only (csrc/aten_ops.h), not
torch/extension.h, and register their ops with TORCH_LIBRARY: no pybind11, no Python module. The
library is built with ninja, its translation units in parallel, and loaded with
torch.ops.load_library (bench/results/kernel_build/README.md: the cold build's time).

One build per machine and kernels: it targets the CPU it runs on (AVX-512 with bf16, AVX-512,
AVX2, else at::vec's portable code; KAITEN_CPU_ISA forces one), and a digest of the sources, the
flags and the compiler names it, under the torch version, in TORCH_EXTENSIONS_DIR if set, else
~/.cache/kaiten/torch_extensions. Machines and kernel versions that share the cache get builds of
their own, and every checkout and venv of the same kernels (a worktree, a CI clone) loads the one
build. `bash scripts/setup.sh` and the engine image build it ahead (`kaiten kernels`); the engine
builds it on first use where they did not. cpu_ops_available() builds or loads it once per
process and says whether it is there; a failure is one line, and callers fall back to torch.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["compile_flags", "cpu_capability", "cpu_ops_available", "cpu_ops_error", "cpu_ops_loaded",
           "int8_activations_built", "int8_x_levels", "kernel_digest", "kernel_files", "load_cpu_ops", "main",
           "stage_files"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ["paged_attention_cpu.cpp", "packed_linear_cpu.cpp", "quant_linear_cpu.cpp", "bf16_linear_cpu.cpp",
           "lora_cpu.cpp", "argmax_cpu.cpp", "shm_all_reduce_cpu.cpp", "dequantize_rows_cpu.cpp"]
LIBRARY = "kaiten_cpu_ops.so"
OPT_FLAGS = ["-O3", "-fopenmp"]   # -fopenmp: at::parallel_for is inline OpenMP code, run on torch's libgomp
_BUILT = ".kaiten-built"          # in a build directory, once its build has finished
# The loaded library's path, or the reason it could not be built or loaded (per process).
_STATE: dict[str, object] = {}

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"]
_ISA_FLAGS = {
    # every AVX512-BF16 CPU has VNNI; the AMX code runs only where the CPU and the kernel allow it
    "avx512bf16": _AVX512 + ["-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
    "default": [],                 # at::vec's portable code
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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


def compile_flags(isa_flags: list[str]) -> list[str]:
    """Every flag a translation unit is compiled with, but the include path (which names the venv)."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*OPT_FLAGS, "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *isa_flags]


def kernel_files() -> dict[str, bytes]:
    """The library's sources and the headers they include, by path under csrc/."""
    files = [*(CSRC / s for s in SOURCES), *sorted(CSRC.glob("**/*.h"))]
    return {str(p.relative_to(CSRC)): p.read_bytes() for p in files}


def _compiler_id(cxx: str) -> bytes:
    """The compiler's own version line: a build from another compiler is another build."""
    out = subprocess.run([cxx, "--version"], capture_output=True, timeout=30)
    return out.stdout.split(b"\n", 1)[0]


def kernel_digest(files: dict[str, bytes], cflags: list[str], cxx: str) -> str:
    """A digest of kernel sources (by path under csrc/), their build file (flags and commands) and
    the compiler, part of a build's name (the torch version names the folder above it): checkouts
    with different kernels (another branch, an older release) never load each other's build from
    the shared cache, and checkouts of the same kernels share one."""
    key = b"".join(name.encode() + b"\0" + data for name, data in files.items())
    key += _ninja_file(cxx, cflags).encode() + _compiler_id(cxx)
    return hashlib.sha1(key).hexdigest()[:12]


def stage_files(folder: Path, files: dict[str, bytes]) -> None:
    """Kernel sources copied into a build's folder, which the build then reads: a build from the
    checkout would be tied to its folder. A file is written only when its bytes differ, so ninja
    (by mtime) finds a finished build up to date."""
    for name, data in files.items():
        dst = folder / name
        if not dst.exists() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "kaiten" / "torch_extensions"
    # the torch version too: the library is tied to the libtorch it was built against
    return Path(root) / f"torch-{torch.__version__}" / name


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder per build directory, through a lock the kernel drops when its holder dies (a
    build killed midway leaves nothing that blocks the next)."""
    with open(build_dir / ".kaiten-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _ninja() -> str:
    """The pinned pip package's binary beside the venv's python, else ninja from PATH. The pinned
    one first, whatever PATH says: ninja versions write different build logs, and one that meets
    another's log starts over, compiling every object again (Debian's 1.11 against the pin's 1.13)."""
    found = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    if found is None:
        raise RuntimeError("ninja is not installed (pip install ninja, or apt-get install ninja-build)")
    return found


def _link_torch(build_dir: Path) -> None:
    """build_dir/torch points at this process's torch. build.ninja names torch through it, so its
    commands are the same from every venv of this torch version (the folder's name holds the
    version) and ninja, which rebuilds whatever command changed, keeps a build another venv began."""
    link, target = build_dir / "torch", Path(torch.__file__).resolve().parent
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    staged = build_dir / f".torch-{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(target, target_is_directory=True)
    os.replace(staged, link)


def _ninja_file(cxx: str, cflags: list[str]) -> str:
    """build.ninja: each source compiled on its own (ninja runs them in parallel), then linked
    against torch's libraries, which the process that loads it has loaded already. Torch's headers
    are system headers (-isystem), so no depfile names them."""
    q = shlex.quote
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {q(cxx)}",
        f"cflags = {' '.join(map(q, cflags))} -isystem torch/include",
        "ldflags = -shared -fopenmp -Ltorch/lib -lc10 -ltorch_cpu",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
    ]
    objects = [f"obj/{Path(s).stem}.o" for s in SOURCES]
    lines += [f"build {o}: compile src/{s}" for o, s in zip(objects, SOURCES)]
    lines += [f"build {LIBRARY}: link {' '.join(objects)}", f"default {LIBRARY}", ""]
    return "\n".join(lines)


def _first_error(output: str) -> str:
    """The line of a failed build that says what failed: the compiler's or the linker's first
    error, else the output's last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith("FAILED:") and any(m in ln for m in ("error:", "ld: "))]
    return errors[0] if errors else (lines or ["no output"])[-1]


def _build(build_dir: Path, files: dict[str, bytes], cxx: str, cflags: list[str]) -> None:
    """Runs the build in build_dir; raises with the failure's one line (the whole log in build.log)."""
    stage_files(build_dir / "src", files)
    _link_torch(build_dir)
    (build_dir / "build.ninja").write_text(_ninja_file(cxx, cflags))
    jobs = str(len(os.sched_getaffinity(0)))
    proc = subprocess.run([_ninja(), "-C", str(build_dir), "-j", jobs], capture_output=True, text=True)
    (build_dir / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the build failed: {_first_error(proc.stdout + proc.stderr)} "
                           f"(log: {build_dir / 'build.log'})")


def _library(cxx: str) -> Path:
    """The library for this CPU and these kernels: found built, else built now (under a lock)."""
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (apt-get install g++, or set CXX)")
    cap, isa_flags = cpu_capability()
    cflags = compile_flags(isa_flags)
    files = kernel_files()
    build_dir = _build_dir(f"kaiten_cpu_ops_{cap}_{kernel_digest(files, cflags, cxx)}")
    if (build_dir / _BUILT).exists():          # no lock: a read-only cache (an image's) loads too
        return build_dir / LIBRARY
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if not (build_dir / _BUILT).exists():
            log.info("building the C++ CPU ops (%s) in %s ...", cap, build_dir)
            start = time.perf_counter()
            _build(build_dir, files, cxx, cflags)
            (build_dir / _BUILT).write_text(LIBRARY)
            log.info("built the C++ CPU ops in %.1f s", time.perf_counter() - start)
    return build_dir / LIBRARY


def load_cpu_ops() -> Path:
    """The library's path, built on first use (then found in the cache) and loaded into this
    process once; raises RuntimeError with the reason it is not there."""
    if "path" in _STATE:
        return _STATE["path"]
    if "error" in _STATE:
        raise RuntimeError(_STATE["error"])
    try:
        path = _library(os.environ.get("CXX", "c++"))
        torch.ops.load_library(str(path))
    except Exception as e:  # noqa: BLE001 - any build or load failure means "not there"
        _STATE["error"] = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        raise RuntimeError(_STATE["error"]) from e
    _register_fakes()
    _STATE["path"] = path
    return path


def _register_fakes() -> None:
    """Shapes of the library's dispatcher ops (kaiten_cpu::...) for torch.compile's tracing."""
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
    torch.library.register_fake("kaiten_cpu::dequantize_rows")(
        lambda tiles, rows, n, k, bits, group, has_mins: tiles.new_empty((rows.shape[0], k), dtype=torch.float32))
    torch.library.register_fake("kaiten_cpu::bf16_linear")(
        lambda x, weight, bias, min_dense_rows: x.new_empty((*x.shape[:-1], weight.shape[0])))
    torch.library.register_fake("kaiten_cpu::lora_add_")(
        lambda y, x, a, b, splits, token_index, bounds: None)
    torch.library.register_fake("kaiten_cpu::shm_all_reduce_")(lambda x, handle: None)


def cpu_ops_loaded() -> bool:
    """Whether the library's dispatcher ops are registered in this process (builds nothing). A
    compiled graph calls them directly: an op defined in Python costs about 15 us a call in its
    wrappers. Traced by Dynamo as one guard on _STATE."""
    return "path" in _STATE


def cpu_ops_error() -> str | None:
    """Why the library is not there, once a build or load has failed in this process."""
    return _STATE.get("error")


def cpu_ops_available() -> bool:
    """Whether the C++ CPU ops build and load here (the first call may build them); a failure is
    logged once, in one line."""
    if "path" in _STATE:
        return True
    if "error" in _STATE:
        return False
    try:
        load_cpu_ops()
        return True
    except RuntimeError:
        log.warning("the C++ CPU ops are unavailable, using torch's: %s", _STATE["error"])
        return False


def int8_activations_built() -> bool:
    """Whether the build multiplies int8-rounded activations (quant_linear's int8 method: AVX-512
    and AVX2 builds; the portable one takes the exact method for those rows)."""
    return int8_x_levels(8) > 0


def int8_x_levels(bits: int) -> int:
    """The integer levels of x's int8 rounding against `bits`-bit weights, as the loaded build
    says (quant_linear's x_levels): 7 bits (63) against int8 weights where it has no
    AVX512-VNNI, else 127; 0 where it has no int8 method. Loads the library."""
    load_cpu_ops()
    return torch.ops.kaiten_cpu.int8_x_levels(bits)


def main(argv: list[str] | None = None) -> int:
    """`kaiten kernels`: build (or find built) the library for this CPU; one line either way."""
    parser = argparse.ArgumentParser(prog="kaiten kernels", description="Build the C++ CPU ops for this CPU, once "
                                     "(TORCH_EXTENSIONS_DIR, KAITEN_CPU_ISA and CXX as for the engine).")
    parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = load_cpu_ops()
    except RuntimeError as e:
        print(f"kaiten kernels: the C++ CPU ops are not built: {e}", file=sys.stderr)
        return 1
    print(f"kaiten kernels: the C++ CPU ops ({cpu_capability()[0]}) are ready in {time.perf_counter() - start:.1f} s: "
          f"{path}")
    return 0


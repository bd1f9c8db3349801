"""CPU tensors on transparent huge pages, for the paged KV cache.

Decode attention reads the cache in blocks scattered over the whole pool, so on 4 KiB pages
nearly every block read also misses the TLB. Where the kernel's THP mode is `madvise` (a common
default), memory is only backed by 2 MiB pages when a program asks for it with
madvise(MADV_HUGEPAGE). Measured on a 2-core EPYC with a 1 GiB bf16 pool: 64 decodes x 30 layers
of attention 37.4 -> 32.5 ms, prefill chunks 143 -> 132 ms. (Huge pages for every torch
allocation, THP_MEM_ALLOC_ENABLE=1, made the whole engine slower: activations are freed and
faulted in again each step.) The weights go there too, all in one mapping (onto_huge_pages): a
decode step streams every one of them, a page walk every 4 KiB.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import time

import torch
from torch import nn

_HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23        # Linux 5.14 (linux/mman.h); not in Python 3.11's mmap module


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, commit: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in a private anonymous mapping 2 MiB aligned and
    advised as huge pages before its first touch. The tensor starts its own storage (offset 0), as
    torch.zeros' does: Inductor's graph cache keys on the inputs' storage offsets. Where mmap has
    no MADV_HUGEPAGE (not Linux), and for tensors under 2 MiB, plain torch.zeros; where the kernel
    refuses the advice (no THP support), small pages. The contents are the same either way.
    `commit`: write the zeros now, as torch.zeros does; else the kernel gives each page zeroed at
    its first touch. Writing the 2 GiB KV cache of SmolLM2 took 1.3 s of a 9 s start; committed
    on a thread instead, it stalled the first requests' steps (the thread took a core from their
    OpenMP team: bench/results/cold_start/README.md); at first touch a batch pays a fault per
    2 MiB page of a layer's cache that it reaches first, 341 blocks' worth."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    buf, start = _aligned_mapping(nbytes, nbytes // _HUGE_PAGE * _HUGE_PAGE, mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=start).view(shape)
    return out.zero_() if commit else out


def onto_huge_pages(model: nn.Module, min_bytes: int = 64 << 10) -> int:
    """Moves model's movable_weights into one mapping advised as huge pages (into_one_mapping).
    Returns the bytes moved; where mmap has no MADV_HUGEPAGE, nothing moves."""
    return into_one_mapping(model, mmap.MADV_HUGEPAGE, min_bytes) if hasattr(mmap, "MADV_HUGEPAGE") else 0


def movable_weights(model: nn.Module, min_bytes: int = 64 << 10) -> dict[int, list[tuple[dict, str]]]:
    """model's CPU parameters and buffers of at least min_bytes that fill their own storage, by
    storage: the dict that holds each tensor on it and its name there."""
    owners: dict[int, list[tuple[dict, str]]] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if _movable(t, min_bytes):
                    owners.setdefault(t.untyped_storage().data_ptr(), []).append((tensors, name))
    return owners


def into_one_mapping(model: nn.Module, advice: int, min_bytes: int = 64 << 10) -> int:
    """Moves model's movable_weights into one mapping advised `advice` (an mmap.MADV_* value)
    before its first touch, each still its own storage at offset 0, 64-byte aligned, its bytes
    unchanged; tied ones stay tied. Returns the bytes moved. A weight's old memory is freed as it
    moves, so a load needs about one weight more, not twice the model."""
    owners = movable_weights(model, min_bytes)
    sizes = [_padded(tensors[name].nbytes) for (tensors, name), *_ in owners.values()]
    total = sum(sizes)
    if not total:
        return 0
    buf, offset = _aligned_mapping(total, _padded(total, _HUGE_PAGE), advice)
    with torch.no_grad():
        for refs, size in zip(owners.values(), sizes):
            moved: dict[int, torch.Tensor] = {}             # a tied Parameter stays one object
            for tensors, name in refs:
                old = tensors[name]
                if id(old) not in moved:
                    moved[id(old)] = _moved(old, buf, offset)
                tensors[name] = moved[id(old)]
            offset += size
    return total


def _moved(old: torch.Tensor, buf: mmap.mmap, offset: int) -> torch.Tensor:
    """old's copy in buf from offset, a Parameter where old is one."""
    new = torch.frombuffer(buf, dtype=old.dtype, count=old.numel(), offset=offset).view(old.shape)
    new.copy_(old)
    return nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new


def _movable(t: torch.Tensor | None, min_bytes: int) -> bool:
    return (t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
            and not t.is_quantized and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes >= min_bytes)


def _padded(nbytes: int, unit: int = 64) -> int:
    return -(-nbytes // unit) * unit


def _aligned_mapping(nbytes: int, advised: int, advice: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with room for nbytes from its first 2 MiB boundary (returned
    with it), `advised` bytes from there given `advice` before their first touch; where the kernel
    refuses the advice, the mapping as it is."""
    buf = mmap.mmap(-1, max(nbytes, advised) + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    if advised:
        with contextlib.suppress(OSError):
            buf.madvise(advice, start, advised)
    return buf, start


class Prefault:
    """Backs the pages of tensors made by zeros_on_huge_pages(commit=False) before a step needs
    them, a slice at a time (run) while the engine is idle. At first touch a step pays a fault per
    2 MiB page: on a 2-core Zen 4 under KVM, 60 of them (one per layer's K or V) in every fifth
    1024-token prefill, ~0.27 s of that step, until the pool has been gone through; backed first,
    prefill steps took 0.77x the time (bench/results/kv_prefault/README.md), and backing 512 MiB
    took 0.86 s of idle time. MADV_POPULATE_WRITE backs a page without writing to it, so pages
    already holding cached blocks keep them. Where the kernel lacks it (before 5.14), pages are
    backed at first touch as before. Pages go in the order of their offsets, every tensor at an
    offset before the next: the block allocator hands out blocks from the front of the pool."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = [t for t in tensors if t.data_ptr() % _HUGE_PAGE == 0 and t.untyped_storage().nbytes()]
        self.size = max((t.untyped_storage().nbytes() for t in self.tensors), default=0)
        self.offset = 0              # the pages before it are backed in every tensor
        self.index = 0               # the next tensor at `offset`
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    @property
    def done(self) -> bool:
        return self.offset >= self.size

    def run(self, budget_s: float) -> bool:
        """Back a page, then more until about budget_s has passed; True while pages remain."""
        deadline = time.perf_counter() + budget_s
        while not self.done:
            t = self.tensors[self.index]
            nbytes = t.untyped_storage().nbytes()
            if self.offset < nbytes:
                length = min(_HUGE_PAGE, nbytes - self.offset)
                if self._madvise(t.data_ptr() + self.offset, length, _MADV_POPULATE_WRITE) != 0:
                    self.offset = self.size       # unsupported (EINVAL) or out of memory: first touch
                    break
            self.index += 1
            if self.index == len(self.tensors):
                self.index, self.offset = 0, self.offset + _HUGE_PAGE
            if time.perf_counter() >= deadline:
                break
        return not self.done

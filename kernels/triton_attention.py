"""TritonAttention: paged attention on Triton kernels (kernels/triton_paged_kernels.py), the KV
write, split-KV decode and chunked-prefill attention, on CUDA (or CPU tensors under Triton's
interpreter: set ``TRITON_INTERPRET=1`` before importing this module).

Decode-only batches go to the split-KV decode kernel, the rest to the prefill kernel (mixed
batches split their q_len-1 rows off to the decode kernel). Nothing here syncs with the device or
depends on tensor values on the host, so the launches are safe to capture in CUDA graphs (grids
depend on shapes and on ``meta.max_seqlen_*`` only).
"""
from __future__ import annotations

import math

import torch
import triton

from kernels.interface import AttentionMetadata, TwoCalls
from kernels.triton_paged_kernels import (LOG2E, decode_kernel, decode_reduce_kernel, prefill_kernel,
                                          write_kv_kernel)

_SM_COUNT: dict[int, int] = {}
# True when TRITON_INTERPRET=1 was set before import: kernels then run on CPU tensors.
INTERPRETED = not isinstance(prefill_kernel, triton.runtime.JITFunction)


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not INTERPRETED:
        raise RuntimeError("the Triton attention backend needs CUDA tensors (on CPU use the torch "
                           "backend, or set TRITON_INTERPRET=1 before importing triton)")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> cache slots (slot -1 skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_device(key)
    assert value.shape == key.shape and slot_mapping.shape[0] >= num_tokens
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    row = block_h * block_d
    block_t = max(1, 2048 // row)      # ~2K elements per program: 16 per thread with 4 warps
    write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_t * row >= 1024 else 1,
    )


def _prefill_config(elem_size: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel. Chosen from sm_90 builds
    (register use without spills): 16-bit inputs use tensor cores at 128 rows per tile; fp32
    (tf32x3 dots) needs smaller tiles."""
    if elem_size <= 2:
        if block_d <= 128:
            return 128, 64, 8, 2
        return (128, 32, 8, 2) if block_d <= 256 else (64, 32, 4, 2)
    return (64, 32, 4, 2) if block_d <= 64 else (32, 32, 4, 2)


def _decode_config(elem_size: int, block_d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel (memory bound: small register
    footprint so several programs share an SM, and a few tiles of loads in flight)."""
    if elem_size <= 2:
        if block_d <= 64:
            return 64, 4, 3
        return (32, 4, 3) if block_d <= 128 else (16, 4, 3)
    if block_d <= 64:
        return 64, 4, 2
    return (32, 8, 2) if block_d <= 128 else (16, 4, 2)


class TritonAttention(TwoCalls):
    """Paged attention backend on Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1).

    Decode-only batches (max_seqlen_q == 1) go to the split-KV decode kernel, everything else
    (prefill chunks with a cached prefix, mixed prefill + decode batches) to the prefill kernel,
    which handles q_len 1 rows too; by default a mixed batch's q_len-1 rows are handed to the
    decode kernel instead (see split_mixed).

    Tunables (the defaults suit an H100; tests shrink tiles to exercise multi-tile paths):
      prefill_block_m / prefill_block_n: tile rows (query tokens x group heads) and keys,
      decode_block_n: keys per decode tile,
      decode_splits: force the split-KV count (None: from the SM count and the context length),
      fp32_precision: tl.dot precision for fp32 inputs: "tf32x3" (default; about fp32 accuracy
      on tensor cores), "ieee" (exact, slow FMA path) or "tf32" (fastest, ~1e-3 error),
      split_mixed: in mixed batches send the q_len-1 rows to the decode kernel (default) instead
      of the prefill kernel.
    """

    name = "triton"
    cuda_graph_safe = True      # no host syncs, grids from shapes and meta.max_seqlen_* only
    compile_safe = False
    any_kv_dtype = False

    def __init__(self, *, prefill_block_m: int | None = None, prefill_block_n: int | None = None,
                 decode_block_n: int | None = None, decode_splits: int | None = None,
                 max_decode_splits: int = 32, fp32_precision: str = "tf32x3",
                 split_mixed: bool = True):
        if fp32_precision not in ("tf32x3", "ieee", "tf32"):
            raise ValueError(f"fp32_precision must be tf32x3, ieee or tf32, not {fp32_precision!r}")
        for n in (prefill_block_m, prefill_block_n, decode_block_n):
            if n is not None and (n < 16 or n & (n - 1)):
                raise ValueError(f"tile sizes must be powers of two >= 16, got {n}")
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self.decode_block_n = decode_block_n
        self.decode_splits = decode_splits
        self.max_decode_splits = max_decode_splits
        self.fp32_precision = fp32_precision
        self.split_mixed = split_mixed

    # -- interface ----------------------------------------------------------------------------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """out: optional preallocated [num_tokens, num_heads, head_dim] result (any strides)."""
        if window < 0:
            raise ValueError(f"window {window} < 0 (0: no window)")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        _check_device(q)
        if meta.is_decode_only:
            self.decode(q, k_cache, v_cache, meta, scale, out, window)
            return out
        # Mixed batch: the q_len-1 rows go to the decode kernel (a prefill tile would spend
        # BLOCK_M rows of work on a handful of heads), the rest to the prefill kernel. Both
        # kernels skip the other's sequences on the device, so this needs no host sync.
        lens = meta.seqlens_q_list
        has_decode = self.split_mixed and (lens is None or 1 in lens)
        self.prefill(q, k_cache, v_cache, meta, scale, out, skip_decode=has_decode, window=window)
        if has_decode:
            self.decode(q, k_cache, v_cache, meta, scale, out, window)
        return out

    # -- launches -----------------------------------------------------------------------------

    @staticmethod
    def _check(q, k_cache, v_cache):
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
            raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                             f"v_cache {tuple(v_cache.shape)}")
        return num_heads // num_kv_heads, num_kv_heads, head_dim

    def _dot_precision(self, q: torch.Tensor) -> str | None:
        return self.fp32_precision if q.dtype == torch.float32 else None

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                skip_decode: bool = False, window: int = 0):
        """All sequences (any q_len >= 1), or with skip_decode all but those with q_len 1."""
        group, num_kv_heads, head_dim = self._check(q, k_cache, v_cache)
        block_d = triton.next_power_of_2(head_dim)
        block_m, block_n, num_warps, num_stages = _prefill_config(q.element_size(), block_d)
        block_m = max(self.prefill_block_m or block_m, triton.next_power_of_2(group))
        block_n = self.prefill_block_n or block_n
        block_q = block_m // group
        num_seqs = meta.num_seqs
        grid = (q.shape[0] // block_q + num_seqs, num_kv_heads)
        prefill_kernel[grid](
            q, k_cache, v_cache, out,
            meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables,
            scale * LOG2E, num_seqs, window,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            meta.block_tables.stride(0),
            GROUP=group, PAGE=k_cache.shape[1], HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
            SKIP_DECODE=skip_decode, SLIDING=window > 0, DOT_PRECISION=self._dot_precision(q),
            num_warps=num_warps, num_stages=num_stages,
        )

    def _num_splits(self, q, num_seqs, num_kv_heads, max_keys, block_n) -> int:
        if self.decode_splits is not None:
            return max(1, int(self.decode_splits))
        sms = _sm_count(q.device)
        programs = num_seqs * num_kv_heads
        if sms == 0 or programs >= sms:
            return 1
        # Enough programs to fill the GPU twice, but at least 2 KV tiles per split.
        splits = min(math.ceil(2 * sms / programs), math.ceil(max_keys / (2 * block_n)),
                     self.max_decode_splits)
        return max(1, splits)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
               window: int = 0):
        """The sequences with q_len 1 (all of them in a decode-only batch); others untouched."""
        group, num_kv_heads, head_dim = self._check(q, k_cache, v_cache)
        num_seqs = meta.num_seqs
        block_d = triton.next_power_of_2(head_dim)
        block_g = max(16, triton.next_power_of_2(group))
        block_n, num_warps, num_stages = _decode_config(q.element_size(), block_d)
        block_n = self.decode_block_n or block_n
        keys = min(meta.max_seqlen_k, window) if window > 0 else meta.max_seqlen_k
        splits = self._num_splits(q, num_seqs, num_kv_heads, keys, block_n)
        if splits > 1:
            o_part = torch.empty((num_seqs, q.shape[1], splits, block_d), dtype=torch.float32,
                                 device=q.device)
            lse_part = torch.empty((num_seqs, q.shape[1], splits), dtype=torch.float32,
                                   device=q.device)
        else:
            o_part = lse_part = out     # unused
        decode_kernel[(num_seqs, num_kv_heads, splits)](
            q, k_cache, v_cache, out, o_part, lse_part,
            meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables,
            scale * LOG2E, splits, window,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            meta.block_tables.stride(0),
            GROUP=group, PAGE=k_cache.shape[1], HEAD_DIM=head_dim,
            BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
            SPLIT=splits > 1, SLIDING=window > 0, DOT_PRECISION=self._dot_precision(q),
            num_warps=num_warps, num_stages=num_stages,
        )
        if splits > 1:
            decode_reduce_kernel[(num_seqs, q.shape[1])](
                out, o_part, lse_part, meta.cu_seqlens_q, splits, *out.stride(),
                HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
                num_warps=1 if block_d <= 64 else 2,
            )

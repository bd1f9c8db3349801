"""Triton paged-attention kernels (and the flash-attn backend) against a dense torch reference.

On CPU the Triton kernels run under Triton's interpreter. Triton reads TRITON_INTERPRET when
`import triton` runs (its own standard library, tl.cdiv, tl.max, ..., is @triton.jit-decorated at
import) and when each @triton.jit decorates a kernel, so it must be set before triton is first
imported in a process. Setting it in this pytest process would also turn every later Triton
kernel (real-GPU tests included) into interpreted code, so the interpreter cases run in ONE child
Python process started with TRITON_INTERPRET=1 (a module-scoped fixture); each case is then
reported as its own test. CUDA tests (real Triton kernels, flash-attn) run in-process and skip
cleanly without a GPU.

Every case: fresh random inputs; the cache starts as NaN everywhere (so reading a slot that was
never written, or a stale block, poisons the result); K/V are written through write_kv with some
-1 padding slots (the cache must then equal a torch-indexed copy exactly); the output is
preallocated as NaN and every element must be written; the reference is a dense
scaled_dot_product_attention per sequence on the original K/V (not read back from the cache).
Cases with a sliding window also fill the blocks wholly before each sequence's window with NaN
once K/V are written: the kernels must not read them.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.interface import AttentionMetadata
from tests.support.paths import ROOT

REL_TOL = 1e-3


@dataclass
class Case:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # (cached tokens already in the cache, new query tokens this step) per sequence
    seqs: list[tuple[int, int]]
    backend: dict = field(default_factory=dict)   # TritonAttention(**backend) tile overrides
    pad_slots: int = 2           # extra write_kv rows with slot -1
    seed: int = 0
    dispatch: str = "auto"       # "auto" (attention()), or force "prefill" on any batch
    host_lists: bool = True      # fill meta.seqlens_q_list / seqlens_k_list
    padded_rows: int = 0         # CUDA-graph style dummy rows: q_len 1, empty context, slot -1
    window: int = 0              # sliding window (0: none); the blocks before it are NaN-filled

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


SMALL = dict(prefill_block_m=16, prefill_block_n=16, decode_block_n=16)

CASES = [
    # decode-only batches: lengths around block and tile boundaries
    Case("decode_g1_d64_bs16", 2, 2, 64, 16, [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (47, 1)],
         backend=SMALL, seed=1),
    Case("decode_g3_d32_bs32_split3", 6, 2, 32, 32, [(0, 1), (30, 1), (31, 1), (32, 1), (99, 1), (64, 1)],
         backend=dict(SMALL, decode_splits=3), padded_rows=2, seed=2),
    Case("decode_g3_d64_bs16_defaults", 6, 2, 64, 16, [(5, 1), (16, 1), (70, 1)], padded_rows=1,
         seed=3),
    Case("decode_g1_d32_bs16_split4_defaults", 2, 2, 32, 16, [(200, 1), (1, 1), (63, 1)],
         backend=dict(decode_splits=4), seed=4),
    # prefill of fresh prompts (no cached prefix), odd lengths, several q tiles
    Case("prefill_g1_d64_bs16", 2, 2, 64, 16, [(0, 1), (0, 16), (0, 17), (0, 40)], backend=SMALL, seed=5),
    # chunked prefill on top of a cached prefix
    Case("chunked_g3_d32_bs16", 6, 2, 32, 16, [(16, 7), (33, 20), (5, 1), (0, 29), (47, 2)],
         backend=SMALL, seed=6),
    Case("chunked_g3_d64_bs32", 3, 1, 64, 32, [(31, 33), (64, 5), (1, 40)], backend=SMALL, seed=7),
    # mixed prefill + decode rows, default (GPU) tile sizes
    Case("mixed_g3_d64_bs32_defaults", 6, 2, 64, 32, [(0, 23), (40, 1), (63, 1), (31, 34), (64, 1)],
         seed=8),
    Case("mixed_g1_d32_bs16_defaults", 2, 2, 32, 16, [(0, 70), (50, 45), (9, 1)], seed=9),
    Case("mixed_g3_d32_bs16_no_host_lists_split2", 3, 1, 32, 16, [(1, 1), (20, 13), (47, 1), (0, 1)],
         backend=dict(SMALL, decode_splits=2), host_lists=False, seed=13),
    Case("mixed_g3_d32_bs16_all_in_prefill_kernel", 3, 1, 32, 16, [(16, 1), (3, 18), (32, 1)],
         backend=dict(SMALL, split_mixed=False), seed=14),
    # decode rows through the prefill kernel (q_len 1 everywhere)
    Case("prefill_kernel_q1_g3_d32_bs16", 6, 2, 32, 16, [(0, 1), (15, 1), (16, 1), (40, 1)],
         backend=SMALL, dispatch="prefill", padded_rows=1, seed=10),
    # unusual shapes: head_dim not a power of two, block size not a power of two
    Case("odd_shapes_g3_d48_bs12", 3, 1, 48, 12, [(13, 11), (0, 1), (24, 1)], backend=SMALL, seed=11),
    Case("decode_odd_shapes_g3_d48_bs12", 3, 1, 48, 12, [(13, 1), (0, 1), (23, 1)],
         backend=dict(SMALL, decode_splits=2), seed=12),
    # sliding windows: starting mid-block and on block boundaries (47 + 1 - 16 = 32), of one key,
    # longer than every context; decodes split over the window's tiles; prefill chunks over a
    # cached prefix whose rows' windows start in different tiles; odd shapes
    Case("window_decode_g3_d32_bs16_split3", 6, 2, 32, 16,
         [(0, 1), (15, 1), (16, 1), (47, 1), (99, 1), (64, 1), (200, 1)],
         backend=dict(SMALL, decode_splits=3), padded_rows=1, window=16, seed=60),
    Case("window_decode_g1_d64_bs16_defaults", 2, 2, 64, 16, [(300, 1), (20, 1), (130, 1)],
         backend=dict(decode_splits=4), window=70, seed=61),
    Case("window_chunked_g3_d32_bs16", 6, 2, 32, 16,
         [(16, 7), (33, 20), (5, 1), (0, 29), (47, 2), (60, 3), (0, 70)],
         backend=SMALL, window=13, seed=62),
    Case("window1_mixed_g3_d32_bs16", 3, 1, 32, 16, [(1, 1), (20, 13), (47, 1), (40, 40)],
         backend=SMALL, window=1, seed=63),
    Case("window_mixed_g3_d64_bs32_defaults", 6, 2, 64, 32,
         [(0, 23), (40, 1), (63, 1), (31, 34), (64, 1), (100, 90)], window=40, seed=64),
    Case("window_mixed_g3_d32_bs16_all_in_prefill_kernel", 3, 1, 32, 16, [(16, 1), (3, 18), (32, 1), (50, 4)],
         backend=dict(SMALL, split_mixed=False), window=17, padded_rows=1, seed=65),
    Case("window_longer_than_contexts_g3_d32_bs16", 6, 2, 32, 16, [(16, 7), (33, 1), (0, 29)],
         backend=SMALL, window=1000, seed=66),
    Case("window_odd_shapes_g3_d48_bs12", 3, 1, 48, 12, [(30, 11), (0, 1), (40, 1)],
         backend=dict(SMALL, decode_splits=2), window=14, seed=67),
]


# --------------------------------------------------------------------------------------------
# Building a case and the dense reference (shared by the interpreter child and the GPU tests)
# --------------------------------------------------------------------------------------------

def build_case(case: Case, device="cpu", dtype=torch.float32, cache_fill=float("nan")):
    """cache_fill: what every slot not holding a sequence token contains (NaN: any read of it
    that reaches the output poisons the result)."""
    g = torch.Generator().manual_seed(case.seed)
    H, Hkv, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    ctx = [c + n for c, n in case.seqs]
    nblocks = [math.ceil(L / bs) for L in ctx]
    num_blocks = sum(nblocks) + 3                       # a few spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=g).tolist()   # shuffled, non-contiguous tables
    max_blocks = max(nblocks) + 1                        # always some -1 padding in the tables
    tables = torch.full((len(ctx), max_blocks), -1, dtype=torch.int32)
    for i, n in enumerate(nblocks):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_full = [rnd(L, Hkv, D) for L in ctx]               # all K/V of each sequence
    v_full = [rnd(L, Hkv, D) for L in ctx]
    k_cache = torch.full((num_blocks, bs, Hkv, D), cache_fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, cache_fill)

    def slot(i, t):
        return int(tables[i, t // bs]) * bs + t % bs

    for i, (cached, _) in enumerate(case.seqs):         # the cached prefix is already there
        for t in range(cached):
            s = slot(i, t)
            k_cache.view(-1, Hkv, D)[s] = k_full[i][t]
            v_cache.view(-1, Hkv, D)[s] = v_full[i][t]

    new_k = torch.cat([k_full[i][c:] for i, (c, _) in enumerate(case.seqs)])
    new_v = torch.cat([v_full[i][c:] for i, (c, _) in enumerate(case.seqs)])
    slots = [slot(i, t) for i, (c, n) in enumerate(case.seqs) for t in range(c, c + n)]
    num_tokens = len(slots)
    # padding rows: garbage K/V with slot -1 (interleaved at the front and the end)
    pad = case.pad_slots
    pad_front, pad_back = pad // 2, pad - pad // 2
    pad_back += case.padded_rows                        # dummy decode rows write nothing
    new_k = torch.cat([rnd(pad_front, Hkv, D), new_k, rnd(pad_back, Hkv, D)])
    new_v = torch.cat([rnd(pad_front, Hkv, D), new_v, rnd(pad_back, Hkv, D)])
    slots = [-1] * pad_front + slots + [-1] * pad_back
    # write_kv sees non-contiguous views, like the model's split of a fused qkv projection
    fused = torch.cat([new_k, rnd(len(slots), 1, D), new_v], dim=1)
    key, value = fused[:, :Hkv], fused[:, Hkv + 1:]
    P = case.padded_rows
    q = rnd(num_tokens + P, H + 1, D)[:, 1:]            # non-contiguous q as well

    qlens = [n for _, n in case.seqs] + [1] * P
    klens = ctx + [0] * P
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seqlens_k=torch.tensor(klens, dtype=torch.int32),
        block_tables=torch.cat([tables, torch.full((P, max_blocks), -1, dtype=torch.int32)]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_seqlen_q=max(qlens),
        max_seqlen_k=max(klens),
        seqlens_q_list=qlens if case.host_lists else None,
        seqlens_k_list=klens if case.host_lists else None,
    )
    expected_k = k_cache.clone()
    expected_v = v_cache.clone()
    for i, (c, n) in enumerate(case.seqs):
        for t in range(c, c + n):
            expected_k.view(-1, Hkv, D)[slot(i, t)] = k_full[i][t]
            expected_v.view(-1, Hkv, D)[slot(i, t)] = v_full[i][t]

    def to(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    meta = AttentionMetadata(**{f.name: to(getattr(meta, f.name)) for f in fields(meta)})
    return dict(q=to(q), key=to(key), value=to(value), k_cache=to(k_cache), v_cache=to(v_cache),
                meta=meta, k_full=k_full, v_full=v_full, expected_k=expected_k,
                expected_v=expected_v, scale=D ** -0.5)


def reference(case: Case, data) -> torch.Tensor:
    """Dense causal SDPA per sequence in fp32 on CPU (bottom-right aligned causal mask; with a
    window W, query position p sees keys p - W < k <= p)."""
    q = data["q"].float().cpu()
    outs = []
    start = 0
    for i, (c, n) in enumerate(case.seqs):
        L = c + n
        qi = q[start:start + n].transpose(0, 1)                       # [H, n, D]
        k = data["k_full"][i].float().repeat_interleave(case.group, dim=1).transpose(0, 1)
        v = data["v_full"][i].float().repeat_interleave(case.group, dim=1).transpose(0, 1)
        pos = (c + torch.arange(n))[:, None]
        mask = torch.arange(L)[None, :] <= pos
        if case.window:
            mask &= torch.arange(L)[None, :] > pos - case.window
        outs.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask,
                                                   scale=data["scale"]).transpose(0, 1))
        start += n
    outs.append(torch.zeros(case.padded_rows, case.num_heads, case.head_dim))  # empty context
    return torch.cat(outs)


def poison_before_windows(case: Case, data) -> int:
    """NaN into every block wholly before its sequence's first query's window; returns how many."""
    tables, bs, n = data["meta"].block_tables.cpu(), case.block_size, 0
    for i, (c, _) in enumerate(case.seqs):
        for b in range(max(0, c - case.window + 1) // bs):
            data["k_cache"][int(tables[i, b])] = float("nan")
            data["v_cache"][int(tables[i, b])] = float("nan")
            n += 1
    return n


def run_case(backend, case: Case, data) -> dict:
    """Runs write_kv + attention and checks everything; returns stats, raises AssertionError."""
    backend.write_kv(data["key"], data["value"], data["k_cache"], data["v_cache"],
                     data["meta"].slot_mapping)
    k_cache, v_cache = data["k_cache"].cpu(), data["v_cache"].cpu()
    exact = data["k_cache"].dtype == data["key"].dtype
    for got, want, which in ((k_cache, data["expected_k"], "k"), (v_cache, data["expected_v"], "v")):
        if not torch.equal(torch.isnan(got), torch.isnan(want)):
            raise AssertionError(f"write_kv: {which} cache written at the wrong slots")
        if exact and not torch.equal(torch.nan_to_num(got), torch.nan_to_num(want.to(got.dtype))):
            raise AssertionError(f"write_kv: wrong {which} cache contents")
    poisoned = poison_before_windows(case, data) if case.window else 0

    q, meta = data["q"], data["meta"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    if case.dispatch == "prefill":
        backend.prefill(q, data["k_cache"], data["v_cache"], meta, data["scale"], out, window=case.window)
        ret = out
    else:
        ret = backend.attention(q, data["k_cache"], data["v_cache"], meta, data["scale"], case.window, out=out)
    if ret.data_ptr() != out.data_ptr():
        raise AssertionError("attention(out=...) did not return the given tensor")
    out = out.float().cpu()
    unwritten = torch.isnan(out).sum().item()
    if unwritten:
        raise AssertionError(f"{unwritten} of {out.numel()} output elements not written (NaN)")
    ref = reference(case, data)
    rel = ((out - ref).norm() / ref.norm()).item()
    return {"rel_err": rel, "shape": list(out.shape), "poisoned_blocks": poisoned}


# --------------------------------------------------------------------------------------------
# Interpreter runs: one child process with TRITON_INTERPRET=1, every case reported separately
# --------------------------------------------------------------------------------------------

def _interp_child(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kernels.triton_attention import TritonAttention
    from kernels.triton_paged_kernels import prefill_kernel
    from triton.runtime.interpreter import InterpretedFunction
    assert isinstance(prefill_kernel, InterpretedFunction), "kernels are not interpreted"
    results = {}
    for case in CASES:
        t0 = time.perf_counter()
        try:
            res = run_case(TritonAttention(**case.backend), case, build_case(case))
            res["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            res = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results[case.name] = res
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory):
    out_path = tmp_path_factory.mktemp("triton-interp") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = ("import sys; from tests.kernels.test_triton_attention import _interp_child; "
            "_interp_child(sys.argv[1])")
    proc = subprocess.run([sys.executable, "-c", code, str(out_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out_path.exists():
        pytest.fail(f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_interpreter(interp_results, case):
    res = interp_results[case.name]
    assert res["ok"], res["error"]
    assert res["rel_err"] < REL_TOL, f"relative error {res['rel_err']:.2e} >= {REL_TOL}"


def test_cases_cover_the_matrix():
    """The case list keeps covering what the kernels promise."""
    assert {c.group for c in CASES} >= {1, 3}
    assert {c.head_dim for c in CASES} >= {32, 64}
    assert {c.block_size for c in CASES} >= {16, 32}
    assert any(c.backend.get("decode_splits", 1) > 1 for c in CASES)
    assert any(all(n == 1 for _, n in c.seqs) for c in CASES)                     # decode-only
    assert any(any(n > 1 and k > 0 for k, n in c.seqs) for c in CASES)           # cached prefix
    assert any(len({n == 1 for _, n in c.seqs}) == 2 for c in CASES)             # mixed
    windowed = [c for c in CASES if c.window]
    assert {1, 1000} <= {c.window for c in windowed}
    assert any(c.backend.get("decode_splits", 1) > 1 for c in windowed)
    assert any(any(n > 1 and k > 0 for k, n in c.seqs) for c in windowed)


def test_window_cases_poison_blocks(interp_results):
    """The window cases do NaN-fill blocks before their windows (but the one longer than every
    context, which has none)."""
    for case in CASES:
        if case.window and case.window < 1000:
            assert interp_results[case.name].get("poisoned_blocks", 0) > 0, case.name


def test_backend_registry_and_flash_attn_import_error():
    from kernels.registry import get_attention_backend
    from kernels.flash_attention import FlashAttention
    from kernels.triton_attention import TritonAttention
    assert isinstance(get_attention_backend("triton"), TritonAttention)
    assert FlashAttention.REQUIRED_BLOCK_SIZE == 256
    with pytest.raises(ValueError):
        TritonAttention(prefill_block_m=24)
    with pytest.raises(ValueError):
        TritonAttention(fp32_precision="fp64")
    if not torch.cuda.is_available():       # a clear error, not a Triton driver failure
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            TritonAttention().write_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                                       torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16),
                                       torch.zeros(1, dtype=torch.int64))
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="flash-attn"):
            get_attention_backend("flash_attn")


def _fake_flash_attn(calls: list):
    """A stand-in `flash_attn` module with flash-attn 2.8's signatures and documented semantics
    (paged cache through block_table, causal mask aligned bottom-right, window_size=(left, right)
    keys around each query's diagonal, -1 unbounded, keys read from the first query's window on),
    dense torch inside. It checks FlashAttention's glue (argument names, shapes, cu_seqlens_k,
    dispatch) on CPU."""
    import types

    def dense(q, k_cache, v_cache, table, L, scale, window_size):   # q [n, H, D] of one sequence
        bs = k_cache.shape[1]
        n, left = q.shape[0], window_size[0]
        assert window_size[1] in (0, -1)          # the right side: causal
        first = max(0, L - n - left) if left >= 0 else 0
        pos = torch.arange(first, L)
        blk = table[pos // bs].long()
        k, v = k_cache[blk, pos % bs].float(), v_cache[blk, pos % bs].float()
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
        qpos = (L - n + torch.arange(n))[:, None]
        mask = pos[None, :] <= qpos
        if left >= 0:
            mask &= pos[None, :] >= qpos - left
        return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask,
                                              scale=scale).transpose(0, 1).to(q.dtype)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        calls.append("with_kvcache")
        assert q.dim() == 4 and k is None and causal and k_cache.shape[1] % 256 == 0
        assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        return torch.stack([dense(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]),
                                  softmax_scale, window_size) for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        calls.append("varlen")
        assert q.dim() == 3 and causal and k.shape[1] % 256 == 0 and cu_seqlens_k.dtype == torch.int32
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        outs = [dense(q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], k, v, block_table[b],
                      int(cu_seqlens_k[b + 1] - cu_seqlens_k[b]), softmax_scale, window_size)
                for b in range(cu_seqlens_q.shape[0] - 1)]
        return torch.cat(outs)

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


@pytest.mark.parametrize("seqs,path,window", [
    ([(0, 1), (255, 1), (256, 1), (300, 1)], "with_kvcache", 0),
    ([(0, 30), (255, 1), (250, 9), (0, 1)], "varlen", 0),
    ([(0, 1), (600, 1), (256, 1), (300, 1)], "with_kvcache", 100),
    ([(0, 30), (600, 9), (250, 9), (0, 1), (300, 300)], "varlen", 100),
    ([(600, 1), (300, 9)], "varlen", 1),
], ids=["decode", "mixed", "decode-window", "mixed-window", "window-1"])
def test_flash_attention_glue_with_fake_module(monkeypatch, seqs, path, window):
    """Also: a window reaches both functions as window_size=(W - 1, 0) (the blocks before it are
    NaN-filled, and the fake reads from the window on, as flash-attn does)."""
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    from kernels.flash_attention import FlashAttention
    case = Case("fa_glue", 6, 2, 32, FlashAttention.REQUIRED_BLOCK_SIZE, seqs, seed=50, window=window)
    data = build_case(case, dtype=torch.bfloat16, cache_fill=100.0)
    res = run_case(FlashAttention(), case, data)
    assert calls == [path]
    assert res["rel_err"] < 2e-2, res
    assert not window or res["poisoned_blocks"], res


def _compile_sm90(fn, args: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Ahead-of-time build of a kernel for sm_90 (H100) without a GPU, specialized like the JIT
    specializes a launch (ints equal to 1 become constants, 16-divisible pointers and ints are
    marked). Returns (registers, spill stack bytes) from the cubin."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    sig, cons, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        ty, spec = native_specialize_impl(BaseBackend, args[name], False, True, True)
        if ty == "constexpr":
            sig[name], cons[name] = "constexpr", spec
            continue
        sig[name] = ty
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, constexprs=cons, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"kaiten-{fn.__name__}-{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    finally:
        cubin.unlink()
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    res = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return int(res["REG"]), int(res["STACK"])


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_build_for_h100_without_spills():
    """The real (non-interpreted) GPU build of every kernel at the bf16 defaults for a Llama-like
    shape (32 heads, 8 KV heads, head_dim 128, block 16), with and without a sliding window:
    compiles for sm_90, no register spills. The interpreter does not catch what only the compiler
    rejects; this runs without a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    pytest.importorskip("triton")
    import kernels.triton_attention as ta
    import kernels.triton_paged_kernels as tk

    H, Hkv, D, bs = 32, 8, 128, 16
    t = {dt: torch.empty(64, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int32, torch.int64)}
    bf, f32, i32 = t[torch.bfloat16], t[torch.float32], t[torch.int32]
    cache = dict(stride_kb=bs * Hkv * D, stride_ko=Hkv * D, stride_kh=D, stride_kd=1,
                 stride_vb=bs * Hkv * D, stride_vo=Hkv * D, stride_vh=D, stride_vd=1)
    common = dict(Q=bf, K_cache=bf, V_cache=bf, O=bf, cu_seqlens_q=i32, seqlens_k=i32,
                  block_tables=i32, qk_scale=0.1, stride_qt=(H + 2 * Hkv) * D, stride_qh=D,
                  stride_qd=1, stride_ot=H * D, stride_oh=D, stride_od=1, stride_bt=37, **cache)
    bm, bn, warps, stages = ta._prefill_config(2, D)
    dbn, dwarps, dstages = ta._decode_config(2, D)
    built = {}
    for sliding, window in ((False, 0), (True, 4096)):
        name = "_sliding" if sliding else ""
        built["prefill" + name] = _compile_sm90(
            tk.prefill_kernel, dict(common, num_seqs=7, window=window),
            dict(GROUP=H // Hkv, PAGE=bs, HEAD_DIM=D, BLOCK_M=bm, BLOCK_Q=bm // (H // Hkv),
                 BLOCK_N=bn, BLOCK_D=D, SKIP_DECODE=True, SLIDING=sliding, DOT_PRECISION=None), warps, stages)
        built["decode" + name] = _compile_sm90(
            tk.decode_kernel, dict(common, O_part=f32, LSE_part=f32, num_splits=5, window=window),
            dict(GROUP=H // Hkv, PAGE=bs, HEAD_DIM=D, BLOCK_G=16, BLOCK_N=dbn, BLOCK_D=D, SPLIT=True,
                 SLIDING=sliding, DOT_PRECISION=None), dwarps, dstages)
    built["reduce"] = _compile_sm90(
        tk.decode_reduce_kernel, dict(O=bf, O_part=f32, LSE_part=f32, cu_seqlens_q=i32,
                                       num_splits=5, stride_ot=H * D, stride_oh=D, stride_od=1),
        dict(HEAD_DIM=D, BLOCK_S=8, BLOCK_D=D), 2, 1)
    built["write_kv"] = _compile_sm90(
        tk.write_kv_kernel, dict(K=bf, V=bf, K_cache=bf, V_cache=bf, slot_mapping=t[torch.int64],
                                  num_tokens=77, stride_kt=(H + 2 * Hkv) * D, stride_kh=D,
                                  stride_kd=1, stride_vt=(H + 2 * Hkv) * D, stride_vh=D,
                                  stride_vd=1, stride_kcb=bs * Hkv * D, stride_kco=Hkv * D,
                                  stride_kch=D, stride_kcd=1, stride_vcb=bs * Hkv * D,
                                  stride_vco=Hkv * D, stride_vch=D, stride_vcd=1),
        dict(NUM_KV_HEADS=Hkv, HEAD_DIM=D, PAGE=bs, BLOCK_T=2, BLOCK_H=Hkv, BLOCK_D=D), 4, 1)
    spills = {name: stack for name, (_, stack) in built.items() if stack}
    assert not spills, f"register spills (bytes of stack) in the sm_90 build: {spills} ({built})"


# --------------------------------------------------------------------------------------------
# CUDA: real Triton kernels (fp32 and bf16), flash-attn, CUDA-graph capture of padded decode
# --------------------------------------------------------------------------------------------

def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set in this process: real-GPU kernels unavailable")


GPU_CASES = CASES + [
    Case("gpu_long_mixed_g4_d128_bs16", 32, 8, 128, 16,
         [(0, 300), (1000, 1), (4000, 1), (513, 200), (77, 1)], seed=20),
    Case("gpu_long_decode_g4_d128_bs16", 32, 8, 128, 16, [(3000, 1), (17, 1), (1500, 1)], seed=21),
    Case("gpu_decode_g8_d64_bs32", 16, 2, 64, 32, [(2047, 1), (100, 1)], seed=22),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_triton_cuda(case, dtype):
    _needs_cuda()
    from kernels.triton_attention import TritonAttention
    data = build_case(case, device="cuda", dtype=dtype)
    res = run_case(TritonAttention(**case.backend), case, data)
    tol = REL_TOL if dtype == torch.float32 else 2e-2
    assert res["rel_err"] < tol, res


FA_CASES = [
    Case("fa_decode_g4_d128", 32, 8, 128, 256, [(0, 1), (255, 1), (256, 1), (1000, 1)], seed=30),
    Case("fa_mixed_g4_d128", 32, 8, 128, 256, [(0, 300), (700, 1), (255, 40), (256, 1)], seed=31),
    Case("fa_chunked_g1_d64", 4, 4, 64, 256, [(300, 129), (0, 1), (511, 2)], seed=32),
    Case("fa_window_mixed_g4_d128", 32, 8, 128, 256, [(0, 300), (700, 1), (255, 40), (900, 20)],
         window=200, seed=33),
    Case("fa_window_decode_g4_d128", 32, 8, 128, 256, [(1000, 1), (5, 1), (513, 1)], window=256, seed=34),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FA_CASES, ids=[c.name for c in FA_CASES])
def test_flash_attn_cuda(case):
    _needs_cuda()
    pytest.importorskip("flash_attn", reason="flash-attn not installed (optional extra [gpu])")
    from kernels.flash_attention import FlashAttention
    backend = FlashAttention()
    # flash-attn may load (then mask) the rows of a partly filled block: poison with a large
    # finite value instead of NaN (a real cache never holds NaN); reading it unmasked still fails.
    data = build_case(case, device="cuda", dtype=torch.bfloat16, cache_fill=100.0)
    res = run_case(backend, case, data)
    assert res["rel_err"] < 2e-2, res


@pytest.mark.gpu
def test_triton_decode_cuda_graph_with_padding():
    """Decode captured in a CUDA graph, padded rows (slot -1, empty context) included."""
    _needs_cuda()
    from kernels.triton_attention import TritonAttention
    case = Case("graph", 6, 2, 64, 16, [(40, 1), (7, 1), (100, 1)], pad_slots=0, seed=40)
    data = build_case(case, device="cuda")
    backend = TritonAttention(decode_splits=4)
    meta, B = data["meta"], 3
    P = 5                                                   # padded batch: 2 dummy rows
    q = torch.zeros(P, 6, 64, device="cuda")
    key = torch.zeros(P, 2, 64, device="cuda")
    value = torch.zeros(P, 2, 64, device="cuda")
    gmeta = AttentionMetadata(
        cu_seqlens_q=torch.arange(P + 1, dtype=torch.int32, device="cuda"),
        seqlens_k=torch.zeros(P, dtype=torch.int32, device="cuda"),
        block_tables=torch.full((P, meta.block_tables.shape[1]), -1, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.full((P,), -1, dtype=torch.int64, device="cuda"),
        max_seqlen_q=1, max_seqlen_k=128)
    out = torch.full((P, 6, 64), float("nan"), device="cuda")

    def step():
        backend.write_kv(key, value, data["k_cache"], data["v_cache"], gmeta.slot_mapping)
        backend.attention(q, data["k_cache"], data["v_cache"], gmeta, data["scale"], out=out)

    step()                                                   # warm-up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q[:B].copy_(data["q"])
    key[:B].copy_(data["key"][:B])
    value[:B].copy_(data["value"][:B])
    gmeta.seqlens_k[:B].copy_(meta.seqlens_k)
    gmeta.block_tables[:B].copy_(meta.block_tables)
    gmeta.slot_mapping[:B].copy_(meta.slot_mapping)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got = out.cpu()
    assert not torch.isnan(got).any()
    assert torch.equal(got[B:], torch.zeros_like(got[B:]))   # empty context -> zeros
    ref = reference(case, data)
    assert ((got[:B] - ref).norm() / ref.norm()).item() < REL_TOL

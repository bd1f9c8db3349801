"""CppAttention (kernels/cpu_attention.py, the fused C++ kernel) against a dense causal attention
computed in fp32 per sequence: decodes, prefill chunks over a cached prefix, full prefills, mixed
batches; GQA groups 1/3/4, block sizes 16 and 1, head_dim 64/16/24 (and 32/96/128 in bf16),
shuffled block pools, fp32 and bf16, and fp16 or bf16 caches under fp32 or bf16 queries; the same
under sliding windows, whose blocks before the window may be anything. Every cache slot the batch
does not own holds NaN, so a read of one shows in the output."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_ops_build import cpu_capability, cpu_ops_error
from kernels.interface import AttentionMetadata
from tests.support.isa_builds import assert_passes_in_isa_build


@pytest.fixture(scope="module")
def backend():
    if not cpu_attention.cpp_attention_available():
        pytest.skip(f"the C++ kernel is unavailable: {cpu_ops_error()}")
    return cpu_attention.CppAttention()


@pytest.fixture(scope="module")
def loose_backend(backend):
    """The kernel without --deterministic: its plans by the batch, and any block size under a window."""
    return cpu_attention.CppAttention(deterministic=False)


def windowed(backend, loose_backend, bs: int):
    """The backend that takes a window over blocks of `bs`: the invariant kernel's key tiles sit at
    fixed positions, so it needs blocks of a multiple of 16 (the engine refuses others)."""
    return backend if bs % 16 == 0 else loose_backend


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def make_batch(specs, hq, hkv, d, bs, dtype, seed, extra_blocks=3, cache_dtype=None):
    """specs [(q_len, ctx)] -> (q, k_cache, v_cache, meta, keys, values); the blocks of all
    sequences sit in random order in a NaN-filled pool, and the tables are padded with -1. q in
    dtype, the cache (and keys, values) in cache_dtype (default: dtype)."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(ctx / bs) for _, ctx in specs]
    total = sum(nblocks) + extra_blocks
    pool = torch.randperm(total, generator=g).tolist()
    tables, p = [], 0
    for n in nblocks:
        tables.append(pool[p:p + n])
        p += n
    width = max(nblocks, default=0) + 1
    k_cache = torch.full((total, bs, hkv, d), float("nan"), dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = [torch.randn(ctx, hkv, d, generator=g).to(cache_dtype) for _, ctx in specs]
    values = [torch.randn(ctx, hkv, d, generator=g).to(cache_dtype) for _, ctx in specs]
    for t, k, v in zip(tables, keys, values):
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(t, dtype=torch.long)[pos // bs] * bs + pos % bs
        k_cache.view(-1, hkv, d)[slots] = k
        v_cache.view(-1, hkv, d)[slots] = v
    qlens, klens = [ql for ql, _ in specs], [ctx for _, ctx in specs]
    cu = [0]
    for ql in qlens:
        cu.append(cu[-1] + ql)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seqlens_k=torch.tensor(klens, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32).view(-1, width),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        max_seqlen_q=max(qlens, default=0), max_seqlen_k=max(klens, default=0),
        seqlens_q_list=qlens, seqlens_k_list=klens)
    q = torch.randn(cu[-1], hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta, keys, values


def dense_reference(q, keys, values, specs, scale, window=0):
    """fp32 causal attention per sequence; query j of a (q_len, ctx) sequence sees keys
    0..ctx - q_len + j, and with a window W only the last W of them. GQA by repeating each kv head
    for its group of query heads."""
    out, start = [], 0
    hq = q.shape[1]
    for (ql, ctx), k, v in zip(specs, keys, values):
        group = hq // k.shape[1]
        qi = q[start:start + ql].float()
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos = (ctx - ql + torch.arange(ql))[:, None]
        visible = torch.arange(ctx)[None, :] <= pos
        if window:
            visible &= torch.arange(ctx)[None, :] > pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += ql
    return torch.cat(out) if out else q.float()


BATCHES = {
    "decode": [(1, n) for n in (1, 5, 16, 17, 33, 100, 257, 64)],
    "chunk_over_prefix": [(7, 40), (16, 100), (33, 97), (2, 18)],
    "full_prefill": [(1, 1), (5, 5), (37, 37), (64, 64)],
    "mixed": [(1, 50), (20, 20), (1, 3), (13, 77), (1, 200), (40, 41)],
    # chunks of 64 tokens and more: in bf16 on a CPU with AMX, ATen's flash attention takes them
    "long_chunks": [(64, 64), (1, 90), (80, 200), (100, 101), (3, 70), (70, 300)],
}
HEADS = [(4, 4), (9, 3), (8, 2)]     # GQA groups 1, 3, 4


def check(backend, specs, hq, hkv, d, bs, dtype, seed=None, cache_dtype=None, windows=(0,)):
    seed = zlib.crc32(repr((specs, hq, hkv, d, bs, str(dtype))).encode()) if seed is None else seed
    q, kc, vc, meta, keys, values = make_batch(specs, hq, hkv, d, bs, dtype, seed, cache_dtype=cache_dtype)
    scale = d ** -0.5
    for window in windows:
        got = backend.attention(q, kc, vc, meta, scale, window)
        assert got.shape == q.shape and got.dtype == q.dtype
        want = dense_reference(q, keys, values, specs, scale, window)
        torch.testing.assert_close(got.float(), want, **TOL[dtype], msg=lambda m: f"window {window}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 16])
@pytest.mark.parametrize("bs", [16, 1])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_against_dense(backend, batch, heads, bs, d, dtype):
    check(backend, BATCHES[batch], *heads, d, bs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dim_not_a_multiple_of_16(backend, dtype):
    check(backend, BATCHES["mixed"], 6, 2, 24, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scratch_kept_between_calls_of_other_shapes(backend, dtype):
    """Each thread keeps its scratch between calls: calls alternating head sizes that share a
    padded width (24 and 32 on AVX-512) and GQA groups, on the same threads, each exact; a head
    size's padding columns must not hold another's values."""
    for d, heads in [(32, (6, 2)), (24, (6, 2)), (32, (9, 3)), (24, (6, 2)), (64, (9, 3)), (32, (6, 2))]:
        for batch in ("decode", "mixed"):
            check(backend, BATCHES[batch], *heads, d, 16, dtype)


@pytest.mark.parametrize("d", [32, 96, 128])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bf16_head_dims_in_chunks_of_32(backend, batch, d):
    """On a CPU with AVX512-BF16 a bf16 head_dim that is a multiple of 32 is multiplied in bf16
    pairs, in chunks of 32 dims: one to four chunks, and 96 as an output block of 64 and one of 32."""
    check(backend, BATCHES[batch], 8, 2, d, 16, torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_16_bit_cache_under_wider_or_bf16_queries(backend, batch, heads, bs, dtype, cache_dtype):
    """An fp16 or bf16 cache is widened exactly as it is read: against the dense attention of the
    cache's own values, fp32 queries keep fp32's tolerance (bf16 ones bf16's). The decodes of a
    single sequence are split over its context."""
    check(backend, BATCHES[batch], *heads, 64, bs, dtype, cache_dtype=cache_dtype)
    if batch == "decode":
        check(backend, [(1, 300)], *heads, 64, bs, dtype, cache_dtype=cache_dtype)


def serial_and_threaded(run, threads: int):
    """run() with torch on 1 thread, then on `threads`; the thread count is restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = run()
        torch.set_num_threads(threads)
        return serial, run()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bs", [16, 5])
def test_parallel_matches_serial(backend, bs):
    """A batch big enough for the threaded path; the result must not depend on the thread count."""
    specs = [(1, 30 + 37 * i) for i in range(24)] + [(96, 300), (128, 128)]
    q, kc, vc, meta, keys, values = make_batch(specs, 9, 3, 64, bs, torch.float32, seed=bs)
    serial, parallel = serial_and_threaded(lambda: backend.attention(q, kc, vc, meta, 0.125), 2)
    assert torch.equal(serial, parallel)
    torch.testing.assert_close(parallel, dense_reference(q, keys, values, specs, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("heads,specs", [
    ((9, 3), [(1, 1000)]), ((9, 3), [(1, 129)]), ((8, 2), [(1, 700), (1, 64)]),
    ((4, 4), [(3, 257)]), ((4, 4), [(4, 300)]), ((9, 3), [(1, 127)])],
    ids=["one-long", "one-short", "two", "mha-3-tokens", "mha-4-tokens", "under-two-parts"])
def test_few_decodes_split_over_their_context(backend, threads, dtype, bs, heads, specs):
    """A step of fewer decode items than 2 per thread cuts each over its context into parts that
    the threads share, then merges the parts' softmax sums: the result matches the dense one and,
    within rounding, the serial run's (tests run with 1 thread, which never splits)."""
    q, kc, vc, meta, keys, values = make_batch(specs, *heads, 64, bs, dtype, seed=bs + len(specs))
    serial, split = serial_and_threaded(lambda: backend.attention(q, kc, vc, meta, 0.125), threads)
    torch.testing.assert_close(split.float(), dense_reference(q, keys, values, specs, 0.125), **TOL[dtype])
    torch.testing.assert_close(split, serial, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decodes_over_all_kv_heads_match_one_item_per_head(backend, dtype):
    """A step of many decodes runs one work item per sequence over all its kv heads; a sequence
    alone runs one item per kv head. Both give the same bits."""
    specs = [(1, 3 + 29 * i) for i in range(12)]
    q, kc, vc, meta, keys, values = make_batch(specs, 9, 3, 64, 16, dtype, seed=7)
    together = backend.attention(q, kc, vc, meta, 0.125)
    for i, (_, ctx) in enumerate(specs):
        one = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seqlens_k=meta.seqlens_k[i:i + 1],
            block_tables=meta.block_tables[i:i + 1], slot_mapping=torch.empty(0, dtype=torch.int64),
            max_seqlen_q=1, max_seqlen_k=ctx, seqlens_q_list=[1], seqlens_k_list=[ctx])
        assert torch.equal(backend.attention(q[i:i + 1], kc, vc, one, 0.125), together[i:i + 1])
    torch.testing.assert_close(together.float(), dense_reference(q, keys, values, specs, 0.125), **TOL[dtype])


def test_noncontiguous_query(backend):
    """q as a strided view (a slice of a fused qkv projection), in fp32 against an fp16 cache."""
    specs = [(1, 20), (9, 30)]
    q, kc, vc, meta, keys, values = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=7,
                                               cache_dtype=torch.float16)
    qkv = torch.randn(q.shape[0], 15, 64)
    qkv[:, :9] = q
    view = qkv[:, :9]
    assert not view.is_contiguous()
    got = backend.attention(view, kc, vc, meta, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, backend.attention(q, kc, vc, meta, 0.125), atol=0, rtol=0)


def test_empty_sequences_and_empty_batch(backend):
    specs = [(0, 12), (3, 10), (0, 0)]
    q, kc, vc, meta, keys, values = make_batch(specs, 4, 2, 16, 4, torch.float32, seed=3)
    got = backend.attention(q, kc, vc, meta, 0.25)
    want = dense_reference(q[0:3], keys[1:2], values[1:2], specs[1:2], 0.25)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    q0, kc0, vc0, meta0, _, _ = make_batch([], 4, 2, 16, 4, torch.float32, seed=3)
    assert backend.attention(q0, kc0, vc0, meta0, 0.25).shape == (0, 4, 16)


def test_rejects_bad_metadata(backend):
    q, kc, vc, meta, _, _ = make_batch([(1, 20)], 4, 2, 16, 16, torch.float32, seed=1)
    meta.block_tables[0, 1] = kc.shape[0]        # out of the pool
    with pytest.raises(RuntimeError, match="out of range"):
        backend.attention(q, kc, vc, meta, 0.25)
    meta.block_tables[0, 1] = -1                 # the context needs this block
    with pytest.raises(RuntimeError, match="out of range"):
        backend.attention(q, kc, vc, meta, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(backend, dtype):
    """The kernel's write_kv puts each token's rows at its slot and skips slot -1; key and value may
    be strided views of one qkv row, as the model's split gives them."""
    kc = torch.zeros(4, 16, 2, 16, dtype=dtype)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(3, 5 * 32, dtype=dtype)
    key, value = qkv[:, 96:128].view(3, 2, 16), qkv[:, 128:].view(3, 2, 16)
    backend.write_kv(key, value, kc, vc, torch.tensor([33, -1, 34]))
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[33], key[0]) and torch.equal(flat_k[34], key[2])
    assert torch.equal(flat_v[33], value[0]) and torch.equal(flat_v[34], value[2])
    assert flat_k[35].abs().sum() == 0 and int((flat_v != 0).any(-1).any(-1).sum()) == 2
    with pytest.raises(RuntimeError, match="past the cache"):
        backend.write_kv(key, value, kc, vc, torch.tensor([0, 1, 64]))


def test_write_kv_rounds_into_a_16_bit_cache(backend):
    """fp32 rows written to an fp16 cache are its rounded values (the torch backend's too)."""
    from kernels.torch_attention import TorchAttention
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    for writer in (backend, TorchAttention()):
        kc = torch.zeros(2, 4, 2, 16, dtype=torch.float16)
        vc = torch.zeros_like(kc)
        writer.write_kv(key, value, kc, vc, torch.tensor([5, 1]))
        assert torch.equal(kc.view(-1, 2, 16)[[5, 1]], key.half())
        assert torch.equal(vc.view(-1, 2, 16)[[5, 1]], value.half())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_write_kv_and_attention_is_the_two_calls(backend, cache_dtype):
    """The fused op (one call a layer) leaves the cache and returns the output the two ops do, for
    a mixed batch whose new tokens are written before they are attended to."""
    from kernels.interface import TwoCalls
    specs = [(1, 40), (7, 30), (1, 17)]
    q, kc, vc, meta, _, _ = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=11, cache_dtype=cache_dtype)
    table, bs = meta.block_tables, 16
    slots = [int(table[i, p // bs]) * bs + p % bs for i, (ql, ctx) in enumerate(specs) for p in range(ctx - ql, ctx)]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key, value = torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64)
    fused_k, fused_v = kc.clone(), vc.clone()
    got = backend.write_kv_and_attention(q, key, value, fused_k, fused_v, meta, 0.125)
    want = TwoCalls.write_kv_and_attention(backend, q, key, value, kc, vc, meta, 0.125)
    assert torch.equal(fused_k.nan_to_num(), kc.nan_to_num()) and torch.equal(fused_v.nan_to_num(), vc.nan_to_num())
    assert torch.equal(got, want)


def test_registry_and_custom_op(backend):
    from engine_worker.model.compiled_forward import paged_attention
    from kernels.registry import get_attention_backend

    assert get_attention_backend("cpu").name == "cpu"
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("torch").name == "torch"
    specs = [(1, 20), (5, 9)]
    q, kc, vc, meta, keys, values = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=5)
    got = paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables, 0.125, "cpu")
    torch.testing.assert_close(got, dense_reference(q, keys, values, specs, 0.125), **TOL[torch.float32])
    got = paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables, 0.125, "cpu", 6)
    torch.testing.assert_close(got, dense_reference(q, keys, values, specs, 0.125, 6), **TOL[torch.float32])


# ----------------------------------------------------------------------------- sliding window
# 1: a query sees itself alone; 7: windows starting mid-block; 16 and 32: on block boundaries
# (block size 16, contexts a multiple of 16 long); 64: past a tile of the items; 10_000: longer
# than every context (no window).
WINDOWS = (1, 7, 16, 32, 64, 10_000)
WINDOW_BATCHES = {
    **BATCHES,
    # decodes at block boundaries, and 2-4 query tokens (speculative verification) over a prefix
    "window_edges": [(1, 48), (1, 50), (1, 16), (4, 60), (20, 70), (33, 33), (2, 17), (3, 64), (1, 129)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("batch", list(WINDOW_BATCHES))
def test_sliding_window_against_dense(backend, loose_backend, batch, heads, bs, dtype):
    check(windowed(backend, loose_backend, bs), WINDOW_BATCHES[batch], *heads, 64, bs, dtype, windows=WINDOWS)


def test_invariant_windows_need_blocks_of_a_multiple_of_16(backend):
    q, kc, vc, meta, _, _ = make_batch([(1, 40)], 4, 4, 64, 5, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        backend.attention(q, kc, vc, meta, 0.125, 7)


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("batch", ["decode", "window_edges", "long_chunks"])
def test_sliding_window_bf16_head_dims_in_chunks_of_32(backend, batch, d):
    """The bf16 dot products (AVX512-BF16) of decodes and prefill tiles, under windows."""
    check(backend, WINDOW_BATCHES[batch], 8, 2, d, 16, torch.bfloat16, windows=WINDOWS)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", ["window_edges", "long_chunks"])
def test_sliding_window_a_16_bit_cache(backend, batch, dtype, cache_dtype):
    check(backend, WINDOW_BATCHES[batch], 9, 3, 64, 16, dtype, cache_dtype=cache_dtype, windows=WINDOWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("heads,specs", [
    ((9, 3), [(1, 1000)]), ((8, 2), [(1, 700), (1, 64)]), ((4, 4), [(3, 257)]), ((4, 4), [(4, 300)])],
    ids=["one-long", "two", "mha-3-tokens", "mha-4-tokens"])
def test_sliding_window_decodes_split_over_the_window(backend, loose_backend, dtype, bs, heads, specs):
    """One long decode on 2 threads splits its window's keys (not its context's) into parts: the
    result matches the dense one and the serial run's, for windows of a few parts and of one."""
    backend = windowed(backend, loose_backend, bs)
    q, kc, vc, meta, keys, values = make_batch(specs, *heads, 64, bs, dtype, seed=bs + len(specs))
    for window in (1, 40, 130, 333):
        serial, split = serial_and_threaded(lambda: backend.attention(q, kc, vc, meta, 0.125, window), 2)
        want = dense_reference(q, keys, values, specs, 0.125, window)
        torch.testing.assert_close(split.float(), want, **TOL[dtype])
        torch.testing.assert_close(split, serial, **TOL[dtype])


def blocks_before_windows(meta, window, bs):
    """(row, column) of every block-table entry wholly before its sequence's first query's window."""
    return [(i, b) for i, (ql, ctx) in enumerate(zip(meta.seqlens_q_list, meta.seqlens_k_list))
            for b in range(max(0, ctx - ql - window + 1) // bs)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stale", ["nan_blocks", "out_of_range", "minus_one"])
@pytest.mark.parametrize("bs", [16, 5])
def test_blocks_before_the_window_are_never_read(backend, loose_backend, stale, dtype, threads, bs):
    """The blocks wholly before a sequence's window may be released and reused: fill them with NaN,
    or point their entries past the pool or at -1 (which the kernel would reject if it looked),
    and the output keeps its bits; one sequence alone (split on 2 threads) and a mixed batch."""
    for specs in ([(1, 1000)], WINDOW_BATCHES["window_edges"] + [(1, 300), (70, 300), (9, 200)]):
        q, kc, vc, meta, _, _ = make_batch(specs, 9, 3, 64, bs, dtype, seed=len(specs))
        attention = windowed(backend, loose_backend, bs).attention
        for window in (1, 24, 100):
            run = lambda: attention(q, kc, vc, meta, 0.125, window)   # noqa: E731
            want = serial_and_threaded(run, threads)[1]
            entries = blocks_before_windows(meta, window, bs)
            assert entries
            table, k_before, v_before = meta.block_tables.clone(), kc.clone(), vc.clone()
            for i, b in entries:
                if stale == "nan_blocks":
                    kc[table[i, b]] = float("nan")
                    vc[table[i, b]] = float("nan")
                else:
                    meta.block_tables[i, b] = kc.shape[0] + 7 if stale == "out_of_range" else -1
            assert torch.equal(serial_and_threaded(run, threads)[1], want)
            meta.block_tables.copy_(table)
            kc.copy_(k_before)
            vc.copy_(v_before)


def test_window_longer_than_the_context_is_no_window(backend):
    specs = WINDOW_BATCHES["mixed"]
    q, kc, vc, meta, _, _ = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=4)
    assert torch.equal(backend.attention(q, kc, vc, meta, 0.125, max(c for _, c in specs)),
                       backend.attention(q, kc, vc, meta, 0.125))


def test_sliding_window_parallel_matches_serial(backend):
    specs = [(1, 30 + 37 * i) for i in range(24)] + [(96, 300), (128, 128)]
    q, kc, vc, meta, keys, values = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=3)
    serial, parallel = serial_and_threaded(lambda: backend.attention(q, kc, vc, meta, 0.125, 50), 2)
    assert torch.equal(serial, parallel)
    torch.testing.assert_close(parallel, dense_reference(q, keys, values, specs, 0.125, 50), **TOL[torch.float32])


def test_sliding_window_write_kv_and_attention_and_op_schemas(backend):
    """The fused op takes the window as the two calls do; both ops' schemas (and fake kernels,
    through opcheck) take it as a trailing int, 0 by default; a negative one is rejected."""
    from kernels.interface import TwoCalls
    specs = [(1, 40), (7, 30), (1, 17)]
    q, kc, vc, meta, _, _ = make_batch(specs, 9, 3, 64, 16, torch.float32, seed=12)
    bs = 16
    slots = [int(meta.block_tables[i, p // bs]) * bs + p % bs for i, (ql, ctx) in enumerate(specs)
             for p in range(ctx - ql, ctx)]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key, value = torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64)
    fused_k, fused_v = kc.clone(), vc.clone()
    got = backend.write_kv_and_attention(q, key, value, fused_k, fused_v, meta, 0.125, 9)
    want = TwoCalls.write_kv_and_attention(backend, q, key, value, kc, vc, meta, 0.125, 9)
    assert torch.equal(got, want)
    ops = torch.ops.kaiten_cpu
    for op in (ops.paged_attention.default, ops.write_kv_attention.default):
        args_by_name = {a.name: a for a in op._schema.arguments}
        assert args_by_name["window"].default_value == 0 and op._schema.arguments[-1].name == "invariant"
    args = (q, kc.nan_to_num(), vc.nan_to_num(), meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables, 0.125)
    torch.library.opcheck(ops.paged_attention.default, args, {"window": 9},
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_attention(*args, -1)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX-512 (without AVX512-BF16), AVX2 and portable builds of the extension (KAITEN_CPU_ISA)
    pass this file's kernel tests: each has its own decode path (qk_direct_block)."""
    if isa == "avx512" and not cpu_capability()[0].startswith("avx512"):
        pytest.skip("this CPU has no AVX-512")
    assert_passes_in_isa_build(__file__, isa)

"""TorchAttention (kernels/torch_attention.py) against a dense scaled_dot_product_attention
reference: GQA, head sizes, block sizes, boundary lengths, chunked prefill with a cached prefix,
decode-only and mixed batches, shuffled block pools, write_kv skipping, fp32 and bf16, sliding
windows (and block-table entries before a window never read)."""
from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from kernels.interface import AttentionMetadata
from kernels.registry import get_attention_backend
from kernels.torch_attention import TorchAttention

def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ----------------------------------------------------------------------------- case building
class Case:
    """A batch of sequences (q_len, ctx) laid out in a paged cache whose blocks sit in random
    order in a pool, with never-written slots holding large finite garbage."""

    def __init__(self, specs, hq, hkv, d, bs, dtype, seed, shuffle=True, extra_blocks=3,
                 pad_slots=0, q_noncontig=False, extra_table_cols=1, layout_seed=None):
        g = torch.Generator().manual_seed(seed)
        g_layout = g if layout_seed is None else torch.Generator().manual_seed(layout_seed)
        rnd = random.Random(seed)
        self.specs, self.hq, self.hkv, self.d, self.bs, self.dtype = specs, hq, hkv, d, bs, dtype
        nblocks = [math.ceil(ctx / bs) for _, ctx in specs]
        total = sum(nblocks) + extra_blocks
        pool = torch.randperm(total, generator=g_layout).tolist() if shuffle else list(range(total))
        self.tables, p = [], 0
        for n in nblocks:
            self.tables.append(pool[p:p + n])
            p += n
        width = max(nblocks) + extra_table_cols
        table_rows = [t + [-1] * (width - len(t)) for t in self.tables]

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        garbage = (torch.randn(total, bs, hkv, d, generator=g) * 300).to(dtype)
        self.k_cache = garbage.clone()
        self.v_cache = (torch.randn(total, bs, hkv, d, generator=g) * 300).to(dtype)
        self.keys = [rand(ctx, hkv, d) for _, ctx in specs]
        self.values = [rand(ctx, hkv, d) for _, ctx in specs]

        new_k, new_v, slots, qs = [], [], [], []
        k_flat, v_flat = self.k_cache.view(-1, hkv, d), self.v_cache.view(-1, hkv, d)
        for i, (ql, ctx) in enumerate(specs):
            pos = torch.arange(ctx)
            seq_slots = torch.tensor(self.tables[i])[pos // bs] * bs + pos % bs
            cut = ctx - ql                  # [0, cut) is a cached prefix from an earlier step
            k_flat[seq_slots[:cut]] = self.keys[i][:cut]
            v_flat[seq_slots[:cut]] = self.values[i][:cut]
            new_k.extend(self.keys[i][cut:])
            new_v.extend(self.values[i][cut:])
            slots.extend(seq_slots[cut:].tolist())
            qs.append(rand(ql, hq, d))
        # padding rows (slot -1) with garbage that must not land anywhere
        self.write_k = list(new_k)
        self.write_v = list(new_v)
        self.write_slots = list(slots)
        for _ in range(pad_slots):
            pos = rnd.randrange(len(self.write_slots) + 1)
            self.write_k.insert(pos, rand(hkv, d) * 1000)
            self.write_v.insert(pos, rand(hkv, d) * 1000)
            self.write_slots.insert(pos, -1)

        q = torch.cat(qs) if qs else torch.empty(0, hq, d, dtype=dtype)
        if q_noncontig:   # a view into a wider projection output, like q of a fused qkv
            wide = torch.zeros(q.shape[0], hq + 2 * hkv, d, dtype=dtype)
            wide[:, :hq] = q
            q = wide[:, :hq]
            assert not q.is_contiguous()
        self.q = q
        self.qs = qs
        qlens = [ql for ql, _ in specs]
        klens = [ctx for _, ctx in specs]
        cu = [0]
        for ql in qlens:
            cu.append(cu[-1] + ql)
        self.meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seqlens_k=torch.tensor(klens, dtype=torch.int32),
            block_tables=torch.tensor(table_rows, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_seqlen_q=max(qlens), max_seqlen_k=max(klens),
            seqlens_q_list=qlens, seqlens_k_list=klens,
        )

    def write(self, backend):
        k = torch.stack(self.write_k) if self.write_k else torch.empty(0, self.hkv, self.d, dtype=self.dtype)
        v = torch.stack(self.write_v) if self.write_v else torch.empty(0, self.hkv, self.d, dtype=self.dtype)
        backend.write_kv(k, v, self.k_cache, self.v_cache,
                         torch.tensor(self.write_slots, dtype=torch.int64))

    def reference(self, scale, window=0):
        outs = []
        group = self.hq // self.hkv
        for i, (ql, ctx) in enumerate(self.specs):
            q = self.qs[i].double().transpose(0, 1)                              # [Hq, ql, D]
            k = self.keys[i].double().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, ctx, D]
            v = self.values[i].double().transpose(0, 1).repeat_interleave(group, 0)
            mask = visible(ql, ctx, window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


def visible(q_len, ctx, window=0):
    """[q_len, ctx]: query j (at position ctx - q_len + j) sees key k: causal, and with a window W
    only the W keys up to its own (transformers' kv_idx > q_idx - sliding_window)."""
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    k = torch.arange(ctx)[None, :]
    keep = k <= pos
    return keep & (k > pos - window) if window else keep


def run_case(case: Case, backend=None, scale=None, window=0):
    backend = backend or TorchAttention()
    scale = case.d ** -0.5 if scale is None else scale
    case.write(backend)
    out = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, scale, window)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    ref = case.reference(scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[case.dtype])
    return out


def rand_specs(rng, n_decode, n_prefill, max_ctx, bs, chunked=True):
    """Decodes (q_len 1) and prefill chunks, lengths biased towards block boundaries."""
    def length():
        r = rng.random()
        if r < 0.3:   # at a boundary, one past it, or one short
            m = rng.randint(1, max(1, max_ctx // bs))
            return max(1, min(max_ctx, m * bs + rng.choice([-1, 0, 1])))
        return rng.randint(1, max_ctx)
    specs = [(1, length()) for _ in range(n_decode)]
    for _ in range(n_prefill):
        ctx = max(2, length())
        ql = rng.randint(2, ctx) if chunked and rng.random() < 0.6 else ctx
        specs.append((ql, ctx))
    rng.shuffle(specs)
    return specs


HEADS = [(4, 4), (9, 3), (8, 2)]          # GQA ratios 1, 3, 4
DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_and_skips_minus_one(dtype):
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 7, 4, 3, 16
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 0, 27, -1, 13, 14, -1], dtype=torch.int64)
    key = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    value = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    TorchAttention().write_kv(key, value, k_cache, v_cache, slots)
    expect_k, expect_v = k0.view(-1, hkv, d).clone(), v0.view(-1, hkv, d).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s] = key[t]
            expect_v[s] = value[t]
    assert torch.equal(k_cache.view(-1, hkv, d), expect_k)
    assert torch.equal(v_cache.view(-1, hkv, d), expect_v)


def test_write_kv_all_skipped_and_empty():
    k_cache = torch.randn(2, 4, 2, 8)
    v_cache = torch.randn(2, 4, 2, 8)
    k0, v0 = k_cache.clone(), v_cache.clone()
    be = TorchAttention()
    be.write_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), k_cache, v_cache,
                torch.full((3,), -1, dtype=torch.int64))
    be.write_kv(torch.randn(0, 2, 8), torch.randn(0, 2, 8), k_cache, v_cache,
                torch.zeros(0, dtype=torch.int64))
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_write_kv_casts_to_cache_dtype_and_int32_slots():
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    key, value = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    TorchAttention().write_kv(key, value, k_cache, v_cache, torch.tensor([6, 1], dtype=torch.int32))
    assert torch.equal(k_cache.view(-1, 1, 8)[6], key[0].to(torch.bfloat16))
    assert torch.equal(v_cache.view(-1, 1, 8)[1], value[1].to(torch.bfloat16))


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_decode_only(hq, hkv, bs, dtype):
    seed = seed_of(hq, hkv, bs, str(dtype), "decode")
    rng = random.Random(seed)
    specs = rand_specs(rng, n_decode=rng.randint(1, 24), n_prefill=0, max_ctx=130, bs=bs)
    specs += [(1, 16), (1, 32), (1, 17), (1, 33), (1, 1)]   # boundary lengths
    rng.shuffle(specs)
    run_case(Case(specs, hq, hkv, 64, bs, dtype, seed, pad_slots=3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 80])
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_prefill_and_chunked_prefill(hq, hkv, d, dtype):
    seed = seed_of(hq, hkv, d, str(dtype), "prefill")
    rng = random.Random(seed)
    specs = rand_specs(rng, n_decode=0, n_prefill=4, max_ctx=90, bs=16)
    specs += [(16, 16), (32, 32), (17, 17), (5, 33), (16, 48), (1 + 16, 40)]
    run_case(Case(specs, hq, hkv, d, 16, dtype, seed, pad_slots=2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_mixed_batch(hq, hkv, bs, dtype):
    seed = seed_of(hq, hkv, bs, str(dtype), "mixed")
    rng = random.Random(seed)
    specs = rand_specs(rng, n_decode=rng.randint(5, 30), n_prefill=rng.randint(1, 3),
                       max_ctx=100, bs=bs)
    run_case(Case(specs, hq, hkv, 64, bs, dtype, seed, pad_slots=4))


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    rng = random.Random(1000 + seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 3, 4])
    d = rng.choice([32, 48, 64, 96])
    bs = rng.choice([1, 2, 16, 32])
    dtype = rng.choice(DTYPES)
    specs = rand_specs(rng, n_decode=rng.randint(0, 20), n_prefill=rng.randint(0, 3),
                       max_ctx=rng.choice([20, 70, 200]), bs=bs)
    if not specs:
        specs = [(1, 5)]
    run_case(Case(specs, hq, hkv, d, bs, dtype, 1000 + seed, pad_slots=rng.randint(0, 3),
                  q_noncontig=rng.random() < 0.5, shuffle=rng.random() < 0.8))


def test_decode_groups_regardless_of_grouping_params():
    """One group per sequence, everything in one group, and groups capped by tokens all agree."""
    rng = random.Random(7)
    specs = rand_specs(rng, n_decode=40, n_prefill=2, max_ctx=300, bs=16)
    for backend in (TorchAttention(group_max_seqs=1), TorchAttention(group_max_seqs=10**6,
                    group_min_fill=0.0, group_max_tokens=10**9), TorchAttention(group_max_tokens=16),
                    TorchAttention(group_max_seqs=3, group_min_fill=0.95)):
        run_case(Case(specs, 9, 3, 64, 16, torch.float32, 7), backend=backend)


def test_long_context_decode_and_custom_scale():
    specs = [(1, 1500), (1, 1024), (1, 1025), (3, 700), (1, 2)]
    run_case(Case(specs, 9, 3, 64, 16, torch.float32, 11), scale=0.3)
    run_case(Case(specs, 9, 3, 64, 32, torch.bfloat16, 12), scale=0.05)


def test_decode_batch_in_order_and_contiguous_pool():
    """Equal lengths keep batch order (a contiguous run of query rows) and an unshuffled pool."""
    specs = [(1, 40)] * 12 + [(1, 8)] * 5
    run_case(Case(specs, 9, 3, 64, 16, torch.float32, 13, shuffle=False))


def test_unwritten_output_rows_would_be_caught(monkeypatch):
    """Every allocation the backend makes starts as NaN; every output row must still be written."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    rng = random.Random(21)
    specs = rand_specs(rng, n_decode=17, n_prefill=3, max_ctx=80, bs=16)
    run_case(Case(specs, 9, 3, 64, 16, torch.float32, 21))
    run_case(Case(specs, 9, 3, 64, 16, torch.bfloat16, 22))


def test_without_host_lists_matches():
    rng = random.Random(31)
    specs = rand_specs(rng, n_decode=10, n_prefill=2, max_ctx=64, bs=16)
    case = Case(specs, 9, 3, 64, 16, torch.float32, 31)
    case.meta.seqlens_q_list = None
    case.meta.seqlens_k_list = None
    run_case(case)


def test_plan_reused_across_layers_and_rebuilt_when_metadata_changes():
    """Same metadata for several layers (other caches), then metadata refilled in place."""
    be = TorchAttention()
    rng = random.Random(41)
    specs = rand_specs(rng, n_decode=12, n_prefill=2, max_ctx=64, bs=16)
    a = Case(specs, 9, 3, 64, 16, torch.float32, 41, layout_seed=1)
    run_case(a, backend=be)
    plan = be._plans[0]
    b = Case(specs, 9, 3, 64, 16, torch.float32, 42, layout_seed=1)  # layer 2: other data
    b.meta = a.meta
    run_case(b, backend=be)
    assert be._plans[0] is plan
    # same lengths, other block tables, written into the same tensor objects in place
    c = Case(specs, 9, 3, 64, 16, torch.float32, 43, layout_seed=2)
    assert not torch.equal(c.meta.block_tables, a.meta.block_tables)
    a.meta.block_tables.copy_(c.meta.block_tables)
    a.meta.slot_mapping = c.meta.slot_mapping
    c.meta = a.meta
    run_case(c, backend=be)
    assert be._plans[0] is not plan
    again = be._plans[0]
    run_case(c, backend=be)
    assert be._plans[0] is again


def test_inside_and_outside_inference_mode():
    """The engine runs under inference_mode; the same backend instance may also be used outside."""
    be = TorchAttention()
    specs = [(1, 40), (1, 7), (6, 30)]
    with torch.inference_mode():
        run_case(Case(specs, 9, 3, 64, 16, torch.float32, 61), backend=be)
    run_case(Case(specs, 9, 3, 64, 16, torch.float32, 62), backend=be)
    with torch.inference_mode():
        run_case(Case(specs, 9, 3, 64, 16, torch.float32, 63), backend=be)


def test_q_dtype_differs_from_cache():
    case = Case([(1, 20), (4, 9)], 9, 3, 64, 16, torch.bfloat16, 51)
    case.write(TorchAttention())
    out = TorchAttention().attention(case.q.float(), case.k_cache, case.v_cache, case.meta, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), case.reference(0.125), **TOL[torch.bfloat16])


# ----------------------------------------------------------------------------- sliding window
# 1: a query sees itself alone; 7: windows starting mid-block; 16 and 32: on block boundaries of
# a context a multiple of 16 long; 10_000: longer than every context (no window).
WINDOWS = [1, 7, 16, 32, 10_000]
WINDOW_SPECS = [(1, 48), (1, 50), (1, 16), (1, 3), (4, 60), (20, 70), (33, 33), (2, 17)]


def blocks_before_windows(meta, window, block_size):
    """(row, column) of every block-table entry wholly before its sequence's first query's window."""
    out = []
    for i, (ql, ctx) in enumerate(zip(meta.seqlens_q_list, meta.seqlens_k_list)):
        first_key = max(0, ctx - ql - window + 1)
        out += [(i, b) for b in range(first_key // block_size)]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_sliding_window_mixed_batch(hq, hkv, bs, dtype):
    """Decodes and prefill chunks over cached prefixes, in one batch, under every window."""
    seed = seed_of(hq, hkv, bs, str(dtype), "window")
    rng = random.Random(seed)
    specs = rand_specs(rng, n_decode=rng.randint(4, 12), n_prefill=rng.randint(1, 3), max_ctx=100, bs=bs)
    case = Case(specs + WINDOW_SPECS, hq, hkv, 64, bs, dtype, seed, pad_slots=2)
    be = TorchAttention()
    for window in WINDOWS:
        run_case(case, backend=be, window=window)


def test_sliding_window_decode_groups_regardless_of_grouping_params():
    rng = random.Random(8)
    specs = rand_specs(rng, n_decode=40, n_prefill=2, max_ctx=300, bs=16)
    for backend in (TorchAttention(group_max_seqs=1), TorchAttention(group_max_seqs=10**6,
                    group_min_fill=0.0, group_max_tokens=10**9), TorchAttention(group_max_tokens=16)):
        for window in (1, 40, 128):
            run_case(Case(specs, 9, 3, 64, 16, torch.float32, 8), backend=backend, window=window)


def test_window_longer_than_every_context_is_no_window():
    case = Case(WINDOW_SPECS, 9, 3, 64, 16, torch.float32, 9)
    be = TorchAttention()
    assert torch.equal(run_case(case, backend=be, window=70), run_case(case, backend=be))


@pytest.mark.parametrize("stale", ["out_of_range", "minus_one", "nan_block"])
def test_blocks_before_the_window_are_never_read(stale):
    """The entries of blocks wholly before a sequence's window may name a released block: point
    them past the pool, at -1, or at a NaN block, and the output stays the same."""
    specs = WINDOW_SPECS + [(1, 200), (5, 180), (1, 97)]
    case = Case(specs, 9, 3, 64, 16, torch.float32, 10, extra_blocks=1)
    window = 24
    be = TorchAttention()
    want = run_case(case, backend=be, window=window)
    entries = blocks_before_windows(case.meta, window, 16)
    assert len(entries) > 10
    if stale == "nan_block":
        value = next(b for b in range(case.k_cache.shape[0]) if all(b not in t for t in case.tables))
        case.k_cache[value] = float("nan")
        case.v_cache[value] = float("nan")
    else:
        value = {"out_of_range": case.k_cache.shape[0] + 5, "minus_one": -1}[stale]
    for i, b in entries:
        case.meta.block_tables[i, b] = value
    got = be.attention(case.q, case.k_cache, case.v_cache, case.meta, case.d ** -0.5, window)
    assert torch.equal(got, want)


def test_compiled_forwards_op_takes_the_window():
    """The compiled model's kaiten::paged_attention (OpAttention, for backends torch.compile cannot
    trace) forwards the window, as its trailing int argument (0 by default), fake kernel included."""
    from engine_worker.model.compiled_forward import OpAttention
    case = Case(WINDOW_SPECS, 9, 3, 64, 16, torch.float32, 12)
    case.write(TorchAttention())
    be = TorchAttention()
    for window in (0, 1, 20):
        want = be.attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125, window)
        got = OpAttention("torch").attention(case.q, case.k_cache, case.v_cache, case.meta, 0.125, window)
        assert torch.equal(got, want)
    op = torch.ops.kaiten.paged_attention.default
    assert op._schema.arguments[-1].name == "window" and op._schema.arguments[-1].default_value == 0
    args = (case.q, case.k_cache, case.v_cache, case.meta.cu_seqlens_q, case.meta.seqlens_k,
            case.meta.block_tables, 0.125, "torch")
    torch.library.opcheck(op, args, {"window": 20}, test_utils=("test_schema", "test_faketensor"))


def test_negative_window_is_rejected():
    case = Case([(1, 5)], 4, 4, 16, 16, torch.float32, 11)
    with pytest.raises(ValueError, match="window"):
        TorchAttention().attention(case.q, case.k_cache, case.v_cache, case.meta, 0.25, -1)


def test_registry_returns_torch_backend():
    be = get_attention_backend("torch")
    assert isinstance(be, TorchAttention) and be.name == "torch"
    from kernels.cpu_attention import cpp_attention_available
    assert get_attention_backend("auto", "cpu").name == ("cpu" if cpp_attention_available() else "torch")

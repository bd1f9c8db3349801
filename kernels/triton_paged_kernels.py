"""The Triton kernels of paged attention: KV write, split-KV decode (and its reduction) and
chunked-prefill attention. kernels/triton_attention.py launches them (TritonAttention).

All kernels read K/V from the paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
through the block tables (see ``kernels/interface.py``); any block size works because every KV
tile gathers its rows token by token (``page = block_table[t // block_size]``), so a tile of
``BLOCK_N`` keys may span several cache blocks.

GQA is handled inside the kernels: a program owns one KV head and all ``G = num_heads //
num_kv_heads`` query heads that read it, so each K/V tile is loaded once per group and K/V are
never repeated. In the prefill kernel the rows of a tile are (query token, head-in-group) pairs,
``BLOCK_Q = BLOCK_M // G`` tokens times ``G`` heads; in the decode kernel the rows are the ``G``
heads of the single query token (padded to 16 rows for ``tl.dot``).

A sliding window (``window`` W > 0) gives each query row its own first key, position - W + 1:
the decode kernel's tiles (and splits) start at the tile holding the window's first key, the
prefill kernel's at the one holding its first row's, and rows mask the keys before theirs. Keys
before that first key are masked out of every load, block-table entries included, so blocks the
engine released once they left the window are never read.

Nothing here depends on tensor values on the host, so the launches are safe to capture in CUDA
graphs. Set ``TRITON_INTERPRET=1`` before importing this module to run the kernels on CPU tensors
with Triton's interpreter (Triton reads it when ``@triton.jit`` decorates the kernels).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------

@triton.jit
def write_kv_kernel(
    K, V, K_cache, V_cache, slot_mapping, num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """BLOCK_T tokens per program; each token row is its (head, dim) pairs flattened."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    hd = tl.arange(0, BLOCK_H * BLOCK_D)
    h = hd // BLOCK_D
    d = hd % BLOCK_D
    # a slot of -1 (padding row, e.g. a padded CUDA-graph batch) writes nothing
    mask = (slot >= 0)[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]
    src_k = tok[:, None] * stride_kt + (h * stride_kh + d * stride_kd)[None, :]
    src_v = tok[:, None] * stride_vt + (h * stride_vh + d * stride_vd)[None, :]
    k = tl.load(K + src_k, mask=mask)
    v = tl.load(V + src_v, mask=mask)
    dst_k = (blk * stride_kcb + off * stride_kco)[:, None] + (h * stride_kch + d * stride_kcd)[None, :]
    dst_v = (blk * stride_vcb + off * stride_vco)[:, None] + (h * stride_vch + d * stride_vcd)[None, :]
    tl.store(K_cache + dst_k, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + dst_v, v.to(V_cache.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Shared inner loop: online softmax over KV tiles [tile_lo, tile_hi) of one sequence
# --------------------------------------------------------------------------------------------

@triton.jit
def _attn_tiles(
    acc, m_i, l_i, q, qpos,
    K_cache, V_cache, bt_row, kvh,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    tile_lo, tile_hi, kv_lo, kv_len, window, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Keys [kv_lo, kv_len) are loaded (the others, block-table entries included, are never read).
    CAUSAL: also mask key > qpos[row]; with SLIDING, key <= qpos[row] - window too. Non-causal
    tiles must be fully below every row's position (the caller guarantees it)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = (offs_n >= kv_lo) & (offs_n < kv_len)
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot_off = (offs_n % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K_cache + page[:, None] * stride_kb + slot_off[:, None] * stride_ko
                    + kvh * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V_cache + page[:, None] * stride_vb + slot_off[:, None] * stride_vo
                    + kvh * stride_vh + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            keep = (offs_n[None, :] <= qpos[:, None]) & n_mask[None, :]
            if SLIDING:
                keep = keep & (offs_n[None, :] > qpos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Without SLIDING, m_new is finite for every row: each row sees at least one key in the
        # first tile, and rows with no key in a later tile keep their previous (finite) max. With
        # it, a row's window may start in a later tile: its weights are exp2(-inf - 0) = 0 until then.
        if SLIDING:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------------
# Decode: one query token per sequence, optional split-KV (flash-decoding) + reduction
# --------------------------------------------------------------------------------------------

@triton.jit
def decode_kernel(
    Q, K_cache, V_cache, O, O_part, LSE_part,
    cu_seqlens_q, seqlens_k, block_tables,
    qk_scale, num_splits, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_len != 1:      # no query this step, or a prefill chunk (the prefill kernel's) in a mix
        return
    kv_len = tl.load(seqlens_k + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    tok = q_start.to(tl.int64)
    q = tl.load(Q + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # The splits share the tiles from the one holding the first key the query sees (with a
    # window, the window's: every row's, as the rows are one token's heads).
    if SLIDING:
        kv_lo = tl.maximum(kv_len - window, 0)
    else:
        kv_lo = 0
    first_tile = kv_lo // BLOCK_N
    end_tile = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_split = tl.cdiv(end_tile - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qpos = tl.zeros([BLOCK_G], dtype=tl.int32)  # unused (not causal: one query at the end)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, qpos, K_cache, V_cache, bt_row, kvh,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
        tile_lo, tile_hi, kv_lo, kv_len, window, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION)

    empty = l_i == 0.0                  # no keys in this split (or an empty context)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SPLIT:
        # partials: [num_seqs, num_heads, num_splits, (BLOCK_D)], lse in log2 units
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(LSE_part + row, lse, mask=g_mask)
        tl.store(O_part + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_mask[:, None])
    else:
        tl.store(O + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_reduce_kernel(
    O, O_part, LSE_part, cu_seqlens_q, num_splits,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_len != 1:
        return
    tok = q_start.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(LSE_part + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)    # empty context: all weights 0 -> output 0
    w = tl.exp2(lse - m)
    live = s_mask & (lse > float("-inf"))
    part = tl.load(O_part + row[:, None] * BLOCK_D + offs_d[None, :], mask=live[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------
# Prefill (chunked, with a cached prefix; also handles q_len 1 rows of mixed batches)
# --------------------------------------------------------------------------------------------

@triton.jit
def _find_seq(cu_seqlens_q, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest i with cu_seqlens_q[i] // BLOCK_Q + i <= pid (sequence i's q-tiles start there)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def prefill_kernel(
    Q, K_cache, V_cache, O,
    cu_seqlens_q, seqlens_k, block_tables,
    qk_scale, num_seqs, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SKIP_DECODE: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    if SKIP_DECODE:             # q_len 1 rows of a mixed batch: the decode kernel does them
        if q_len == 1:
            return
    kv_len = tl.load(seqlens_k + seq)
    ctx_start = kv_len - q_len           # position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP          # query index within the sequence
    heads = kvh * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    first_pos = ctx_start + q_tile * BLOCK_Q                          # tile's first query position
    # Padding rows attend as the first row does, so every row has a finite max (their output is
    # dropped).
    qpos = tl.where(row_valid, ctx_start + q_idx, first_pos)

    kv_hi = tl.minimum(kv_len, first_pos + BLOCK_Q)                   # keys this tile can see
    full_tiles = (first_pos + 1) // BLOCK_N       # tiles with every key <= first_pos: no masking
    num_tiles = tl.cdiv(kv_hi, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    if SLIDING:
        # Keys from the first row's window start; the tiles below the last row's window start
        # (win_tiles) are masked by the rows' windows as well as causally.
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        win_tiles = tl.minimum(tl.cdiv(tl.maximum(kv_hi - window, 0), BLOCK_N), num_tiles)
        acc, m_i, l_i = _attn_tiles(
            acc, m_i, l_i, q, qpos, K_cache, V_cache, bt_row, kvh,
            stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_lo // BLOCK_N, win_tiles, kv_lo, kv_hi, window, qk_scale,
            PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, True, True, DOT_PRECISION)
    else:
        kv_lo = 0
        win_tiles = 0
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, qpos, K_cache, V_cache, bt_row, kvh,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
        win_tiles, full_tiles, kv_lo, kv_hi, window, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION)
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, qpos, K_cache, V_cache, bt_row, kvh,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
        tl.maximum(full_tiles, win_tiles), num_tiles, kv_lo, kv_hi, window, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, True, False, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]     # l_i == 0 only for an empty context
    tl.store(O + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])

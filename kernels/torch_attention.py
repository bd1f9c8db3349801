"""Paged attention in plain torch, tuned for the CPU (see kernels/interface.py for the contract).

How a step's batch is computed:

* Decodes (q_len == 1) are batched. They are sorted by context length and cut into small groups
  of similar length (few padded positions, and a group's gathered K/V stays in the CPU cache
  between the gather and the attention). Per group: one ``index_select`` of the group's blocks
  into a reused workspace (the only copy of the KV), one ``scaled_dot_product_attention`` call
  with the GQA folded into the query length (query [n, Hkv, G, D] against key [n, Hkv, L, D], so
  no repeat of K/V; enable_gqa with one query row per head is several times slower), an additive
  mask for the positions beyond each context.
* Prefill chunks (q_len > 1, a few per step) loop per sequence: gather the context's blocks,
  then one SDPA call with ``enable_gqa`` and a bottom-right aligned causal mask (the chunk may sit
  in the middle of a context with a cached prefix).
* With a sliding window, both gather from the block holding the first key a query of the
  sequence sees (the blocks before it may have been released), and the masks also cut each
  query's keys before its window.

The plan (groups, index tensors, masks) depends only on the metadata and the window, so it is
built once per window and reused by every layer of the step with that window (the engine calls
attention once per layer with the same metadata); the plans are rebuilt whenever the metadata's
contents differ.

The padded positions of a group (beyond a context, before a window's first key in its first
block, or a padding block, read as block 0) are masked, but they are read: the cache must hold
finite values everywhere (allocate it with torch.zeros, as engine_worker/model/model_runner.py
does), since NaN/Inf there would leak through 0 * NaN in the softmax and P @ V products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.interface import AttentionMetadata, TwoCalls

__all__ = ["TorchAttention"]


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attended, -inf elsewhere. SDPA turns a boolean mask into this on every call (about
    a tenth of the decode time); the plan builds it once for all layers."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


class _DecodeGroup:
    __slots__ = ("tok_idx", "tok_start", "n", "nblk", "blocks", "mask")

    def __init__(self, tok_idx, tok_start, n, nblk, blocks, mask):
        self.tok_idx = tok_idx      # int64 [n] query rows of the group (None when a contiguous run)
        self.tok_start = tok_start  # first query row when the group is a contiguous run
        self.n = n                  # sequences in the group
        self.nblk = nblk            # blocks gathered per sequence (the group's longest span)
        self.blocks = blocks        # int64 [n * nblk] block ids, padding clamped to a valid block
        self.mask = mask            # additive [n, 1, 1, nblk * block_size], None: no padding


class _Prefill:
    __slots__ = ("q_start", "q_len", "first", "keys", "nblk", "blocks", "mask")

    def __init__(self, q_start, q_len, first, keys, nblk, blocks, mask):
        self.q_start = q_start
        self.q_len = q_len
        self.first = first          # the first key in the gathered blocks (position % block_size)
        self.keys = keys            # keys from it to the context's end
        self.nblk = nblk
        self.blocks = blocks        # int64 [nblk], from the block holding the first key
        self.mask = mask            # additive [q_len, keys] bottom-right causal (and window), None:
                                    # plain causal with q_len == keys


class _Plan:
    __slots__ = ("key", "snap", "decode_groups", "prefills", "max_gather_blocks")

    def __init__(self, key, snap, decode_groups, prefills, max_gather_blocks):
        self.key = key
        self.snap = snap            # copies of the metadata tensors the plan was built from
        self.decode_groups = decode_groups
        self.prefills = prefills
        self.max_gather_blocks = max_gather_blocks


def _first_key(pos: int, window: int) -> int:
    """The first key the query at position pos sees (its window's, else the context's)."""
    return max(0, pos - window + 1) if window > 0 else 0


class TorchAttention(TwoCalls):
    """CPU paged attention with torch ops. One instance serves all layers of one engine; it keeps
    a K/V gather workspace and the current step's plan, so it is not meant to be called from
    several threads at once."""

    name = "torch"
    cuda_graph_safe = False     # plans on the host from the metadata's values
    compile_safe = False
    any_kv_dtype = True         # the gathered K/V are converted to the queries' dtype

    def __init__(self, group_max_seqs: int = 8, group_min_fill: float = 0.8,
                 group_max_tokens: int = 8192, deterministic: bool = True) -> None:
        # deterministic: one SDPA call per query token over exactly its own keys, so its result
        # depends on that row alone (the grouped calls' padding and tiling depend on the batch).
        # Slower: a call per token and layer (docs/deterministic.md).
        self.deterministic = deterministic
        # Decode grouping: a group takes sequences (sorted by length, longest first) while the
        # shortest is at least `group_min_fill` of the group's padded length, there are at most
        # `group_max_seqs` of them, and the group's padded tokens stay within `group_max_tokens`
        # (keeps the gathered K/V of one group in cache). Measured on a 2-core AVX2 CPU, an SDPA
        # call costs about as much as ~200 extra padded tokens, so small groups pay off.
        self.group_max_seqs = max(1, int(group_max_seqs))
        self.group_min_fill = float(group_min_fill)
        self.group_max_tokens = max(1, int(group_max_tokens))
        self._ws: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plans: dict[int, _Plan] = {}      # by window: a step's layers may use two

    # ------------------------------------------------------------------ write_kv
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        hkv, d = k_cache.shape[-2], k_cache.shape[-1]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        slots = slot_mapping
        if slots.dtype != torch.int64:
            slots = slots.long()
        if key.dtype != k_flat.dtype:
            key = key.to(k_flat.dtype)
        if value.dtype != v_flat.dtype:
            value = value.to(v_flat.dtype)
        if bool((slots < 0).any()):
            keep = (slots >= 0).nonzero().squeeze(1)
            if keep.numel() == 0:
                return
            slots = slots.index_select(0, keep)
            key = key.index_select(0, keep)
            value = value.index_select(0, keep)
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)

    # ------------------------------------------------------------------ attention
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        num_tokens, hq, d = q.shape
        _, block_size, hkv, dk = k_cache.shape
        if dk != d:
            raise ValueError(f"query head_dim {d} != cache head_dim {dk}")
        if hq % hkv:
            raise ValueError(f"num_heads {hq} is not a multiple of num_kv_heads {hkv}")
        if window < 0:
            raise ValueError(f"window {window} < 0 (0: no window)")
        group = hq // hkv
        out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        if self.deterministic:
            return self._per_row(q, k_cache, v_cache, meta, scale, int(window), out)

        plan = self._get_plan(meta, block_size, q.device, q.dtype, int(window))
        kbuf, vbuf = self._workspace(plan.max_gather_blocks, k_cache)

        for g in plan.decode_groups:
            n, nblk = g.n, g.nblk
            kb = kbuf[: n * nblk]
            vb = vbuf[: n * nblk]
            torch.index_select(k_cache, 0, g.blocks, out=kb)
            torch.index_select(v_cache, 0, g.blocks, out=vb)
            # [n*nblk, bs, Hkv, D] -> [n, Hkv, L, D] (a strided view, no copy)
            k = kb.view(n, nblk * block_size, hkv, d).transpose(1, 2).to(q.dtype)
            v = vb.view(n, nblk * block_size, hkv, d).transpose(1, 2).to(q.dtype)
            if g.tok_idx is None:
                qg = q[g.tok_start: g.tok_start + n]
            else:
                qg = q.index_select(0, g.tok_idx)
            # GQA fold: the G query heads of one kv head become G query rows.
            o = F.scaled_dot_product_attention(qg.view(n, hkv, group, d), k, v,
                                               attn_mask=g.mask, scale=scale)
            o = o.view(n, hq, d)
            if g.tok_idx is None:
                out[g.tok_start: g.tok_start + n] = o
            else:
                out.index_copy_(0, g.tok_idx, o)

        for p in plan.prefills:
            kb = kbuf[: p.nblk]
            vb = vbuf[: p.nblk]
            torch.index_select(k_cache, 0, p.blocks, out=kb)
            torch.index_select(v_cache, 0, p.blocks, out=vb)
            keys = slice(p.first, p.first + p.keys)
            k = kb.view(p.nblk * block_size, hkv, d)[keys].transpose(0, 1).unsqueeze(0).to(q.dtype)
            v = vb.view(p.nblk * block_size, hkv, d)[keys].transpose(0, 1).unsqueeze(0).to(q.dtype)
            qp = q[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            if p.mask is None:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=group > 1)
            else:
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale,
                                                   enable_gqa=group > 1)
            out[p.q_start: p.q_start + p.q_len] = o[0].transpose(0, 1)

        return out

    @staticmethod
    def _per_row(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int,
                 out: torch.Tensor) -> torch.Tensor:
        """Each query token alone against its own keys: [1, Hkv, G, D] x [1, Hkv, keys, D]."""
        _, block_size, hkv, d = k_cache.shape
        group = q.shape[1] // hkv
        qlens = meta.seqlens_q_list or torch.diff(meta.cu_seqlens_q).tolist()
        klens = meta.seqlens_k_list or meta.seqlens_k.tolist()
        tables = meta.block_tables.tolist()
        start = 0
        for q_len, ctx, table in zip(qlens, klens, tables):
            if ctx == 0:
                out[start: start + q_len] = 0
            for j in range(q_len if ctx else 0):
                pos = ctx - q_len + j
                first = _first_key(pos, window)
                b0, b1 = first // block_size, pos // block_size + 1
                blocks = torch.tensor(table[b0:b1], dtype=torch.long, device=q.device)
                keys = slice(first - b0 * block_size, pos + 1 - b0 * block_size)
                k = k_cache.index_select(0, blocks).flatten(0, 1)[keys].transpose(0, 1).unsqueeze(0).to(q.dtype)
                v = v_cache.index_select(0, blocks).flatten(0, 1)[keys].transpose(0, 1).unsqueeze(0).to(q.dtype)
                o = F.scaled_dot_product_attention(q[start + j].view(1, hkv, group, d), k, v, scale=scale)
                out[start + j] = o.view(-1, d)
            start += q_len
        return out

    # ------------------------------------------------------------------ helpers
    def _workspace(self, nblocks: int, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused gather buffers [>= nblocks, block_size, Hkv, D]. Fresh large allocations are
        mmap'ed and page-faulted on every call, which costs as much as the gather itself."""
        shape = tuple(k_cache.shape[1:])
        # buffers made under inference_mode cannot be written outside it (and vice versa is fine,
        # but keep one kind at a time)
        key = (k_cache.dtype, k_cache.device, shape, torch.is_inference_mode_enabled())
        cur = self._ws.get(key)
        if cur is None or cur[0].shape[0] < nblocks:
            size = max(nblocks, 1)
            if cur is not None:
                size = max(size, cur[0].shape[0] + cur[0].shape[0] // 4)
            self._ws.clear()   # one dtype/shape at a time; drop stale buffers first
            cur = (torch.empty((size, *shape), dtype=k_cache.dtype, device=k_cache.device),
                   torch.empty((size, *shape), dtype=k_cache.dtype, device=k_cache.device))
            self._ws[key] = cur
        return cur

    def _get_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device,
                  dtype: torch.dtype, window: int) -> _Plan:
        key = (block_size, device, dtype,
               None if meta.seqlens_q_list is None else tuple(meta.seqlens_q_list),
               None if meta.seqlens_k_list is None else tuple(meta.seqlens_k_list))
        plan = self._plans.get(window)
        # Every layer of a step passes the same metadata; compare contents (a few microseconds),
        # not identities, so a caller that refills its metadata tensors in place stays correct.
        if (plan is not None and plan.key == key
                and torch.equal(plan.snap[0], meta.cu_seqlens_q)
                and torch.equal(plan.snap[1], meta.seqlens_k)
                and torch.equal(plan.snap[2], meta.block_tables)):
            return plan
        plan = self._build_plan(meta, block_size, device, dtype, window, key)
        self._plans[window] = plan
        return plan

    def _build_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device,
                    dtype: torch.dtype, window: int, key: tuple) -> _Plan:
        qlens = meta.seqlens_q_list
        if qlens is None:
            qlens = torch.diff(meta.cu_seqlens_q).tolist()
        klens = meta.seqlens_k_list
        if klens is None:
            klens = meta.seqlens_k.tolist()
        num_seqs = len(klens)
        if len(qlens) != num_seqs:
            raise ValueError(f"{len(qlens)} query lengths for {num_seqs} sequences")

        starts = [0] * num_seqs
        acc = 0
        for i, ql in enumerate(qlens):
            starts[i] = acc
            acc += ql

        bt = meta.block_tables
        if bt.device != device:
            bt = bt.to(device)
        # -1 padding would make index_select fail; those positions are masked anyway.
        bt = bt.clamp(min=0).long()
        max_gather = 0

        # ---- decodes: sequence i attends keys [first[i], ctx), gathered from the block holding
        # first[i] (the whole context without a window)
        dec = [i for i in range(num_seqs) if qlens[i] == 1]
        first = {i: _first_key(klens[i] - 1, window) for i in dec}
        span = {i: klens[i] - first[i] for i in dec}
        # longest first; stable so equal lengths keep batch order (contiguous runs stay runs)
        dec.sort(key=lambda i: -span[i])
        groups: list[_DecodeGroup] = []
        j = 0
        nd = len(dec)
        while j < nd:
            padded = max(1, -(-span[dec[j]] // block_size)) * block_size
            max_n = max(1, min(self.group_max_seqs, self.group_max_tokens // padded))
            min_len = self.group_min_fill * padded
            e = j + 1
            while e < nd and e - j < max_n and span[dec[e]] >= min_len:
                e += 1
            members = dec[j:e]
            n = len(members)
            rows = [starts[i] for i in members]
            contiguous = all(rows[t] == rows[0] + t for t in range(n))
            nblk, blocks, mask = self._decode_gather(bt, members, first, klens, block_size, device, dtype)
            tok_idx = None if contiguous else torch.tensor(rows, dtype=torch.long, device=device)
            groups.append(_DecodeGroup(tok_idx, rows[0], n, nblk, blocks, mask))
            max_gather = max(max_gather, n * nblk)
            j = e

        # ---- prefill chunks (q_len > 1): keys from the first query's first key
        prefills: list[_Prefill] = []
        for i in range(num_seqs):
            ql, ctx = qlens[i], klens[i]
            if ql <= 1:
                continue
            if ql > ctx:
                raise ValueError(f"sequence {i}: {ql} query tokens but a context of {ctx}")
            first_key = _first_key(ctx - ql, window)
            fb, end = first_key // block_size, -(-ctx // block_size)
            blocks = bt[i, fb:end]
            if blocks.numel() != end - fb:
                raise ValueError("block_tables has fewer columns than the context needs")
            keys = ctx - first_key
            cut = 0 < window < ctx             # the window hides some key from some query
            if ql == keys and not cut:
                mask = None    # top-left and bottom-right causal coincide
            else:
                keep = torch.ones((ql, keys), dtype=torch.bool, device=device).tril_(keys - ql)
                if cut:
                    keep.triu_(keys - ql - window + 1)
                mask = _additive(keep, dtype)
            prefills.append(_Prefill(starts[i], ql, first_key - fb * block_size, keys, end - fb, blocks, mask))
            max_gather = max(max_gather, end - fb)

        snap = (meta.cu_seqlens_q.clone(), meta.seqlens_k.clone(), meta.block_tables.clone())
        return _Plan(key, snap, groups, prefills, max_gather)

    @staticmethod
    def _decode_gather(bt: torch.Tensor, members: list[int], first: dict[int, int], klens: list[int],
                       block_size: int, device: torch.device, dtype: torch.dtype):
        """(nblk, blocks, mask) of a decode group: each member's blocks from the one holding its
        first key, padded with block 0 to the group's widest span; the mask keeps each member's
        keys [first, ctx) and hides the rest (None when nothing is hidden)."""
        n = len(members)
        fb = [first[i] // block_size for i in members]
        ends = [-(-klens[i] // block_size) for i in members]
        if max(ends) > bt.shape[1]:      # block table narrower than the context (bad meta)
            raise ValueError("block_tables has fewer columns than the context needs")
        nblk = max(1, max(e - b for e, b in zip(ends, fb)))
        padded = nblk * block_size
        fb_t = torch.tensor(fb, dtype=torch.long, device=device)
        cols = fb_t[:, None] + torch.arange(nblk, device=device)
        inside = cols < torch.tensor(ends, dtype=torch.long, device=device)[:, None]
        seq_idx = torch.tensor(members, dtype=torch.long, device=device)
        # only each member's own columns are used: those before its first block may be stale
        blocks = bt.index_select(0, seq_idx).gather(1, cols.clamp(max=bt.shape[1] - 1))
        blocks = blocks.masked_fill_(~inside, 0).reshape(-1)
        lo = [first[i] - b * block_size for i, b in zip(members, fb)]
        hi = [klens[i] - b * block_size for i, b in zip(members, fb)]
        if all(a == 0 for a in lo) and all(h == padded for h in hi):
            return nblk, blocks, None
        pos = torch.arange(padded, device=device)
        keep = (pos >= torch.tensor(lo, device=device)[:, None]) & (pos < torch.tensor(hi, device=device)[:, None])
        return nblk, blocks, _additive(keep.view(n, 1, 1, padded), dtype)

"""CUDA graphs for decode steps (as in vLLM and nano-vllm).

A decode step of a small model is a few hundred kernel launches of microseconds each, so on a
GPU the Python and launch overhead, not the math, sets its time. The runner captures the whole
forward pass of a decode-only batch once per padded batch size (1, 2, 4, 8, then 16..max in
steps of 16) into static input buffers, and a step of n decodes replays the smallest graph of at
least n rows. Pad rows have slot -1 (the KV write skips them) and an empty context, and their
outputs are dropped. Prefill and mixed steps run eagerly; the logits are computed outside the
graph, for the sampled rows only.
"""
from __future__ import annotations

import bisect
import logging

import torch

from kernels.interface import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to the first size that holds max_batch rows."""
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sizes[:next(i for i, b in enumerate(sizes) if b >= max_batch) + 1]


class DecodeGraphRunner:
    def __init__(self, model, kv_caches, backend, *, max_batch: int, max_blocks_per_seq: int,
                 max_seqlen_k: int, device: torch.device):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = capture_sizes(max_batch)
        self.max_seqlen_k = max_seqlen_k
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seqlens_k = torch.zeros(n, dtype=torch.int32, device=device)
        # pad entries point at block 0 (a valid block), never read: the context ends before them
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The static buffers as the model's inputs for a batch of `size` rows."""
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seqlens_k=self.seqlens_k[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k)
        return self.input_ids[:size], self.positions[:size], meta

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy a decode batch into the static buffers, padded; returns the padded inputs."""
        n = meta.num_seqs
        size = self.padded_size(n)
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seqlens_k[:n].copy_(meta.seqlens_k)
        self.seqlens_k[n:size].zero_()
        self.block_tables[:n, :width].copy_(meta.block_tables.clamp(min=0))
        return self._inputs(size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool. Needs CUDA."""
        pool = None                 # the buffers still hold slot -1 and empty contexts: no KV writes
        for size in reversed(self.sizes):
            ids, pos, meta = self._inputs(size)
            self.model(ids, pos, self.kv_caches, meta, self.backend)      # warm-up (Triton compiles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, self.kv_caches, meta, self.backend)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only batch of at most max_batch rows."""
        ids, _, _ = self.fill(input_ids, positions, meta)
        graph, out = self.graphs[ids.shape[0]]
        graph.replay()
        return out[:meta.num_seqs]

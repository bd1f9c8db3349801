"""Vectorised sampling over the batch: logit_bias, min_tokens, repetition/presence/frequency penalties,
temperature, min-p, top-k, top-p, seeds, logprobs.

The order is vLLM's: logit_bias and min_tokens, then penalties, then temperature, min-p and
top-k/top-p. Logprobs are those of the model's raw distribution. Every per-request tensor is built
on the logits' device; a processing stage that no request of the batch uses costs nothing.

A seeded request draws its noise from its own generator, seeded for each token from (seed, the
token's position in the output) by ``position_seed``, so its tokens are the same whatever batch it
runs in, and a continuation on another engine (failover) draws what the first engine would have.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.engine.sequence import Sequence
from kernels.cpu_ops_build import cpu_ops_loaded
from shared.protocol import TokenLogprob


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.eos_token_ids = list(eos_token_ids)     # held back, with stop_token_ids, by min_tokens

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: fp32 [B, V], one row per sequence in `seqs`."""
        params = [s.params for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        logits = self._apply_logit_bias(logits, seqs)
        logits = self._apply_min_tokens(logits, seqs)
        logits = self._apply_penalties(logits, seqs)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        if bool(greedy.all()):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, seqs, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, params))

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """OpenAI logit_bias: each [token id, bias] pair is added to that token's logit."""
        if not any(s.params.logit_bias for s in seqs):
            return logits
        pairs = [s.params.logit_bias for s in seqs]
        rows, ids = _flat_tokens([[int(t) for t, _ in ps] for ps in pairs], logits.device)
        bias = torch.tensor([float(b) for ps in pairs for _, b in ps], dtype=logits.dtype, device=logits.device)
        return logits.index_put((rows, ids), bias, accumulate=True)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A sequence with fewer than min_tokens outputs cannot sample EOS or its stop token ids."""
        held = [self._stop_ids(s.params) if s.num_output_tokens < s.params.min_tokens else [] for s in seqs]
        if not any(held):
            return logits
        rows, ids = _flat_tokens(held, logits.device)
        return logits.index_put((rows, ids), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))

    def _stop_ids(self, p) -> list[int]:
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Repetition penalty (HF/vLLM: tokens in the prompt or output get positive logits divided by
        it, negative ones multiplied), then presence/frequency penalties (output tokens only)."""
        params = [s.params for s in seqs]
        rep = any(p.repetition_penalty != 1.0 for p in params)
        additive = any(p.presence_penalty or p.frequency_penalty for p in params)
        if not rep and not additive:
            return logits
        dev = logits.device
        if rep:
            rows, ids = _flat_tokens([s.token_ids for s in seqs], dev)
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[rows, ids] = True
            pen = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        if additive:
            rows, ids = _flat_tokens([s.output_token_ids for s in seqs], dev)
            counts = torch.zeros_like(logits)
            counts.index_put_((rows, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
            logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor) -> torch.Tensor:
        params, dev = [s.params for s in seqs], logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev).unsqueeze(1)
        scaled = logits / temps
        top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0 for p in params):
            scaled = _min_p(scaled, torch.tensor([p.min_p for p in params], dtype=scaled.dtype, device=dev))
        if bool((top_k < logits.shape[1]).any() or (top_p < 1).any()):
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                seq.generator.manual_seed(position_seed(seq.params.seed, seq.output_position))
                noise[row].exponential_(generator=seq.generator)
        sampled = argmax_rows(probs / noise)
        return torch.where(greedy, argmax_rows(logits), sampled)

    @staticmethod
    def score(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """Prompt logprobs: row i's log-probability of targets[i], its rank, and the top k."""
        lp = torch.log_softmax(logits, dim=-1)
        ids = torch.tensor(targets, device=lp.device).unsqueeze(1)
        chosen = lp.gather(1, ids)
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        chosen = chosen.squeeze(1).tolist()
        if k:
            top_vals, top_ids = (x.tolist() for x in lp.topk(k, dim=-1))
        else:
            top_vals = top_ids = [[] for _ in targets]
        return [TokenLogprob(t, c, list(zip(ti, tv)), r)
                for t, c, r, ti, tv in zip(targets, chosen, ranks, top_ids, top_vals)]

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], params) -> list[TokenLogprob | None]:
        if raw is None:
            return [None] * len(tokens)
        k = max(p.logprobs or 0 for p in params)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
        out = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = list(zip(top_ids[row, :p.logprobs].tolist(), top_vals[row, :p.logprobs].tolist())) if p.logprobs else []
            out.append(TokenLogprob(tokens[row], chosen[row], top))
        return out


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask every token whose probability is below min_p times the row's most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
_MASK64 = (1 << 64) - 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [B, V] tensor. fp32 on the CPU takes the extension's
    kaiten_cpu::argmax_rows: ATen's compares an element at a time (2.0 ms for 32 rows of 49152 on
    2 threads of a Xeon, where the extension takes 0.2; bench/kernels/argmax_rows.py)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_ops_loaded():
        return torch.ops.kaiten_cpu.argmax_rows(x)
    return x.argmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position` (0-based) of a seeded request's output:
    splitmix64 of the seed advanced `position + 1` steps, as a non-negative 63-bit int."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (one sort per batch)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    mask = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _flat_tokens(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, as two flat tensors (one copy each)."""
    lens = torch.tensor([len(t) for t in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lens)
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    return rows.to(device), ids.to(device)

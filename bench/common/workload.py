"""The offline workload the engine benchmarks share: random-id prompts and fixed output lengths.

Standard library only, so a peer's virtualenv (bench/peers/peer_offline.py runs vLLM in its own) can
import it too.
"""
from __future__ import annotations

import random


def workload(n: int, vocab: int, seed: int = 0, prompt_lens: tuple[int, int] = (32, 512),
             output_lens: tuple[int, int] = (16, 256)) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs, lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
            for _ in range(n)]

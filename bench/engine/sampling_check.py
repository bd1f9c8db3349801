"""Non-greedy sampling on a device: every sampling parameter at once, in one batch with greedy rows.

    python bench/engine/sampling_check.py --device cuda [--model DIR]

A per-request tensor built on the wrong device fails the step, so this runs temperature > 0 with
top-k, top-p, min-p, the penalties, logit_bias, min_tokens, seeds and logprobs, and checks that a
seeded request gives the same tokens alone and in a mixed batch, that logit_bias +100 forces its
token and that min_p 1.0 is greedy. Exits non-zero on a failure. gpu_check.sh runs it on CUDA.
"""
from __future__ import annotations

import argparse
import sys

from engine_worker import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (CPU: no torch.compile)")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_memory="1GiB",
              enforce_eager=args.enforce_eager)
    everything = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=0.3, logit_bias=[[13, 2.0]],
                                min_tokens=4, max_tokens=24, seed=1234, logprobs=5)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    forced_id = llm.encode(" the")[0]
    forced = SamplingParams(temperature=1.0, max_tokens=8, logit_bias=[[forced_id, 100]], seed=7)
    min_p_one = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=24, seed=9)

    alone = llm.generate([PROMPTS[0]], everything)[0]
    batch = llm.generate(PROMPTS + PROMPTS[:3], [everything, greedy, forced, min_p_one, greedy,
                                                 SamplingParams(temperature=1.2, max_tokens=24), everything])
    greedy_ref = llm.generate([PROMPTS[3]], greedy)[0]
    checks = {
        "seeded request: same tokens alone and in a mixed batch": batch[0].token_ids == alone.token_ids,
        "min_tokens: at least 4 tokens": len(alone.token_ids) >= 4,
        "logprobs: one per token, top 5": len(alone.logprobs) == len(alone.token_ids)
        and all(len(lp.top) == 5 for lp in alone.logprobs),
        "logit_bias +100 forces its token": batch[2].token_ids == [forced_id] * 8,
        "min_p 1.0 equals greedy": batch[3].token_ids == greedy_ref.token_ids,
        "unseeded temperature 1.2 runs": len(batch[5].token_ids) >= 1,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"sample: {alone.text!r}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

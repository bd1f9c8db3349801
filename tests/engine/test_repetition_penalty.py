"""repetition_penalty in the engine's batched sampler: HF/vLLM semantics, checked by its effect."""
from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.engine.sampler import Sampler
from engine_worker.engine.sequence import Sequence


def _seq(token_ids: list[int], num_prompt: int, params: SamplingParams) -> Sequence:
    return Sequence("r", list(token_ids), num_prompt, params)


def test_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 4.0],
                           [2.0, -2.0, 3.0, -1.0, 0.5, 4.0],
                           [2.0, -2.0, 3.0, -1.0, 0.5, 4.0]])
    seqs = [_seq([0, 1, 1], 2, SamplingParams(repetition_penalty=2.0)),     # prompt 0 1, output 1
            _seq([3, 4], 1, SamplingParams(repetition_penalty=0.5)),        # < 1 favours repeats
            _seq([0, 1, 2], 2, SamplingParams())]                           # 1.0: untouched
    out = Sampler()._apply_penalties(logits.clone(), seqs)
    assert out[0].tolist() == [1.0, -4.0, 3.0, -1.0, 0.5, 4.0]
    assert out[1].tolist() == [2.0, -2.0, 3.0, -0.5, 1.0, 4.0]
    assert out[2].tolist() == logits[2].tolist()


def test_penalty_then_presence_frequency():
    logits = torch.tensor([[2.0, -2.0, 3.0]])
    s = _seq([0, 2, 2], 1, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = Sampler()._apply_penalties(logits, [s])
    # token 0: prompt only -> 2/2; token 2: output twice -> 3/2 - 0.5 - 2*0.25
    assert out[0].tolist() == pytest.approx([1.0, -2.0, 0.5])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1.2", True])
def test_invalid_penalty(bad):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=bad).validate()


def test_greedy_with_penalty_matches_hf(tiny_model_dir):
    """Greedy decoding with repetition_penalty equals HF generate(repetition_penalty=...) token for token,
    and the penalty changes the output of a model that repeats itself."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43] * 6, [100, 9]]
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * 2**20)
    plain = [c.token_ids for c in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))]
    penalized = [c.token_ids for c in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                           repetition_penalty=1.8))]
    for p, got in zip(prompts, penalized):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=20, do_sample=False, repetition_penalty=1.8)
        assert got == ids[0, len(p):].tolist()
    assert penalized != plain
    # The greedy model repeats tokens; with the penalty it repeats fewer.
    repeats = lambda outs: sum(len(o) - len(set(o)) for o in outs)   # noqa: E731
    assert repeats(penalized) < repeats(plain)

"""min_p, min_tokens, logit_bias and stop_reason in the engine's batched sampler, checked by their effect."""
from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.engine.sampler import Sampler
from engine_worker.engine.sequence import Sequence

PROMPT = [40, 41, 42, 43, 44, 45]


def _seq(token_ids: list[int], num_prompt: int, params: SamplingParams) -> Sequence:
    return Sequence("r", list(token_ids), num_prompt, params)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")


def test_logit_bias_is_added_per_row():
    logits = torch.zeros(2, 5)
    seqs = [_seq([0], 1, SamplingParams(logit_bias=[[3, 100], [1, -2.5]])), _seq([0], 1, SamplingParams())]
    out = Sampler()._apply_logit_bias(logits, seqs)
    assert out[0].tolist() == [0, -2.5, 0, 100, 0] and out[1].tolist() == [0] * 5


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, 6)
    seqs = [_seq([0, 1], 1, SamplingParams(min_tokens=2, stop_token_ids=[4])),   # 1 output: held
            _seq([0, 1, 2], 1, SamplingParams(min_tokens=2, stop_token_ids=[4])),  # 2 outputs: free
            _seq([0], 1, SamplingParams(min_tokens=2, ignore_eos=True))]         # EOS is not a stop
    out = Sampler(eos_token_ids=[5])._apply_min_tokens(logits, seqs)
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, 0, inf, inf]
    assert out[1].tolist() == [0] * 6
    assert out[2].tolist() == [0] * 6


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seqs = [_seq([0], 1, SamplingParams(temperature=1.0, min_p=0.4))]
    for _ in range(50):
        assert Sampler()(logits, seqs).token_ids[0] in (0, 1)   # 0.15 < 0.4 * 0.5


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(min_tokens=-1),
                                 dict(min_tokens=20, max_tokens=10), dict(logit_bias=[[1, 101]]),
                                 dict(logit_bias=[[-1, 1]]), dict(logit_bias=[[1]])])
def test_invalid_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


def test_logit_bias_forces_and_bans_a_token(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias=[[77, 100]]))[0]
    assert forced.token_ids == [77] * 6
    banned = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias=[[plain[0], -100]]))[0]
    assert plain[0] not in banned.token_ids
    with pytest.raises(ValueError, match="vocabulary"):
        llm.submit(PROMPT, SamplingParams(logit_bias=[[10**6, 1]]))


def test_min_p_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    for seed in range(3):
        out = llm.generate([PROMPT], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, seed=seed))[0]
        assert out.token_ids == greedy


def test_min_tokens_holds_back_stop_token_and_stop_reason(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    stop_id = plain[0]
    first = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0]
    assert first.token_ids == [stop_id] and first.finish_reason == "stop" and first.stop_reason == stop_id
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                 stop_token_ids=[stop_id]))[0]
    assert len(held.token_ids) >= 4 and stop_id not in held.token_ids[:4]
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == stop_id and held.stop_reason == stop_id
    else:
        assert held.finish_reason == "length" and held.stop_reason is None


def test_min_tokens_holds_back_eos(llm):
    eos = llm.engine.eos_token_id
    # +100 on EOS: without min_tokens the first token is EOS, with it EOS waits its turn.
    params = dict(temperature=0, max_tokens=6, logit_bias=[[eos, 100]])
    assert llm.generate([PROMPT], SamplingParams(**params))[0].token_ids == [eos]
    out = llm.generate([PROMPT], SamplingParams(**params, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and out.token_ids[3] == eos and eos not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None


@pytest.mark.parametrize("budget", [0, 5])
def test_prompt_logprobs_match_hf(tiny_model_dir, budget):
    """Each prompt token's logprob (and rank, and top 3) equal HF's full forward, also when the
    prompt is prefilled in chunks (a 5-token budget) and when its prefix is in the cache."""
    from transformers import AutoModelForCausalLM
    kw = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", **kw)
    prompt = list(range(40, 77))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))            # fills the prefix cache
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        row = ref[i - 1]
        assert lp.token_id == prompt[i] and lp.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert lp.rank == int((row > row[prompt[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()

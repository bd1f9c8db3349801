"""Speculative decoding (n-gram prompt lookup): the engine's output is the one without it.

Greedy tokens equal HF generate's with drafts verified in mixed batches (chunked prefill, prefix
cache hits, preemption); seeded sampling draws the same tokens; and the distribution of sampled
tokens, estimated from many seeds, is the one without speculation."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine_worker import SamplingParams
from engine_worker.engine.speculative import NgramProposer, PerSequenceProposer
from shared.config import SpeculativeConfig
from tests.support.llm_support import assert_all_blocks_released, greedy, make_llm, run_staggered

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
LONG = 64
EOS = 2                    # the tiny model's


def spec_llm(model_dir, forward="compiled", **kw):
    return make_llm(model_dir, forward, speculative_config=NGRAM, **kw)


class FlatStepTimes:
    """Every step takes as long: the plan verifies every draft whose sequence is not backing off."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def predict(self, num_tokens: int) -> float:
        return 1.0


def with_proposer(llm, proposer):
    """`llm` with `proposer` for drafts, all of them verified (tests of verification, not of the plan)."""
    llm.engine.speculator.proposer = proposer
    llm.engine.speculator.step_times = FlatStepTimes()
    return llm


def assert_drafts_accepted(llm, at_least: int = 1) -> None:
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= at_least, stats


def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]     # the 3-gram's latest match
    assert p.draft([4, 8, 6, 4], 3) == [8, 6, 4]                          # falls back to a 1-gram
    assert p.draft([1, 2, 3], 3) == []                                    # no match
    assert p.draft([1, 2, 1], 0) == []


def test_ngram_proposer_matches_a_brute_force_search():
    import random
    rng = random.Random(0)
    p = NgramProposer(SpeculativeConfig(prompt_lookup_max=4, prompt_lookup_min=2))

    def brute(ids, k):
        for n in range(min(4, len(ids) - 1), 1, -1):
            ends = [e for e in range(n - 1, len(ids) - 1) if ids[e - n + 1:e + 1] == ids[-n:]]
            if ends:
                return ids[ends[-1] + 1:ends[-1] + 1 + k]
        return []
    for _ in range(500):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        assert p.draft(ids, 3) == brute(ids, 3), ids


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"), ("[1]", "JSON object"), ('{"num_speculative_tokens": 3}', "needs a 'method'"),
    ('{"method": "eagle"}', "not supported"), ('{"method": "draft_model"}', "needs a 'model'"),
    ('{"method": "ngram", "model": "m"}', "unknown keys"),
    ('{"method": "draft_model", "model": "m", "prompt_lookup_max": 2}', "unknown keys"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
    ('{"method": "ngram", "k": 2}', "unknown keys"),
    ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "exceeds")])
def test_bad_speculative_config_says_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(text)


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_greedy_matches_hf_with_speculation(tiny_model_dir, prompts, expected, forward):
    llm = spec_llm(tiny_model_dir, forward)
    assert [c.token_ids for c in llm.generate(prompts, greedy())] == expected
    assert llm.engine.speculator.stats.num_draft_tokens > 0      # a random model's output is rarely predictable
    assert llm.engine.speculator.step_times.points          # the plan's step times are measured
    assert_all_blocks_released(llm)


class OracleProposer(PerSequenceProposer):
    """Drafts from the known greedy outputs, one of them wrong on some steps: verification then
    accepts whole drafts, parts of drafts and none, across block boundaries."""

    def __init__(self, prompts, outputs):
        self.outputs = {tuple(p): o for p, o in zip(prompts, outputs)}

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        n = next(n for n in range(len(token_ids), 0, -1) if tuple(token_ids[:n]) in self.outputs)
        drafts = list(self.outputs[tuple(token_ids[:n])][len(token_ids) - n:][:k])
        wrong = len(token_ids) % 7
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 384
        return drafts


def test_long_greedy_outputs_are_identical_with_verified_drafts(tiny_model_dir, prompts):
    """Staggered admission gives mixed batches of prefills and verifications, with prefix-cache
    hits; drafts that are mostly right give accepted runs of several tokens."""
    off = [c.token_ids for c in make_llm(tiny_model_dir).generate(prompts, greedy(LONG))]
    llm = with_proposer(spec_llm(tiny_model_dir), OracleProposer(prompts, off))
    assert run_staggered(llm, prompts, greedy(LONG)) == off
    stats = llm.engine.speculator.stats
    assert stats.accepted_per_position[3] > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert llm.engine.block_manager.num_hit_tokens > 0
    assert_all_blocks_released(llm)
    again = llm.generate(prompts, greedy(LONG))     # the blocks verified drafts filled are cached right
    assert [c.token_ids for c in again] == off


class WrongProposer(PerSequenceProposer):
    """An open-ended request: every draft differs from the greedy output; counts its calls."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output, self.calls = prompt, output, 0

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        return [(self.output[len(token_ids) - len(self.prompt)] + 1) % 384] * k


def test_a_request_whose_drafts_are_rejected_stops_proposing(tiny_model_dir, prompts):
    """Two rejected verifications send a request into a back-off that doubles each time it probes
    again and fails: over 128 tokens, 8 verifications (2 probes before each back-off, of 8, 16,
    32 and 64 steps), not 127; the output is the one without speculation."""
    prompt = prompts[0]
    off = make_llm(tiny_model_dir).generate([prompt], greedy(128))[0].token_ids
    proposer = WrongProposer(prompt, off)
    llm = with_proposer(spec_llm(tiny_model_dir), proposer)
    assert llm.generate([prompt], greedy(128))[0].token_ids == off
    stats = llm.engine.speculator.stats
    assert proposer.calls == stats.num_drafts == 8 and stats.num_accepted_tokens == 0, stats
    assert llm.engine.speculator.acceptance < 0.5


def test_a_new_request_starts_from_the_engines_acceptance(tiny_model_dir, prompts):
    """Where the engine's drafts have fared badly lately, a new request backs off before its
    first proposal (a draft model would otherwise prefill its prompt for nothing)."""
    proposer = AlwaysProposer()
    llm = with_proposer(spec_llm(tiny_model_dir), proposer)
    llm.engine.speculator.acceptance = 0.1
    llm.generate([prompts[0]], greedy(8))
    assert proposer.calls == 0
    llm.engine.speculator.acceptance = 0.5
    llm.generate([prompts[0]], greedy(8))
    assert proposer.calls > 0


class AlwaysProposer(PerSequenceProposer):
    """Proposes token 0 k times, counting its calls."""

    def __init__(self):
        self.calls = 0

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        return [0] * k


REGEX = "[0-9]{3}-[a-z]{2,8}"
CHOICES = ["yes", "no"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def constrained(kind: str, value, **kw) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": 40} | kw),
                          structured_output={"kind": kind, "value": value})


def assert_valid(outs) -> None:
    """outs: the outputs of a json (SCHEMA), a regex (REGEX) and a choice (CHOICES) request."""
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, outs[1].text) and outs[2].text in CHOICES


@pytest.mark.parametrize("seeded", [False, True])
def test_constrained_outputs_are_identical_with_verified_drafts(tiny_model_dir, prompts, seeded):
    """The grammar masks every scored position (each draft's and the bonus token's): greedy and
    seeded outputs are those without speculation, whether the oracle's wrong drafts are cut by
    the grammar or rejected by verification."""
    sampling = {"temperature": 0.9, "seed": 7} if seeded else {}
    params = [constrained("json", json.dumps(SCHEMA), **sampling), constrained("regex", REGEX, **sampling),
              constrained("choice", CHOICES, **sampling)]
    off = make_llm(tiny_model_dir, "eager").generate(prompts[:3], params)
    llm = with_proposer(spec_llm(tiny_model_dir, "eager"), OracleProposer(prompts[:3], [o.token_ids for o in off]))
    on = llm.generate(prompts[:3], params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert_valid(on)
    assert_drafts_accepted(llm, at_least=4)
    assert_all_blocks_released(llm)


class RightThenInvalid(PerSequenceProposer):
    """The greedy continuation's first k - 1 tokens, then `invalid`, a token the grammar never allows."""

    def __init__(self, prompt: list[int], output: list[int], invalid: int):
        self.prompt, self.output, self.invalid = prompt, output, invalid

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        return self.output[done:done + k - 1] + [self.invalid]


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(tiny_model_dir, prompts):
    """Only the drafts before the invalid token are scored, and they are all accepted."""
    params = constrained("regex", REGEX)
    off = make_llm(tiny_model_dir, "eager").generate([prompts[0]], params)[0].token_ids
    invalid = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("Z")
    llm = with_proposer(spec_llm(tiny_model_dir, "eager"), RightThenInvalid(prompts[0], off, invalid))
    out = llm.generate([prompts[0]], params)[0]
    assert out.token_ids == off and re.fullmatch(REGEX, out.text)
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats


def test_a_draft_that_completes_the_grammar_ends_the_request(tiny_model_dir, prompts):
    """The oracle drafts the whole answer, its stop token and junk after it: the junk is cut, one
    verification accepts every draft, the stop token ends the request as without speculation."""
    params = constrained("choice", CHOICES)
    off = make_llm(tiny_model_dir, "eager").generate([prompts[0]], params)[0]
    assert off.token_ids[-1] == EOS and 2 <= len(off.token_ids) <= 5
    llm = with_proposer(spec_llm(tiny_model_dir, "eager"), RightThenInvalid(prompts[0], off.token_ids + [5] * 4, 5))
    out = llm.generate([prompts[0]], params)[0]
    assert (out.token_ids, out.finish_reason) == (off.token_ids, "stop")
    stats = llm.engine.speculator.stats
    assert stats.num_drafts == 1 and stats.num_accepted_tokens == stats.num_draft_tokens == len(off.token_ids) - 1
    assert_all_blocks_released(llm)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_matches_hf_with_speculation_and_chunked_prefill(tiny_model_dir, prompts, expected, backend):
    llm = with_proposer(spec_llm(tiny_model_dir, max_num_batched_tokens=13, attention_backend=backend),
                        OracleProposer(prompts, expected))
    assert run_staggered(llm, prompts, greedy()) == expected
    assert_drafts_accepted(llm)
    assert_all_blocks_released(llm)


def test_greedy_matches_hf_with_speculation_under_preemption(tiny_model_dir, prompts, expected):
    cfg_bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = spec_llm(tiny_model_dir, kv_cache_memory=20 * cfg_bytes_per_block, max_num_batched_tokens=64)
    with_proposer(llm, OracleProposer(prompts, expected))
    assert run_staggered(llm, prompts, greedy()) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafts_accepted(llm)
    assert_all_blocks_released(llm)


def test_speculative_config_flag_is_checked_and_handed_to_the_engine(tiny_model_dir, capsys):
    from engine_worker.cli import build_parser, configs_from_args
    from engine_worker.cli import main as engine_main
    from shared.launcher import main as serve_main
    from shared.up_flags import child_args
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--speculative-config", '{"method": "eagle"}'])
    assert exit_info.value.code == 2
    assert "method 'eagle' is not supported" in capsys.readouterr().err
    assert engine_main(["--model", str(tiny_model_dir), "--speculative-config", '{"method": "ngram", "x": 1}']) == 2
    assert "unknown keys ['x']" in capsys.readouterr().err
    from shared.launcher import build_parser as serve_parser
    args = serve_parser().parse_args(["--speculative-config", NGRAM])
    assert child_args(args, "engine")[-2:] == ["--speculative-config", NGRAM]
    assert "--speculative-config" not in child_args(args, "gateway")
    ecfg, _ = configs_from_args(build_parser().parse_args(["--speculative-config", NGRAM]), resolve_model=False)
    assert ecfg.speculative() == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny_model_dir, prompts):
    """Each output position's noise is a function of (seed, position), and "sample, accept while
    equal" is rejection sampling for a point-mass draft: seeded outputs, logprobs included, are
    those without speculation (penalties, logit bias, min_tokens, top-k/top-p, stop tokens)."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=100 + i, max_tokens=LONG, logprobs=2,
                             presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1,
                             logit_bias=[[5, 3.0], [7, -2.0]], min_tokens=8, stop_token_ids=[11])
              for i in range(len(prompts))]
    off = make_llm(tiny_model_dir).generate(prompts, params)
    llm = with_proposer(spec_llm(tiny_model_dir), OracleProposer(prompts, [c.token_ids for c in off]))
    on = llm.generate(prompts, params)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert [c.finish_reason for c in on] == [c.finish_reason for c in off]
    for a, b in zip(on, off):
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert llm.engine.speculator.stats.accepted_per_position[3] > 0
    assert_all_blocks_released(llm)


class FixedDraft(PerSequenceProposer):
    """Proposes, after the first output token t0, the token `drafts[t0]`."""

    def __init__(self, prompt_len: int, drafts: dict[int, int]):
        self.prompt_len, self.drafts = prompt_len, drafts

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        return [self.drafts[token_ids[-1]]] if len(token_ids) == self.prompt_len + 1 and k else []


def test_sampled_distribution_is_unchanged_by_speculation(tiny_model_dir, hf_model):
    """The joint distribution of the first two sampled tokens (temperature 0.7, top-k 4), the
    second verified against a draft (the most likely token after the first), estimated from
    4000 unseeded draws, is the model's: total variation distance and acceptance rate within
    sampling error. Always accepting the draft, or never, is far outside both."""
    import torch
    prompt, temp, top_k, draws = [3, 17, 42, 99, 120, 7, 64, 200], 0.7, 4, 4000

    def top(ids):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1] / temp
        vals, toks = logits.topk(top_k)
        return dict(zip(toks.tolist(), torch.softmax(vals, -1).tolist()))
    first = top(prompt)
    second = {t0: top(prompt + [t0]) for t0 in first}
    exact = {(t0, t1): p0 * p1 for t0, p0 in first.items() for t1, p1 in second[t0].items()}
    drafts = {t0: max(dist, key=dist.get) for t0, dist in second.items()}
    llm = with_proposer(spec_llm(tiny_model_dir, "eager"), FixedDraft(len(prompt), drafts))
    params = SamplingParams(temperature=temp, top_k=top_k, max_tokens=3, ignore_eos=True)
    got = [tuple(c.token_ids[:2]) for c in llm.generate([prompt] * draws, params)]
    tv = 0.5 * sum(abs(got.count(pair) / draws - p) for pair, p in exact.items())
    assert set(got) <= set(exact) and tv < 0.05, (tv, exact)
    stats = llm.engine.speculator.stats
    want = sum(p0 * second[t0][drafts[t0]] for t0, p0 in first.items())
    assert stats.num_draft_tokens == draws
    assert abs(stats.num_accepted_tokens / draws - want) < 0.04, (stats, want)


def test_spec_decode_counters_reach_the_engine_metrics(tiny_model_dir, prompts):
    """Proposed, accepted and per-position counters, as vLLM's, from the engine's stats."""
    import dataclasses

    from prometheus_client import generate_latest

    from engine_worker.metrics import EngineMetrics
    llm = spec_llm(tiny_model_dir, "eager")
    llm.generate(prompts[:6], greedy())
    metrics = EngineMetrics("tiny", "e1", counters=None)
    metrics.registry.unregister(next(c for c in list(metrics.registry._collector_to_names)
                                     if type(c).__name__ == "WorkerEvents"))
    stats = dataclasses.asdict(llm.engine.stats())
    metrics.update(stats)
    metrics.update(stats)           # counters advance by what grew: not twice
    text = generate_latest(metrics.registry).decode()
    st = llm.engine.speculator.stats
    assert st.num_draft_tokens > 0
    assert f'kaiten:spec_decode_num_draft_tokens_total{{engine="e1",model_name="tiny"}} {st.num_draft_tokens}.0' in text
    assert f'kaiten:spec_decode_num_accepted_tokens_total{{engine="e1",model_name="tiny"}} {st.num_accepted_tokens}.0' in text
    assert f'kaiten:spec_decode_num_drafts_total{{engine="e1",model_name="tiny"}} {st.num_drafts}.0' in text
    assert (f'kaiten:spec_decode_num_accepted_tokens_per_pos_total{{engine="e1",model_name="tiny",position="0"}} '
            f'{st.accepted_per_position[0]}.0') in text


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory):
    """A second tiny random Llama with the same tokenizer (another seed): it rarely agrees."""
    from tests.support.tiny_model import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=7)


def draft_llm(model_dir, draft_dir, forward="eager", k=3, **kw):
    config = json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k})
    llm = make_llm(model_dir, forward, speculative_config=config, **kw)
    llm.engine.speculator.step_times = FlatStepTimes()
    return llm


def assert_draft_cache_released(llm):
    proposer = llm.engine.speculator.proposer
    proposer.sync([])
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_greedy_matches_hf_with_the_target_as_its_own_draft(tiny_model_dir, prompts, expected, forward):
    """The same model drafting agrees with itself: whole drafts are accepted, in staggered mixed
    batches with chunked prefill, and the draft's cache follows every sequence."""
    llm = draft_llm(tiny_model_dir, tiny_model_dir, forward, max_num_batched_tokens=24)
    assert run_staggered(llm, prompts, greedy()) == expected
    stats = llm.engine.speculator.stats
    assert stats.accepted_per_position[2] > 0
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    assert_all_blocks_released(llm)
    assert_draft_cache_released(llm)


def test_greedy_matches_hf_with_another_draft_model_under_preemption(tiny_model_dir, draft_model_dir,
                                                                      prompts, expected):
    cfg_bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = draft_llm(tiny_model_dir, draft_model_dir, kv_cache_memory=20 * cfg_bytes_per_block,
                    max_num_batched_tokens=64)
    assert run_staggered(llm, prompts, greedy()) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert_all_blocks_released(llm)
    assert_draft_cache_released(llm)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from tests.support.tiny_model import build_tiny_model
    other = build_tiny_model(tmp_path / "other", vocab_size=320)
    with pytest.raises(ValueError, match="must share the tokenizer"):
        draft_llm(tiny_model_dir, other)

"""One source for the sampling limits (shared/sampling_limits.py): the API's request models, the
engine's SamplingParams and a generation_config.json's defaults take and refuse the same values."""
from __future__ import annotations

import pytest

from gateway.api.api_models import ChatCompletionRequest, CompletionRequest, validate
from gateway.api.errors import APIError
from shared.generation_defaults import _from_config
from shared.sampling_limits import LIMITS, Limit, check

ENGINE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "logprobs", "prompt_logprobs", "max_tokens", "min_tokens")
DEFAULTS_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _edges(limit: Limit) -> list[float]:
    """Each bound, and a value just past it."""
    step = 1 if limit.integer else 1e-3
    out = []
    for bound, sign in ((limit.lo, -1), (limit.hi, 1)):
        if bound is not None:
            out += [bound, bound + sign * step]
    mid = (limit.lo or 0) + 0.5 if limit.hi is not None and not limit.integer else (limit.lo or 0) + 1
    return out + [type(out[0])(mid)]


def _api_ok(name: str, value) -> bool:
    model, body = CompletionRequest, {"prompt": "hi", name: value}
    if name == "top_logprobs":
        model, body = ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], name: value}
    try:
        validate(model, body)
        return True
    except APIError:
        return False


def _engine_ok(name: str, value) -> bool:
    from engine_worker.engine.sampling_params import SamplingParams
    kw = {name: value, "max_tokens": 10**6} if name == "min_tokens" else {name: value}
    try:
        SamplingParams(**kw).validate()
        return True
    except ValueError:
        return False


def _limit_ok(name: str, value) -> bool:
    try:
        check(name, value)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name", ENGINE_FIELDS)
def test_the_api_and_the_engine_take_the_same_values(name):
    for value in _edges(LIMITS[name]):
        want = _limit_ok(name, value)
        assert _engine_ok(name, value) == want, (name, value)
        if name != "max_tokens":        # the API takes 0 too: a completion's echo alone
            assert _api_ok(name, value) == want, (name, value)


@pytest.mark.parametrize("name", DEFAULTS_FIELDS)
def test_generation_config_takes_the_same_values(name):
    for value in _edges(LIMITS[name]):
        try:
            _from_config({name: value}, "generation_config.json")
            ok = True
        except ValueError as e:
            assert f"{name} has an invalid value" in str(e)
            ok = False
        assert ok == _limit_ok(name, value), (name, value)


def test_top_logprobs_and_n():
    for value in _edges(LIMITS["top_logprobs"]):
        assert _api_ok("top_logprobs", value) == _limit_ok("top_logprobs", value)
    assert not _api_ok("n", 0) and _api_ok("n", 1)


def test_check_refuses_other_types_and_says_the_range():
    for bad in (True, "0.5", float("nan"), float("inf"), None):
        with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got"):
            check("top_p", bad)
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[-1, 2147483647\], got 1.0"):
        check("top_k", 1.0)
    assert LIMITS["top_p"].bounds() == {"gt": 0.0, "le": 1.0}

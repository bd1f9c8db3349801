"""Default sampling from the model's generation_config.json (vLLM's --generation-config auto), seen
by the engine: a real gateway on a real Redis, the scripted fake engine recording what it got."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from shared import gguf_convert
from shared.generation_defaults import GenerationDefaults, load_generation_defaults
from shared.gguf_convert import CONVERTER_VERSION, MARKER, RECOMMENDED_SAMPLING, ensure_default_model
from shared.launcher import banner
from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, start_gateway

pytestmark = pytest.mark.timeout(120)

MODEL_GEN = {"eos_token_id": 2, "temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1,
             "max_new_tokens": 40}


def _model_with(tmp_path, tiny_model_dir, gen: dict):
    d = tmp_path / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, d)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def _served(redis_url, model_dir, **overrides):
    eng = FakeEngine(redis_url, model=model_dir.name).start()
    srv = start_gateway(redis_url, model_dir, **overrides)
    wait_until(lambda: srv.gw.monitor.live_engines(), 10)
    return eng, srv, httpx.Client(base_url=srv.url, timeout=30, trust_env=False)


def _params_of(eng: FakeEngine, client: httpx.Client, path: str, body: dict) -> dict:
    before = set(eng.requests)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    (rid,) = set(eng.requests) - before
    return eng.requests[rid].req.params


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_unset_fields_take_the_models_generation_config(redis_url, tiny_model_dir, tmp_path):
    model = _model_with(tmp_path, tiny_model_dir, MODEL_GEN)
    eng, srv, client = _served(redis_url, model)
    try:
        p = _params_of(eng, client, "/v1/chat/completions", CHAT)
        assert (p["temperature"], p["top_p"], p["top_k"], p["repetition_penalty"], p["max_tokens"]) == \
            (0.3, 0.8, 20, 1.1, 40)
        p = _params_of(eng, client, "/v1/chat/completions",
                       {**CHAT, "temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1, "max_tokens": 99})
        assert (p["temperature"], p["top_p"], p["top_k"], p["repetition_penalty"], p["max_tokens"]) == \
            (0, 1, -1, 1, 99)                                   # a set field wins, even above the default cap
        p = _params_of(eng, client, "/v1/completions", {"prompt": "hello"})
        assert p["temperature"] == 0.3 and p["max_tokens"] == 16   # completions keep OpenAI's 16 (< 40)
        status = client.get("/v1/status").json()["generation_defaults"]
        assert status["temperature"] == 0.3 and status["max_tokens"] == 40
        assert status["source"].endswith("generation_config.json")
    finally:
        client.close(), srv.stop(), eng.stop()


def test_generation_config_vllm_gives_the_openai_defaults(redis_url, tiny_model_dir, tmp_path):
    model = _model_with(tmp_path, tiny_model_dir, MODEL_GEN)
    eng, srv, client = _served(redis_url, model, generation_config="vllm")
    try:
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        p = eng.requests[r.json()["id"]].req.params
        assert (p["temperature"], p["top_p"], p["top_k"], p["repetition_penalty"]) == (1.0, 1.0, -1, 1.0)
        # Unset max_tokens is bounded by the remaining context (the fake engine's 512).
        assert p["max_tokens"] == 512 - r.json()["usage"]["prompt_tokens"]
    finally:
        client.close(), srv.stop(), eng.stop()


def test_load_rejects_invalid_values_and_reads_a_directory(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        load_generation_defaults(tmp_path)
    with pytest.raises(ValueError, match="neither"):
        load_generation_defaults(tmp_path, str(tmp_path / "missing"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert load_generation_defaults(tmp_path, str(other)).top_p == 0.5
    assert load_generation_defaults(tmp_path / "no-such-model") == GenerationDefaults(
        source="vllm (no generation_config.json)")


def test_an_older_default_model_conversion_is_redone(tmp_path, monkeypatch):
    """A default-model directory converted by an older converter version is converted again."""
    d = tmp_path / "SmolLM2-135M-Instruct"
    d.mkdir()
    (d / MARKER).write_text(json.dumps({"converter_version": CONVERTER_VERSION - 1, "source": "x"}))

    def build(out_dir):
        (out_dir / "generation_config.json").write_text(json.dumps(RECOMMENDED_SAMPLING))
        return {"source": "rebuilt"}

    monkeypatch.setattr(gguf_convert, "_build_default_model", build)
    assert ensure_default_model(tmp_path) == d
    marker = json.loads((d / MARKER).read_text())
    assert (marker["converter_version"], marker["source"]) == (CONVERTER_VERSION, "rebuilt")
    defaults = load_generation_defaults(d)
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.2, 0.9, 256)


def test_the_banner_shows_the_defaults_and_a_curl_without_max_tokens(tiny_model_dir, tmp_path):
    model = _model_with(tmp_path, tiny_model_dir, MODEL_GEN)
    text = banner("http://127.0.0.1:8000", model.name, load_generation_defaults(model))
    assert "temperature=0.3 top_p=0.8" in text and "max_tokens=40" in text
    assert "max_tokens" not in text.split("curl", 1)[1]

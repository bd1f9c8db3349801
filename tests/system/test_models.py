"""Several models behind one Redis (issue 24): two tiny base models of different shapes and
vocabularies (a Llama and a Qwen2), an engine worker each, and two gateways that serve both.
Each request is answered by its own model's engines (greedy tokens equal that model's offline
engine), an unknown model is a 404, /v1/models lists both, a model whose engines are gone answers
503 while the other keeps serving, and a gateway finds a model from the engines' heartbeats. The
LoRA control plane (load and unload over the models' control streams) runs against the real
engine's add_lora, under traffic."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from shared import names
from shared.models_file import load_models_file, parse_models
from tests.support.engine_support import WorkerThread, wait_until
from tests.support.gateway_support import start_gateway
from tests.support.redis_server import RedisServer
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(240)

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A second tiny model: another architecture, vocabulary and context length."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen"), arch="qwen2", seed=3, vocab_size=320,
                            max_position_embeddings=256)


def greedy(model_dir, prompt: str, max_tokens: int = 8) -> str:
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


@pytest.fixture(scope="module")
def references(tiny_model_dir, other_model_dir):
    return {tiny_model_dir.name: greedy(tiny_model_dir, PROMPT), other_model_dir.name: greedy(other_model_dir, PROMPT)}


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, other_model_dir):
    """One Redis, one engine per model, two gateways serving both models."""
    server = RedisServer().start()
    engines = {tiny_model_dir.name: WorkerThread(server.url, tiny_model_dir, "eng-llama", heartbeat_ttl=1.5).start(),
               other_model_dir.name: WorkerThread(server.url, other_model_dir, "eng-qwen", heartbeat_ttl=1.5).start()}
    gws = [start_gateway(server.url, tiny_model_dir, engine_timeout=3.0, extra_models=(str(other_model_dir),))
           for _ in range(2)]
    for g in gws:
        wait_until(lambda: all(m.view.live for m in g.gw.models.models.values()), 10, what="both models' engines")
    yield {"server": server, "engines": engines, "gws": gws}
    for g in gws:
        g.stop()
    for w in engines.values():
        w.stop()
    server.stop()


def complete(gw, model: str, prompt: str = PROMPT, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}, timeout=60, trust_env=False)


def test_each_request_is_answered_by_its_own_models_engines(deployment, references):
    for g in deployment["gws"]:
        for model, text in references.items():
            r = complete(g, model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model and r.json()["choices"][0]["text"] == text
    assert references[next(iter(references))] != list(references.values())[1]     # the models differ
    for model, w in deployment["engines"].items():
        assert w.counters.snapshot().get("requests", 0) == 2, model       # one per gateway, none of the other's


def test_models_lists_every_model_with_its_facts(deployment, tiny_model_dir, other_model_dir):
    data = httpx.get(deployment["gws"][0].url + "/v1/models", trust_env=False).json()["data"]
    cards = {c["id"]: c for c in data}
    assert set(cards) == {tiny_model_dir.name, other_model_dir.name}
    assert cards[tiny_model_dir.name]["max_model_len"] == 512 and cards[other_model_dir.name]["max_model_len"] == 256
    for model_dir in (tiny_model_dir, other_model_dir):
        c = cards[model_dir.name]
        assert (c["root"], c["parent"], c["engines"], c["owned_by"]) == (str(model_dir), None, 1, "kaiten")
    one = httpx.get(f"{deployment['gws'][1].url}/v1/models/{other_model_dir.name}", trust_env=False).json()
    assert one["id"] == other_model_dir.name and one["max_model_len"] == 256


def test_unknown_model_is_an_openai_404(deployment):
    g = deployment["gws"][0]
    r = complete(g, "no-such-model")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "no-such-model" in err["message"]
    assert httpx.get(g.url + "/v1/models/no-such-model", trust_env=False).status_code == 404
    r = httpx.post(g.url + "/tokenize", json={"model": "no-such-model", "prompt": "x"}, trust_env=False)
    assert r.status_code == 404


def test_tokenize_uses_the_named_models_tokenizer(deployment, tiny_model_dir, other_model_dir):
    from transformers import AutoTokenizer
    g = deployment["gws"][0]
    for model_dir in (tiny_model_dir, other_model_dir):
        r = httpx.post(g.url + "/tokenize", json={"model": model_dir.name, "prompt": PROMPT}, trust_env=False)
        want = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT)["input_ids"]
        assert r.status_code == 200 and r.json()["tokens"] == want and r.json()["max_model_len"] in (512, 256)


def test_a_model_whose_engines_are_gone_answers_503_while_the_other_serves(deployment, tiny_model_dir,
                                                                          other_model_dir, references):
    g = deployment["gws"][1]
    deployment["engines"][other_model_dir.name].stop()
    try:
        wait_until(lambda: not g.gw.models.get(other_model_dir.name).view.live, 10, what="the engine gone")
        r = complete(g, other_model_dir.name)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine" and int(r.headers["retry-after"]) >= 1
        ok = complete(g, tiny_model_dir.name)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == references[tiny_model_dir.name]
        cards = {c["id"]: c for c in httpx.get(g.url + "/v1/models", trust_env=False).json()["data"]}
        assert cards[other_model_dir.name]["engines"] == 0 and cards[tiny_model_dir.name]["engines"] == 1
    finally:
        w = WorkerThread(deployment["server"].url, other_model_dir, "eng-qwen", heartbeat_ttl=1.5).start()
        deployment["engines"][other_model_dir.name] = w
    wait_until(lambda: g.gw.models.get(other_model_dir.name).view.live, 10, what="the engine back")
    assert complete(g, other_model_dir.name).json()["choices"][0]["text"] == references[other_model_dir.name]


def test_a_gateway_finds_a_model_from_the_engines_heartbeats(deployment, tiny_model_dir, other_model_dir, references):
    """Configured with one model, it serves the other too: an engine announces its directory."""
    g = start_gateway(deployment["server"].url, tiny_model_dir, engine_timeout=3.0)
    try:
        wait_until(lambda: g.gw.models.get(other_model_dir.name) is not None, 20, what="the model found")
        wait_until(lambda: g.gw.models.get(other_model_dir.name).view.live, 10, what="its engine")
        r = complete(g, other_model_dir.name)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == references[other_model_dir.name]
    finally:
        g.stop()


def test_the_streams_are_per_model(deployment, tiny_model_dir, other_model_dir):
    gw = deployment["gws"][0].gw
    streams = {m.name: m.stream for m in gw.models.models.values()}
    assert streams == {tiny_model_dir.name: names.request_stream(tiny_model_dir.name),
                       other_model_dir.name: names.request_stream(other_model_dir.name)}
    for model, w in deployment["engines"].items():
        assert w.requests.model_stream == names.request_stream(model)


def test_lora_endpoints_say_when_the_engine_cannot_load_adapters(deployment, tiny_model_dir, tmp_path):
    """Before the engine has a LoRA API, a load is refused with the engine's reason (400); an
    unknown adapter cannot be unloaded (404); the base model must be named when several are served."""
    g = deployment["gws"][0]
    from engine_worker.engine.llm_engine import LLMEngine
    body = {"lora_name": "sql", "lora_path": str(tmp_path), "model": tiny_model_dir.name}
    r = httpx.post(g.url + "/v1/load_lora_adapter", json=body, timeout=90, trust_env=False)
    if not hasattr(LLMEngine, "add_lora"):
        assert r.status_code == 400 and "add_lora" in r.json()["error"]["message"], r.text
    else:
        assert r.status_code == 400, r.text       # an empty directory is no adapter
    r = httpx.post(g.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"}, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(g.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, trust_env=False)
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    r = httpx.post(g.url + "/v1/load_lora_adapter", json={"lora_name": "x"}, trust_env=False)
    assert r.status_code == 400


def test_adapter_load_and_unload_under_traffic(deployment, tiny_model_dir, tmp_path, references):
    from tests.support.tiny_model import build_lora_adapter
    g = deployment["gws"][0]
    adapter = str(build_lora_adapter(tiny_model_dir, tmp_path / "sql", seed=5))
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True,
              lora_modules=[f"sql={adapter}"])
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), lora_names=["sql"])[0].text
    del llm
    errors: list[str] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            r = complete(g, tiny_model_dir.name, max_tokens=4)
            if r.status_code != 200:
                errors.append(r.text)
    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        r = httpx.post(g.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter,
                                                               "model": tiny_model_dir.name}, timeout=90,
                       trust_env=False)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        wait_until(lambda: "sql" in g.gw.models.adapters(), 10, what="the adapter announced")
        cards = {c["id"]: c for c in httpx.get(g.url + "/v1/models", trust_env=False).json()["data"]}
        assert (cards["sql"]["parent"], cards["sql"]["root"], cards["sql"]["engines"]) == (tiny_model_dir.name,
                                                                                           adapter, 1)
        a, b = complete(g, "sql").json(), complete(g, "sql").json()
        assert a["model"] == "sql" and a["choices"][0]["text"] == b["choices"][0]["text"] == want
        assert want != references[tiny_model_dir.name]                      # the adapter changes the output
        r = httpx.post(g.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter,
                                                               "model": tiny_model_dir.name}, trust_env=False)
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = httpx.post(g.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=90, trust_env=False)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
        wait_until(lambda: "sql" not in g.gw.models.adapters(), 10, what="the adapter gone")
        assert complete(g, "sql").status_code == 404
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]


def test_models_file_is_checked(tmp_path):
    good = parse_models({"models": [{"model": "a", "engines": 2, "lora_modules": {"x": "/p"}}, {"model": "b"}]})
    assert [(m.model, m.engines, m.lora_modules) for m in good] == [("a", 2, {"x": "/p"}), ("b", 1, {})]
    for bad, what in (({"models": []}, "at least one"), ({"models": [{"engines": 1}]}, "'model' is required"),
                      ({"models": [{"model": "a", "engines": 0}]}, "at least 1"),
                      ({"models": [{"model": "a", "gpu": 1}]}, "unknown keys"),
                      ({"models": [{"model": "x/a"}, {"model": "y/a"}]}, "two models are named 'a'")):
        with pytest.raises(ValueError, match=what):
            parse_models(bad)
    path = tmp_path / "m.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_models_file(path)


def test_one_directory_served_under_two_names(tiny_model_dir, other_model_dir, tmp_path):
    """The same weights under two served names (a models file entry naming the first --model's
    directory again): each name is its own model with its own stream; the directory's name stays
    an alias of the first; a served name takes the directory's name over; equal served names are refused."""
    from gateway.core import Gateway
    from shared.config import GatewayConfig

    def registry(first: str, second: str, second_dir=tiny_model_dir):
        path = tmp_path / f"{first}-{second}.json"
        path.write_text(json.dumps({"models": [{"model": str(second_dir), "served_model_name": second}]}))
        return Gateway(GatewayConfig(model=str(tiny_model_dir), served_model_name=first, models_file=str(path))).models

    reg = registry("a", "b")
    assert [m.name for m in reg.models.values()] == ["a", "b"]
    a, b = reg.resolve("a")[0], reg.resolve("b")[0]
    assert a is not b and a.stream == names.request_stream("a") and b.stream == names.request_stream("b")
    assert reg.resolve(tiny_model_dir.name) == (a, "") and b.aliases == ("b",)
    reg = registry("a", tiny_model_dir.name, other_model_dir)
    assert reg.get(tiny_model_dir.name).model_dir == str(other_model_dir)
    assert reg.get("a").aliases == ("a",)
    with pytest.raises(ValueError, match="two models are named 'a'"):
        registry("a", "a")
    path = tmp_path / "only.json"
    path.write_text(json.dumps({"models": [{"model": str(tiny_model_dir)}]}))
    with pytest.raises(ValueError, match="names the first --model"):    # no --model for it to name
        Gateway(GatewayConfig(model="", served_model_name="x", models_file=str(path)))


def test_engine_controls_apply_in_order_and_announce_outcomes(tiny_model_dir, tmp_path):
    """The worker's side (engine_worker/control.py) on a real engine and real PEFT adapters:
    outcomes by op id with vLLM's statuses, the adapters announced, a bad adapter refused, and an
    engine without LoRA slots refusing with 400."""
    from engine_worker import LLM
    from engine_worker.control import RESULTS_KEPT, Controls
    from shared.protocol import Control
    from tests.support.tiny_model import build_lora_adapter

    a, c_dir = (str(build_lora_adapter(tiny_model_dir, tmp_path / n, seed=i)) for i, n in enumerate("ac"))
    bad = tmp_path / "bad"
    bad.mkdir()
    engine = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True).engine
    c = Controls(engine)
    c.apply([Control("1", "load_lora", "a", a), Control("2", "load_lora", "a", a),
             Control("3", "load_lora", "b", str(bad)), Control("4", "unload_lora", "zz"),
             Control("5", "load_lora", "c", c_dir), Control("6", "unload_lora", "c")])
    got = c.announce()
    assert got["adapters"] == {"a": a}
    res = got["control_results"]
    assert res["1"] == [200, ""] and res["2"][0] == 400 and "already been loaded" in res["2"][1]
    assert res["3"][0] == 400 and "adapter_config.json" in res["3"][1] and res["4"][0] == 404
    assert res["5"] == res["6"] == [200, ""]
    c.apply([Control(f"x{i}", "unload_lora", "zz") for i in range(RESULTS_KEPT)])
    assert len(c.announce()["control_results"]) == RESULTS_KEPT and "1" not in c.announce()["control_results"]
    off = Controls(LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True,
                       max_loras=0).engine)
    off.apply([Control("9", "load_lora", "a", a)])
    status, message = off.announce()["control_results"]["9"]
    assert status == 400 and "LoRA is disabled" in message and off.announce()["adapters"] == {}

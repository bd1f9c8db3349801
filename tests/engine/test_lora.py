"""LoRA adapters in the engine against Hugging Face + peft: greedy tokens must be equal, in fp32,
in batches that mix adapters and the base model; slots, the LRU, bad adapters, the prefix cache."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.engine.scheduler import Scheduler
from shared.block_hash import prefix_block_hashes
from shared.config import EngineConfig
from tests.support.tiny_model import build_lora_adapter

MAX_TOKENS = 12
# name -> (rank, target modules, extra LoraConfig arguments)
ADAPTERS = {
    "all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
    "qv": (4, ["q_proj", "v_proj"], {}),
    "mlp": (16, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: str(build_lora_adapter(tiny_model_dir, root / name, rank, targets, seed=i + 1, **kw))
            for i, (name, (rank, targets, kw)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 17, 33, 40, 9, 24, 3, 50)]


def _greedy_hf(model, prompts) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters, prompts) -> dict[str, list[list[int]]]:
    """Per adapter ("" for the base model): HF greedy generate, through peft's PeftModel."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = {"": _greedy_hf(base(), prompts)}
    for name, path in adapters.items():
        out[name] = _greedy_hf(PeftModel.from_pretrained(base(), path).eval(), prompts)
    return out


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def make_llm(model_dir, adapters: dict[str, str], forward: str = "eager", **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 * 2**20)
    return LLM(str(model_dir), dtype="float32", enforce_eager=forward == "eager",
               lora_modules=[f"{n}={p}" for n, p in adapters.items()], **kw)


def mixed(prompts) -> list[str]:
    """Each prompt's adapter: the base model and every adapter, in turn."""
    names = [""] + list(ADAPTERS)
    return [names[i % len(names)] for i in range(len(prompts))]


def test_adapters_change_the_output(expected):
    for name in ADAPTERS:
        assert expected[name] != expected[""], f"adapter {name} gives the base model's tokens"


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_mixed_batch_equals_peft(tiny_model_dir, adapters, prompts, expected, forward):
    llm = make_llm(tiny_model_dir, adapters, forward, max_loras=3)
    names = mixed(prompts)
    steps = _record_steps(llm)
    got = llm.generate(prompts, greedy(), lora_names=names)
    for i, (c, name) in enumerate(zip(got, names)):
        assert c.token_ids == expected[name][i], f"prompt {i} through {name or 'the base model'}"
    assert max(len(s - {""}) for s in steps) == 3 and any("" in s for s in steps), \
        "the batch never mixed every adapter with the base model"
    # every prompt through every adapter, in one batch again
    for name in ADAPTERS:
        got = llm.generate(prompts, greedy(), lora_names=[name] * len(prompts))
        assert [c.token_ids for c in got] == expected[name], name
    llm.engine.check_block_accounting()


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_adapter_loaded_at_run_time_allocates_slots_then(tiny_model_dir, adapters, prompts, expected, forward):
    """An engine without adapters holds no LoRA slots; the first add_lora allocates them and (in
    the compiled forward) adds the LoRA graph without recompiling the base model's."""
    from torch._dynamo.utils import counters
    llm = make_llm(tiny_model_dir, {}, forward, max_loras=2)
    assert not llm.engine.runner.model.lora_enabled
    assert [c.token_ids for c in llm.generate(prompts, greedy())] == expected[""]
    graphs = counters["stats"]["unique_graphs"]
    llm.engine.add_lora("all", adapters["all"])
    assert llm.engine.runner.model.lora_enabled
    names = ["all", ""] * (len(prompts) // 2)
    got = llm.generate(prompts, greedy(), lora_names=names)
    assert [c.token_ids for c in got] == [expected[n][i] for i, n in enumerate(names)]
    assert counters["stats"]["unique_graphs"] - graphs <= (1 if forward == "compiled" else 0)


def _record_steps(llm: LLM) -> list[set[str]]:
    """The adapters ("" for the base model) of each step's batch, recorded as the engine runs."""
    steps: list[set[str]] = []
    run = llm.engine.runner.run

    def recording(batch, *args, **kw):
        steps.append({seq.lora_name for seq in batch.seqs})
        return run(batch, *args, **kw)
    llm.engine.runner.run = recording
    return steps


def test_at_most_max_loras_adapters_per_step(tiny_model_dir, adapters, prompts, expected):
    """With one slot, requests of other adapters wait for it; every request still finishes right."""
    llm = make_llm(tiny_model_dir, adapters, max_loras=1, max_cpu_loras=3)
    steps = _record_steps(llm)
    names = mixed(prompts)
    got = llm.generate(prompts, greedy(), lora_names=names)
    assert all(len(s - {""}) <= 1 for s in steps)
    assert len({n for s in steps for n in s}) == 4
    for i, (c, name) in enumerate(zip(got, names)):
        assert c.token_ids == expected[name][i], f"prompt {i} through {name or 'the base model'}"


def test_lru_eviction_and_reload(tiny_model_dir, adapters, prompts, expected):
    llm = make_llm(tiny_model_dir, {}, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    engine.add_lora("all", adapters["all"])
    engine.add_lora("qv", adapters["qv"])                 # evicts "all" from memory
    assert list(engine.loras.cpu) == ["qv"] and engine.lora_adapters() == {"all": adapters["all"], "qv": adapters["qv"]}
    loads = engine.loras.num_loads
    got = llm.generate(prompts[:3], greedy(), lora_names=["all"] * 3)
    assert engine.loras.num_loads == loads + 1            # read again from its directory
    assert [c.token_ids for c in got] == expected["all"][:3]
    assert list(engine.loras.cpu) == ["all"]
    got = llm.generate(prompts[:3], greedy(), lora_names=["qv"] * 3)
    assert [c.token_ids for c in got] == expected["qv"][:3]


def test_unknown_adapter_and_removal(tiny_model_dir, adapters, prompts, expected):
    llm = make_llm(tiny_model_dir, adapters)
    engine = llm.engine
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("r", prompts[0], greedy(), lora_name="nope")
    # removed while a request uses it: that request finishes through it, new ones are refused
    rid = llm.submit(prompts[1], greedy(), lora_name="qv")
    tokens = [t for out in llm.step() if out.request_id == rid for t in out.new_token_ids]
    assert engine.remove_lora("qv") and not engine.remove_lora("qv")
    assert "qv" not in engine.lora_adapters()
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        engine.add_request("r2", prompts[0], greedy(), lora_name="qv")
    while engine.has_unfinished():
        tokens += [t for out in llm.step() if out.request_id == rid for t in out.new_token_ids]
    assert tokens == expected["qv"][1]
    assert "qv" not in engine.loras.retiring and "qv" not in engine.loras.slots
    engine.add_lora("qv", adapters["qv"])                 # the name is free again
    assert llm.generate(prompts[:1], greedy(), lora_names=["qv"])[0].token_ids == expected["qv"][0]


def test_prefix_cache_not_shared_across_adapters(tiny_model_dir, adapters, prompts, expected):
    llm = make_llm(tiny_model_dir, adapters)
    prompt = prompts[-1]                                  # 50 tokens: 3 full blocks of 16
    runs = []
    for name in ("", "all", "qv", "all", ""):
        c = llm.generate([prompt], greedy(), lora_names=[name])[0]
        runs.append((name, c.num_cached_tokens))
        assert c.token_ids == expected[name][-1], name
    assert runs == [("", 0), ("all", 0), ("qv", 0), ("all", 48), ("", 48)]
    cached = set(llm.engine.cached_block_hashes())
    for name in ("", "all", "qv"):
        assert set(prefix_block_hashes(prompt, 16, lora_name=name)) <= cached
    llm.engine.remove_lora("all")                         # its blocks go with it
    assert not set(prefix_block_hashes(prompt, 16, lora_name="all")) & set(llm.engine.cached_block_hashes())
    llm.engine.check_block_accounting()


def _edit_config(path, **changes) -> None:
    file = path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_bad_adapters_are_refused_clearly(tiny_model_dir, tmp_path):
    import transformers
    llm = make_llm(tiny_model_dir, {}, max_lora_rank=8)
    add = llm.engine.add_lora
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        add("big", str(build_lora_adapter(tiny_model_dir, tmp_path / "big", rank=16)))
    with pytest.raises(ValueError, match="target modules .*lm_head.* not supported"):
        add("head", str(build_lora_adapter(tiny_model_dir, tmp_path / "head", targets=["q_proj", "lm_head"])))
    emb = build_lora_adapter(tiny_model_dir, tmp_path / "emb", targets=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="not supported"):
        add("emb", str(emb))
    _edit_config(emb, target_modules=["q_proj"])          # the config hides it; the weights do not
    with pytest.raises(ValueError, match="embed_tokens.* targets a module that is not supported"):
        add("emb", str(emb))
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    with pytest.raises(ValueError, match="another base model"):
        add("other", str(build_lora_adapter(None, tmp_path / "other", base_model=other)))
    dora = build_lora_adapter(tiny_model_dir, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="DoRA not supported"):
        add("dora", str(dora))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        add("missing", str(tmp_path / "missing"))
    good = str(build_lora_adapter(tiny_model_dir, tmp_path / "good", rank=8))
    add("good", good)
    with pytest.raises(ValueError, match="already loaded"):
        add("good", good)
    assert llm.engine.lora_adapters() == {"good": good}


def test_lora_disabled(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=8 * 2**20, max_loras=0)
    assert llm.engine.runner.model.layers[0].self_attn.lora is None
    with pytest.raises(ValueError, match="LoRA is disabled"):
        llm.engine.add_lora("all", adapters["all"])
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.submit([5, 6, 7], greedy(), lora_name="all")
    with pytest.raises(ValueError, match="needs LoRA slots"):
        make_llm(tiny_model_dir, adapters, max_loras=0)


def test_lora_config_and_flags(monkeypatch):
    from engine_worker.cli import build_parser, configs_from_args
    args = build_parser().parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-cpu-loras", "5",
                                      "--max-lora-rank", "32"])
    cfg, _ = configs_from_args(args, resolve_model=False)
    assert (cfg.lora_module_paths(), cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank) == \
        ({"a": "/x", "b": "/y"}, 2, 5, 32)
    monkeypatch.setenv("KAITEN_LORA_MODULES", "c=/z,d=/w")
    monkeypatch.setenv("KAITEN_MAX_CPU_LORAS", "7")
    env = EngineConfig.from_env()
    assert env.lora_module_paths() == {"c": "/z", "d": "/w"} and env.max_cpu_loras == 7
    import argparse
    from shared.up_flags import add_child_flags, child_args
    serve = argparse.ArgumentParser()
    add_child_flags(serve)
    given = serve.parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "8"])
    assert child_args(given, "engine") == ["--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "8"]
    assert child_args(given, "gateway") == []
    for bad in (["nameonly"], ["=/p"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            EngineConfig(lora_modules=bad).lora_module_paths()


def test_scheduler_lets_others_pass_a_waiting_adapter():
    """Requests of an adapter without a slot wait in order; base requests and requests of the
    running adapter go ahead of them."""
    from engine_worker.engine.block_manager import BlockManager
    from engine_worker.engine.sequence import Sequence
    sched = Scheduler(BlockManager(64, 16), 1024, 16, max_loras=1)
    seqs = [Sequence(str(i), [1, 2, 3], 3, greedy(), lora_name=n) for i, n in enumerate(["a", "b", "", "a", "b"])]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["0", "2", "3"]
    assert [s.request_id for s in sched.waiting] == ["1", "4"]
    for s in list(sched.running):
        if s.lora_name == "a":
            sched.finish(s, "stop")
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["2", "1", "4"] and not sched.waiting


@pytest.mark.parametrize("slots", [[0, 1, 2, 3] * 8, [2] * 20 + [0] * 3 + [-1] * 5 + [3] * 4,
                                   [1] * 40 + [0, 2, -1], [-1, 1, -1, 1], [-1] * 5])
def test_lora_add_layouts_equal_per_token(slots):
    """Both layouts (even runs padded for bmm, uneven runs per slot) and the C++ kernel add
    x A_s B_s per token, each part of a fused projection (here three, of 40, 12 and 12 outputs)
    through its own rank columns."""
    import numpy as np
    from engine_worker.model.lora_layers import LoraBatch, lora_add_
    from kernels.cpu_ops_build import cpu_ops_available
    torch.manual_seed(0)
    slots = np.array(slots)
    x, y = torch.randn(len(slots), 40), torch.randn(len(slots), 64)
    a, b = torch.randn(4, 40, 9), torch.randn(4, 3, 64)
    block = torch.zeros(4, 9, 64)                    # B as one block-diagonal matrix
    for i, (lo, hi) in enumerate([(0, 40), (40, 52), (52, 64)]):
        block[:, 3 * i:3 * i + 3, lo:hi] = b[:, :, lo:hi]
    want = torch.stack([y[i] + (x[i] @ a[s] @ block[s] if s >= 0 else 0) for i, s in enumerate(slots)])
    if cpu_ops_available():
        segmented = LoraBatch.build(slots, 4, torch.device("cpu"), padded=False)
        got = y.clone()
        torch.ops.kaiten_cpu.lora_add_(got, x, a, b, [40, 12, 12], segmented.token_index, segmented.bounds)
        torch.testing.assert_close(got, want)
    batch = LoraBatch.build(slots, 4, torch.device("cpu"))
    got = y.clone()
    lora_add_(got, x, a, b, [40, 12, 12], *batch.args())
    torch.testing.assert_close(got, want)
    padded = bool(batch.pad_index.numel())
    assert padded == (list(slots) in ([0, 1, 2, 3] * 8, [-1, 1, -1, 1]))

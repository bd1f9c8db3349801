"""The default model: SmolLM2-135M-Instruct converted from its GGUF by shared.gguf_convert.

The slow tests convert into the real models cache (``shared.config.default_models_dir()``), so the
first run downloads and converts (about half a minute) and every later run is instant. The fast
tests check the cache/lock logic with a stand-in build function.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared import gguf_convert
from shared.gguf_convert import MARKER, _ensure_dir, ensure_default_model
from tests.support.paths import ROOT


# --------------------------------------------------------------------------- fast: cache and lock

def _counting_build(log: Path, delay: float = 0.0):
    def build(tmp: Path):
        import time
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        (tmp / "config.json").write_text("{}")
        return {"built_by": os.getpid()}
    return build


def test_ensure_dir_builds_once_and_caches(tmp_path):
    target, log = tmp_path / "models" / "M", tmp_path / "log"
    assert _ensure_dir(target, _counting_build(log)) == target
    assert _ensure_dir(target, _counting_build(log)) == target
    assert log.read_text().count("\n") == 1
    assert (target / "config.json").is_file()
    assert json.loads((target / MARKER).read_text())["built_by"] == os.getpid()
    assert sorted(p.name for p in target.parent.iterdir()) == [".M.lock", "M"]


def test_ensure_dir_failure_leaves_nothing_and_sweeps_leftovers(tmp_path):
    target = tmp_path / "M"

    def broken(tmp):
        (tmp / "half-written").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _ensure_dir(target, broken)
    assert not target.exists()
    # Leftovers of a killed build and an incomplete target (no marker) are replaced.
    (tmp_path / ".M.tmp-dead").mkdir()
    target.mkdir()
    (target / "junk").write_text("x")
    _ensure_dir(target, _counting_build(tmp_path / "log"))
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "config.json"]
    assert not list(tmp_path.glob(".M.tmp-*"))


def test_ensure_dir_two_processes_build_once(tmp_path):
    target, log = tmp_path / "models" / "M", tmp_path / "log"
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from tests.engine.test_default_model import _counting_build
        from shared.gguf_convert import _ensure_dir
        print(_ensure_dir(Path({str(target)!r}), _counting_build(Path({str(log)!r}), delay=1.0)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [str(target)] * 3
    assert log.read_text().count("\n") == 1
    assert (target / MARKER).is_file()


def test_ensure_default_model_fast_path_imports_nothing_heavy(tmp_path):
    target = tmp_path / gguf_convert.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / MARKER).write_text(json.dumps({"converter_version": gguf_convert.CONVERTER_VERSION}))
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from shared.gguf_convert import ensure_default_model
        print(ensure_default_model({str(tmp_path)!r}))
        heavy = [m for m in ("gguf", "torch", "numpy", "transformers", "tokenizers") if m in sys.modules]
        assert not heavy, heavy
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(target)


def test_unpermute_inverts_llama_cpp_permute():
    import numpy as np

    from shared.gguf_weights import unpermute_qk
    n_heads, head_dim, d_in = 3, 8, 5
    w = np.arange(n_heads * head_dim * d_in, dtype=np.float32).reshape(n_heads * head_dim, d_in)
    # llama.cpp's convert_hf_to_gguf.py permute (HF half-split rotary -> interleaved pairs).
    permuted = w.reshape(n_heads, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), w)


# --------------------------------------------------------------------------- slow: the real model

@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
def test_default_model_directory(model_dir):
    from shared.config import default_models_dir
    assert model_dir == default_models_dir() / "SmolLM2-135M-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", MARKER):
        assert (model_dir / name).is_file(), name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["model_max_length"] == 8192
    assert "<|im_start|>" in tcfg["chat_template"]
    # <|im_end|>, and what llama.cpp also stops on: <|endoftext|>, <repo_name> (fill-in-the-middle)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0, 4]

    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and len(keys) == 2 + 30 * 9
        emb = f.get_tensor("model.embed_tokens.weight")
    assert str(emb.dtype) == "torch.bfloat16" and tuple(emb.shape) == (49152, 576)

    # Idempotent, and the CLI prints the same directory.
    assert ensure_default_model() == model_dir
    out = subprocess.run([sys.executable, "-m", "shared.cli", "convert"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(model_dir)


@pytest.mark.slow
def test_default_model_tokenizer(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.model_max_length == 8192
    for text in ["Hello world! How are you today?", "Émilie aime le café à Noël, ça va ?",
                 "東京は日本の首都です。", "emoji 🙂👍🏽 and ✓", "  two spaces\n\ttab 12345 x"]:
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert tokenizer.decode(ids) == text, (text, ids)
    assert tokenizer.encode("Hello world!") == [19556, 905, 17]
    # Special tokens are single ids, never split; digits are split one by one (SmolLM pre-tokenizer).
    ids = tokenizer.encode("<|im_start|>user\nhi 2024<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tokenizer.convert_ids_to_tokens(ids[-6:-2]) == ["2", "0", "2", "4"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi 2024"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_answers_paris_with_transformers(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.float()   # exact widening; CPUs without bf16 instructions run float32 much faster
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print("answer:", repr(answer))
    assert "Paris" in answer, answer

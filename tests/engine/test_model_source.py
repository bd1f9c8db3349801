"""`--model` resolution (shared/model_source.py): a directory, a GGUF file, a repo id in the local
Hugging Face cache, and the error that names every place looked at.

The GGUF is written from the tiny random Llama by tests/support/gguf_files.py, with the `gguf`
package, the way llama.cpp's converter writes one: llama.* metadata, a gpt2-style tokenizer, q/k
rows permuted.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.gguf_convert import MARKER
from shared.model_source import ModelNotFoundError, UnservableModelError, hf_hub_cache, resolve_model
from tests.support.gguf_files import write_llama_gguf
from tests.support.paths import ROOT
from tests.support.tiny_model import CHAT_TEMPLATE

PY = sys.executable


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    return write_llama_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture
def no_hf_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_model_directory(tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir), tmp_path) == tiny_model_dir.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"), tmp_path)


def test_a_gguf_file_is_converted_once(tiny_model_dir, tiny_gguf, tmp_path):
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    models = tmp_path / "models"
    out = resolve_model(str(tiny_gguf), models)
    assert out == models / "tiny-llama.F32"
    marker = json.loads((out / MARKER).read_text())
    assert marker["source"] == str(tiny_gguf) and marker["size"] == tiny_gguf.stat().st_size
    # The weights are the original's (an F32 file: fp32, exactly), q/k rows back in HF's order; the
    # tokenizer encodes alike.
    want, got = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    a, b = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("The quick brown fox. Paris is the capital of France.", "<|im_start|>user\nHi 0123<|im_end|>",
                 "Émilie aime le café 🙂"):
        assert a.encode(text).ids == b.encode(text).ids, text
    cfg = json.loads((out / "config.json").read_text())
    orig = json.loads((tiny_model_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[key] == orig[key], key
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE

    # Once: a second resolution finds the marker; a changed file is converted again.
    stamp = (out / MARKER).stat().st_mtime_ns
    assert resolve_model(str(tiny_gguf), models) == out and (out / MARKER).stat().st_mtime_ns == stamp
    changed = tmp_path / "tiny-llama.F32.gguf"
    shutil.copy(tiny_gguf, changed)
    assert resolve_model(str(changed), models) == out
    assert json.loads((out / MARKER).read_text())["source"] == str(changed)


def test_llama3_pre_tokenizer(tiny_model_dir, tmp_path):
    from tokenizers import Tokenizer

    gguf_file = write_llama_gguf(tiny_model_dir, tmp_path / "l3.gguf", pre="llama-bpe")
    out = resolve_model(str(gguf_file), tmp_path / "models")
    pre = Tokenizer.from_file(str(out / "tokenizer.json")).pre_tokenizer
    # Llama 3 splits numbers in runs of three and keeps the space with the next word.
    assert [p for p, _ in pre.pre_tokenize_str("I'm 12345 ok")] == ["I", "'m", "Ġ", "123", "45", "Ġok"]


def _mamba_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


UNSUPPORTED = "unsupported GGUF architecture 'mamba'; supported: gemma3, llama, phi3, qwen2, qwen3, smollm3"


def test_other_gguf_architectures_get_a_clear_error(tmp_path):
    with pytest.raises(UnservableModelError, match=UNSUPPORTED):
        resolve_model(str(_mamba_gguf(tmp_path / "m.gguf")), tmp_path / "models")
    assert not (tmp_path / "models" / "m").exists()


def test_a_gguf_file_that_cannot_be_served_is_one_line_and_exit_2(tiny_gguf, tmp_path):
    """An unknown architecture, a file cut short in its tensors or in its header: each command
    prints why on one line (the only one, at log level WARNING) and exits 2, with no traceback."""
    data = tiny_gguf.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:len(data) // 2])
    (tmp_path / "header.gguf").write_bytes(data[:4000])
    mamba = _mamba_gguf(tmp_path / "mamba.gguf")
    env = {**os.environ, "KAITEN_LOG_LEVEL": "WARNING", "KAITEN_MODEL": ""}
    models = ["--models-dir", str(tmp_path / "models")]
    for cmd, why in ((["convert", str(mamba), *models], UNSUPPORTED),
                     (["convert", str(tmp_path / "short.gguf"), *models], "short.gguf is not a complete GGUF file"),
                     (["convert", str(tmp_path / "header.gguf"), *models], "header.gguf is not a complete GGUF file"),
                     (["convert", "--gguf", str(tmp_path / "short.gguf"), "--out", str(tmp_path / "out")],
                      "short.gguf is not a complete GGUF file"),
                     (["engine", "--model", str(mamba)], UNSUPPORTED),
                     (["generate", "--model", str(mamba), "hi"], UNSUPPORTED)):
        out = subprocess.run([PY, "-m", "shared.cli", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, (cmd, out.stderr[-2000:])
        assert "Traceback" not in out.stderr, (cmd, out.stderr[-2000:])
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith(f"kaiten {cmd[0]}: ") and why in line, (cmd, out.stderr)
        if cmd[0] == "convert":
            assert out.stderr.count("\n") == 1, (cmd, out.stderr)


def _fake_hf_cache(hub: Path, repo_id: str, files: dict[str, Path], with_ref: bool = True) -> Path:
    """huggingface_hub's layout: blobs/, snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/main."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, (name, src) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(src, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if with_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_repo_id_in_the_hf_cache(tiny_model_dir, tiny_gguf, tmp_path, no_hf_env, monkeypatch):
    hub = tmp_path / "hub"
    snapshot = _fake_hf_cache(hub, "org/tiny", {p.name: p for p in tiny_model_dir.iterdir() if p.is_file()})
    assert hf_hub_cache() == hub
    assert resolve_model("org/tiny", tmp_path / "models") == snapshot
    # HF_HOME/hub when HF_HUB_CACHE is unset; a snapshot without refs/main is still found.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    snapshot2 = _fake_hf_cache(tmp_path / "hfhome" / "hub", "tiny", {"config.json": tiny_model_dir / "config.json"},
                               with_ref=False)
    assert resolve_model("tiny", tmp_path / "models") == snapshot2
    # A repo holding one GGUF file (and no config.json) is converted like the file.
    _fake_hf_cache(tmp_path / "hfhome" / "hub", "org/tiny-GGUF", {"tiny.F32.gguf": tiny_gguf})
    out = resolve_model("org/tiny-GGUF", tmp_path / "models")
    assert out == tmp_path / "models" / "tiny.F32" and (out / "model.safetensors").is_file()


def test_not_found_names_every_place_looked(tmp_path, no_hf_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("someorg/some-model", tmp_path / "models")
    text = str(e.value)
    assert str(tmp_path / "someorg" / "some-model") in text
    assert str(tmp_path / "hub" / "models--someorg--some-model") in text
    assert "HF_HUB_CACHE" in text
    # A path-like name is not looked up in the cache.
    with pytest.raises(ModelNotFoundError, match="no such directory or file") as e:
        resolve_model("./nowhere", tmp_path / "models")
    assert "Hugging Face" not in str(e.value)


def test_every_command_reports_a_missing_model(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "KAITEN_MODEL": ""}
    for cmd in (["serve", "nobody/nothing", "--port", "0"], ["engine", "--model", "nobody/nothing"],
                ["gateway", "--model", "nobody/nothing"], ["tokenizer", "--model", "nobody/nothing"],
                ["generate", "--model", "nobody/nothing", "hi"], ["convert", "nobody/nothing"]):
        out = subprocess.run([PY, "-m", "shared.cli", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, (cmd, out.stderr[-2000:])
        assert f"kaiten {cmd[0]}: model 'nobody/nothing' not found; looked for" in out.stderr, (cmd, out.stderr)
        assert str(tmp_path / "hub" / "models--nobody--nothing") in out.stderr, cmd
        assert "Traceback" not in out.stderr, cmd


def test_the_engine_runs_a_gguf_file(tiny_gguf, tmp_path, monkeypatch, caplog):
    from engine_worker import LLM, SamplingParams

    monkeypatch.setenv("KAITEN_MODELS_DIR", str(tmp_path / "models"))
    with caplog.at_level("INFO", logger="kaiten.convert"):
        llm = LLM(str(tiny_gguf), dtype="float32", enforce_eager=True)
    assert llm.engine.config.model == str(tmp_path / "models" / "tiny-llama.F32")
    assert any("converting" in r.getMessage() for r in caplog.records)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4


def test_gguf_conversion_needs_no_torch(tiny_gguf, tmp_path):
    """The slim image (no torch) converts GGUF files: model-init runs there. (The tokenizer is built
    with transformers' GGUF tokenizer code, which the slim image has and which imports no torch.)"""
    code = (f"import sys; from shared.model_source import resolve_model; "
            f"print(resolve_model({str(tiny_gguf)!r}, {str(tmp_path / 'models')!r})); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'safetensors'}}))")
    out = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [str(tmp_path / "models" / "tiny-llama.F32"), "[]"]


def test_every_command_refuses_a_model_it_cannot_serve(tiny_model_dir, tmp_path):
    """An architecture outside the registry, and a supported one with a rope type the engine does
    not run: one line that says why (naming what is supported), exit code 2, no traceback."""
    from shared.model_families import supported_architectures
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    dynamic = tmp_path / "dynamic"
    shutil.copytree(tiny_model_dir, dynamic)
    (dynamic / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KAITEN_MODEL": ""}
    cases = [(cmd, gpt2, f"architecture GPT2LMHeadModel is not supported; supported: {', '.join(supported_architectures())}")
             for cmd in (["serve", str(gpt2), "--port", "0"], ["engine", "--model", str(gpt2)],
                         ["gateway", "--model", str(gpt2)], ["tokenizer", "--model", str(gpt2)],
                         ["generate", "--model", str(gpt2), "hi"], ["convert", str(gpt2)])]
    cases += [(cmd, dynamic, "rope type 'dynamic' is not supported")
              for cmd in (["engine", "--model", str(dynamic), "--enforce-eager"],
                          ["generate", "--model", str(dynamic), "hi"])]
    for cmd, model, message in cases:
        out = subprocess.run([PY, "-m", "shared.cli", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 2, (cmd, out.stderr[-2000:])
        assert message in out.stderr and f"kaiten {cmd[0]}: " in out.stderr, (cmd, out.stderr[-2000:])
        assert "Traceback" not in out.stderr, cmd

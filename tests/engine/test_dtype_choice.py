"""--dtype auto on the CPU: the faster of bf16 and fp32 by a measured GEMM rate, measured once per
machine and kept in a cache file; explicit dtypes are taken as given."""
from __future__ import annotations

import json

import pytest
import torch

from engine_worker.model import dtype_choice
from engine_worker.model.dtype_choice import GemmRates, cpu_auto_dtype, faster_dtype
from engine_worker.model.model_runner import gemm_shapes, resolve_dtype
from engine_worker.model.config import ModelConfig


@pytest.mark.parametrize("bf16,fp32,want", [(120.0, 60.0, torch.bfloat16), (8.0, 60.0, torch.float32),
                                            (60.0, 60.0, torch.float32)])
def test_faster_dtype_on_given_rates(bf16, fp32, want):
    assert faster_dtype(GemmRates(bf16=bf16, fp32=fp32)) is want


def test_rates_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch, caplog):
    calls = []

    def fake_measure(shapes):
        calls.append(shapes)
        return GemmRates(bf16=10.0, fp32=40.0)
    monkeypatch.setattr(dtype_choice, "measure_rates", fake_measure)
    path = tmp_path / "kaiten" / "gemm_rate_cache.json"
    shapes = ((96, 64), (64, 64))
    with caplog.at_level("INFO", logger=dtype_choice.__name__):
        assert cpu_auto_dtype(shapes, path) is torch.float32
        assert cpu_auto_dtype(shapes, path) is torch.float32
    assert calls == [shapes]
    assert "bf16 10.0, fp32 40.0 GFLOP/s" in caplog.text and "cached in" in caplog.text
    cache = json.loads(path.read_text())
    assert list(cache.values()) == [{"bf16": 10.0, "fp32": 40.0}]
    cpu_auto_dtype(((128, 64),), path)              # other shapes: measured on their own
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2
    path.write_text("{not json")                    # a damaged cache is measured again and rewritten
    assert cpu_auto_dtype(shapes, path) is torch.float32 and len(calls) == 3
    assert len(json.loads(path.read_text())) == 1


def test_cache_lives_under_the_users_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dtype_choice.cache_path() == tmp_path / "kaiten" / "gemm_rate_cache.json"


def test_measured_rates_are_real_and_auto_resolves_through_them(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rates = dtype_choice.measure_rates(((64, 32), (32, 64)))      # on one thread, then back to 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert rates.bf16 > 0 and rates.fp32 > 0
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_dtype("auto", torch.device("cpu"), ((64, 32),)) in (torch.bfloat16, torch.float32)
    assert (tmp_path / "kaiten" / "gemm_rate_cache.json").is_file()


def test_explicit_dtypes_and_cuda_measure_nothing(monkeypatch):
    monkeypatch.setattr(dtype_choice, "measure_rates", lambda shapes: pytest.fail("measured"))
    assert resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", torch.device("cpu"))


def test_projection_shapes_of_a_model(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)     # hidden 64, 4 heads of 16, 2 kv heads, intermediate 128
    assert gemm_shapes(cfg) == ((128, 64), (64, 64), (256, 64), (64, 128))

"""engine_worker/model/host_memory.py: the CPU KV cache on transparent huge pages."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_worker.model.host_memory import zeros_on_huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_huge_pages_are_aligned_zeros(dtype):
    shape = (400, 16, 3, 64)                   # 2.3 MiB in bf16, 4.7 in fp32: not whole huge pages
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.storage_offset() == 0             # Inductor's graph cache keys on it (a restart must hit)
    assert not t.any()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % (2 << 20) == 0
    t[-1, -1, -1, -1] = 1                      # the whole tensor is writable
    assert t.sum().item() == 1


def test_small_tensors_are_plain_zeros():
    t = zeros_on_huge_pages((4, 16, 2, 8), torch.float32)
    assert t.shape == (4, 16, 2, 8) and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_the_cpu_engine_cache_uses_them(tiny_model_dir):
    from engine_worker import LLM
    llm = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=64 * 2**20)
    k_cache, v_cache = llm.engine.runner.kv_caches[0]
    assert k_cache.data_ptr() % (2 << 20) == 0 and v_cache.data_ptr() % (2 << 20) == 0

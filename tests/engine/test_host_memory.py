"""engine_worker/model/host_memory.py: the CPU KV cache on transparent huge pages."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_worker.model.host_memory import Prefault, zeros_on_huge_pages


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


@pytest.mark.parametrize("commit", [True, False])
def test_zeros_committed_now_or_at_first_touch_read_the_same(commit):
    """The KV cache's pages are left to the kernel to zero at their first touch (commit=False):
    untouched memory reads as zeros, and every write stays."""
    t = zeros_on_huge_pages((600, 16, 3, 64), torch.bfloat16, commit=commit)
    assert t.storage_offset() == 0 and not t.any()
    t[5, 0, 0, 0] = 3
    t[-1, -1, -1, -1] = 1
    assert t.sum().item() == 4


def resident_pages(t: torch.Tensor) -> int:
    """How many of t's 4 KiB pages are backed (mincore)."""
    import ctypes
    pages = -(-t.untyped_storage().nbytes() // 4096)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(t.data_ptr(), t.untyped_storage().nbytes(), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_backs_every_page_and_keeps_what_was_written():
    """An idle engine backs the cache's pages ahead of its steps, a slice at a time: every page
    ends up backed, the blocks written before (a prefix cache's) keep their values."""
    tensors = [zeros_on_huge_pages((700, 16, 3, 64), torch.bfloat16, commit=False) for _ in range(3)]  # 4.1 MiB
    tensors[1][10] = 2.0                                            # a cached block, in the first page
    tensors[2][-1] = 3.0                                            # and one in the last
    p = Prefault(tensors)
    assert resident_pages(tensors[0]) == 0
    slices = 1
    while p.run(0.0):                                               # one page a call at a zero budget
        slices += 1
    if slices == 1:
        pytest.skip("the kernel lacks MADV_POPULATE_WRITE (Linux 5.14)")
    assert slices == 3 * 3                                          # 3 pages (2 MiB) a tensor
    assert all(resident_pages(t) == -(-t.untyped_storage().nbytes() // 4096) for t in tensors)
    assert tensors[1][10].eq(2.0).all() and tensors[2][-1].eq(3.0).all()
    assert tensors[0].sum().item() == 0 and tensors[1].sum().item() == 2.0 * 16 * 3 * 64
    assert not p.run(1.0) and p.done


def test_small_tensors_are_plain_zeros():
    t = zeros_on_huge_pages((4, 16, 2, 8), torch.float32)
    assert t.shape == (4, 16, 2, 8) and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_the_cpu_engine_cache_uses_them(tiny_model_dir):
    from engine_worker import LLM
    llm = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=64 * 2**20)
    k_cache, v_cache = llm.engine.runner.kv_caches[0]
    assert k_cache.data_ptr() % (2 << 20) == 0 and v_cache.data_ptr() % (2 << 20) == 0


def test_weights_move_into_one_mapping_unchanged():
    from torch import nn

    from engine_worker.model.host_memory import onto_huge_pages
    torch.manual_seed(0)
    m = nn.Module()
    m.a, m.b = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)
    m.b.weight = m.a.weight                                   # tied
    m.small = nn.Linear(8, 8)                                 # under min_bytes: stays
    m.register_buffer("table", torch.arange(70001, dtype=torch.int32))
    m.register_buffer("strided", torch.randn(512, 256)[:, :128])     # not contiguous: stays
    before = {name: t.clone() for name, t in m.state_dict().items()}
    small, strided = m.small.weight.data_ptr(), m.strided.data_ptr()

    assert onto_huge_pages(m) == 256 * 256 * 4 + 70016 * 4   # each rounded up to 64 bytes
    assert all(torch.equal(t, before[name]) for name, t in m.state_dict().items())
    assert isinstance(m.a.weight, nn.Parameter) and m.a.weight.requires_grad and m.b.weight is m.a.weight
    assert m.small.weight.data_ptr() == small and m.strided.data_ptr() == strided
    w, table = m.a.weight, m.table
    assert w.storage_offset() == 0 and table.storage_offset() == 0       # each its own storage
    first, second = sorted((w, table), key=torch.Tensor.data_ptr)        # one mapping, in turn
    assert second.data_ptr() == first.data_ptr() + -(-first.nbytes // 64) * 64
    if sys.platform.startswith("linux"):
        assert first.data_ptr() % (2 << 20) == 0
    assert m.a(torch.ones(1, 256)).shape == (1, 256)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_the_cpu_engine_weights_use_them(tiny_model_dir):
    from engine_worker import LLM
    llm = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=64 * 2**20)
    model = llm.engine.runner.model
    large = [t for t in [*model.parameters(), *model.buffers()] if t.layout == torch.strided and t.nbytes >= 64 << 10]
    assert large and min(t.data_ptr() for t in large) % (2 << 20) == 0

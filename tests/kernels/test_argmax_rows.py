"""kaiten_cpu::argmax_rows (kernels/csrc/argmax_cpu.cpp) gives torch.argmax(x, -1)'s indices: the first
of equal maxima, the first NaN, rows of -inf, widths off the vector blocks; and the sampler uses it."""
from __future__ import annotations

import pytest
import torch

from engine_worker.engine.sampler import argmax_rows
from kernels.cpu_ops_build import cpu_ops_available, load_cpu_ops
from tests.support.isa_builds import assert_passes_in_isa_build

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

# widths: below one vector, off every block of 4 vectors (8 or 16 lanes), the default model's vocabulary
WIDTHS = [1, 5, 31, 64, 65, 333, 49152]


def op(x: torch.Tensor) -> torch.Tensor:
    load_cpu_ops()
    return torch.ops.kaiten_cpu.argmax_rows(x)


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_matches_torch_argmax_on_random_rows(rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n))
    assert torch.equal(op(x), x.argmax(-1))


@pytest.mark.parametrize("n", WIDTHS[2:])
def test_ties_nan_and_infinities_as_torch(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(8, n, generator=g)
    x[0, [n // 3, n // 2, n - 1]] = 50.0               # equal maxima: the first
    x[1, [n - 2, 3]] = float("nan")                      # NaN: the first NaN, wherever the max is
    x[2] = float("-inf")                                 # all -inf: index 0
    x[3, n - 1] = float("inf")                           # +inf in the tail
    x[4] = 0.0
    x[4, n // 2] = -0.0                                  # -0.0 == 0.0: the first
    x[5, 0] = float("nan")
    x[6] = torch.randint(-3, 3, (n,), generator=g).float()   # many ties
    x[7, 1:] = float("-inf")
    assert torch.equal(op(x), x.argmax(-1))


def test_non_contiguous_rows_and_bad_input():
    x = torch.randn(40, 77)
    assert torch.equal(op(x[::3, 5:]), x[::3, 5:].argmax(-1))
    with pytest.raises(RuntimeError, match="float32 matrix"):
        op(torch.randn(4, 8).double())
    with pytest.raises(RuntimeError, match="float32 matrix"):
        op(torch.randn(8))


def test_sampler_helper_takes_the_op_on_cpu_and_torch_elsewhere():
    load_cpu_ops()
    x = torch.randn(32, 1000)
    with torch.profiler.profile() as prof:
        got = argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert "kaiten_cpu::argmax_rows" in {e.key for e in prof.key_averages()}
    xb = x.bfloat16()                                    # not fp32: torch.argmax
    assert torch.equal(argmax_rows(xb), xb.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass this file's tests."""
    assert_passes_in_isa_build(__file__, isa)

"""kaiten_cpu::bf16_linear (kernels/csrc/bf16_linear_cpu.cpp) against widen-then-matmul: both paths
(in registers, and widened chunks into at::mm), odd shapes, bias, and the layers around it."""
from __future__ import annotations

import pytest
import torch

from engine_worker.model.bf16_layers import Bf16Embedding, Bf16Linear
from kernels.cpu_ops_build import cpu_ops_available
from tests.support.isa_builds import assert_passes_in_isa_build

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

DIRECT, DENSE = 1 << 30, 1          # min_dense_rows: never dense, always dense
# (N, K): K not a multiple of any vector length (tails), N not a multiple of the row blocks; the
# last one takes several 4 MiB chunks on the dense path.
SHAPES = [(37, 96), (45, 161), (7, 3), (19, 1000), (2200, 520)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 33])
@pytest.mark.parametrize("min_dense_rows", [DIRECT, DENSE])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_widened_matmul(n, k, m, min_dense_rows, bias):
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = torch.ops.kaiten_cpu.bf16_linear(x, w, b, min_dense_rows)
    ref = reference(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("min_dense_rows", [DIRECT, DENSE])
def test_pool_threads_in_inference_mode(min_dense_rows):
    """The engine calls the op in inference mode on several threads (the tests' default is one)."""
    w, x = torch.randn(300, 96).bfloat16(), torch.randn(20, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = torch.ops.kaiten_cpu.bf16_linear(x, w, None, min_dense_rows)
    finally:
        torch.set_num_threads(threads)
    ref = reference(x, w, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_layers_leading_dims_and_tied_embedding():
    emb = Bf16Embedding(40, 64)
    emb.weight.data.copy_(torch.randn(40, 64))
    head = Bf16Linear(64, 40, False, emb.weight)
    assert head.weight is emb.weight and emb.weight.dtype == torch.bfloat16
    x = torch.randn(2, 5, 64)
    out = head(x)
    assert out.shape == (2, 5, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x.view(10, 64), emb.weight, None).view(2, 5, 40), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(emb(ids), emb.weight.float()[ids])


def test_bad_arguments_are_errors():
    w = torch.randn(37, 96).bfloat16()
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.kaiten_cpu.bf16_linear(torch.randn(1, 64), w, None, DIRECT)
    with pytest.raises(RuntimeError, match="bf16 matrix"):
        torch.ops.kaiten_cpu.bf16_linear(torch.randn(1, 96), w.float(), None, DIRECT)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kaiten_cpu.bf16_linear(torch.randn(1, 96), w, torch.randn(36), DIRECT)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass this file's kernel tests."""
    assert_passes_in_isa_build(__file__, isa)

"""kaiten_cpu::quant_linear (kernels/csrc/quant_linear_cpu.cpp) against dequantize-then-matmul,
for every GGUF format, both paths (in registers, and dequantized chunks into at::mm) and odd shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear
from kernels.cpu_attention import cpp_attention_available
from shared.gguf_quant import concat, repack
from tests.isa_builds import assert_passes_in_isa_build
from tests.test_gguf_quant import gguf_tensor

pytestmark = pytest.mark.skipif(not cpp_attention_available(), reason="the C++ CPU extension does not build here")

DIRECT, DENSE = 1 << 30, 1          # min_dense_rows: never dense, always dense
# (format, N, K): N not a multiple of 16, K a multiple of 32 (of 256 for the K-quants)
CASES = [("Q4_0", 37, 96), ("Q4_1", 45, 160), ("Q8_0", 37, 96), ("Q4_K", 19, 512), ("Q6_K", 23, 256)]


def layer(fmt: str, n: int, k: int) -> QuantLinear:
    if fmt == "mixed":                  # a fused q/k/v of Q4_K and Q6_K parts: int8 with mins, group 16
        return QuantLinear(concat([repack(gguf_tensor("Q4_K", n, k), "Q4_K"),
                                   repack(gguf_tensor("Q6_K", 5, k, seed=1), "Q6_K")]))
    return QuantLinear(repack(gguf_tensor(fmt, n, k), fmt))


def reference(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    return (x.double() @ lin.dequantize().double().T).to(x.dtype)


@pytest.mark.parametrize("fmt,n,k", CASES + [("mixed", 21, 256)])
@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("min_dense_rows", [DIRECT, DENSE])
def test_quant_linear_matches_dequantized_matmul(fmt, n, k, m, min_dense_rows):
    lin = layer(fmt, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, min_dense_rows)
    ref = reference(x, lin)
    assert out.shape == (m, lin.qweight.shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("min_dense_rows", [DIRECT, DENSE])
def test_pool_threads_in_inference_mode(min_dense_rows):
    """The engine calls the op in inference mode on several threads (the tests' default is one)."""
    lin = layer("Q4_1", 300, 96)
    x = torch.randn(20, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, min_dense_rows)
    finally:
        torch.set_num_threads(threads)
    ref = reference(x, lin)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_bf16_input_and_leading_dims():
    lin = layer("Q4_1", 37, 96)
    x = torch.randn(2, 5, 96).bfloat16()
    out = lin(x)
    assert out.shape == (2, 5, 37) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x.float(), lin), rtol=1e-2, atol=1e-2)


def test_dequantize_matches_gguf_and_embedding_looks_up_rows():
    import gguf

    data = gguf_tensor("Q4_1", 40, 64)
    lin = QuantLinear(repack(data, "Q4_1"))
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1).reshape(40, 64)
    np.testing.assert_array_equal(lin.dequantize().numpy(), expected)
    ids = torch.tensor([3, 0, 39, 3])
    torch.testing.assert_close(QuantEmbedding(lin, torch.float32)(ids), torch.from_numpy(expected)[ids], rtol=0, atol=0)


def test_bad_arguments_are_errors():
    lin = layer("Q8_0", 37, 96)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.kaiten_cpu.quant_linear(torch.randn(1, 64), lin.qweight, lin.scales, lin.mins, DIRECT)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass this file's kernel tests."""
    assert_passes_in_isa_build(__file__, isa)

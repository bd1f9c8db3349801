"""kaiten_cpu::quant_linear (kernels/csrc/quant_linear_cpu.cpp) against dequantize-then-matmul,
for every GGUF format (int4 with mins; int8 with and without mins, groups of 16 and 32), its three
methods (fp32 registers, int8 activations, dequantized chunks into at::mm) and odd shapes, on fresh
random inputs. test_other_isa_builds runs them again on the AVX2 and portable builds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.model.quant_layers import MAX_INT8_ROWS, MIN_DENSE_ROWS, QuantEmbedding, QuantLinear
from kernels.cpu_attention import cpp_attention_available
from shared.gguf_quant import PackedWeight, concat, repack
from tests.isa_builds import assert_passes_in_isa_build
from tests.test_gguf_quant import gguf_tensor

pytestmark = pytest.mark.skipif(not cpp_attention_available(), reason="the C++ CPU extension does not build here")

NEVER = 1 << 30
# (max_int8_rows, min_dense_rows) forcing each method
METHODS = {"registers": (-1, NEVER), "int8": (NEVER, NEVER), "dense": (-1, 0)}
# (format, N, K): N not a multiple of 16, K a multiple of 32 (of 256 for the K-quants)
CASES = [("Q4_0", 37, 96), ("Q4_1", 45, 160), ("Q8_0", 37, 96), ("Q4_K", 19, 512), ("Q6_K", 23, 256),
         ("mixed", 21, 256), ("Q8_0+min", 13, 64)]


def layer(fmt: str, n: int, k: int) -> QuantLinear:
    if fmt == "mixed":                  # a fused q/k/v of Q4_K and Q6_K parts: int8 with mins, group 16
        return QuantLinear(concat([repack(gguf_tensor("Q4_K", n, k), "Q4_K"),
                                   repack(gguf_tensor("Q6_K", 5, k, seed=1), "Q6_K")]))
    if fmt == "Q8_0+min":               # int8 with mins, group 32 (no GGUF type, the kernel takes it)
        p = repack(gguf_tensor("Q8_0", n, k), "Q8_0")
        mins = np.random.default_rng(2).standard_normal(p.scales.shape).astype(np.float32) * p.scales
        return QuantLinear(PackedWeight(p.qweight, p.scales, mins))
    return QuantLinear(repack(gguf_tensor(fmt, n, k), fmt))


def reference(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    return (x.double() @ lin.dequantize().double().T).to(x.dtype)


def int8_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the int8 method sees it, and each element's half step: per row and block of 32,
    d = amax / 127, q = round(x / d) (to even), x = q * d; the same fp32 operations as the kernel,
    so the same q."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (q.double() * d.double()).flatten(-2), (d.double() / 2).expand(b.shape).flatten(-2)


def int8_reference(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    """The int8 method's exact result: the integer part of the weight times the int8-rounded x,
    the mins times the fp32 x (the kernel adds min * the exact sum of x over a group)."""
    w = lin.dequantize().double()
    mins = torch.zeros_like(w) if lin.mins is None else \
        lin.mins.double().repeat_interleave(w.shape[1] // lin.mins.shape[1], dim=1)
    return (int8_rounded(x)[0] @ (w - mins).T + x.double() @ mins.T).to(x.dtype)


def fresh_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Random activations with a few large channels, as a transformer's have."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.where(torch.rand(k, generator=g) < 0.05, 8.0, 1.0)


@pytest.mark.parametrize("fmt,n,k", CASES)
@pytest.mark.parametrize("m", [1, 3, 6, 33])
@pytest.mark.parametrize("method", ["registers", "dense"])
def test_quant_linear_matches_dequantized_matmul(fmt, n, k, m, method):
    lin = layer(fmt, n, k)
    x = fresh_x(m, k, m)
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, *METHODS[method])
    ref = reference(x, lin)
    assert out.shape == (m, lin.qweight.shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# The int8 method's error against fp32 x, as a share of the output's norm: about 2% on these
# inputs (their 5% of channels 8x larger raise the scale of most blocks), 5.5% at most over the cases.
INT8_REL_ERROR = 0.08


@pytest.mark.parametrize("fmt,n,k", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 33])
def test_int8_activations_match_dequantized_matmul(fmt, n, k, m):
    lin = layer(fmt, n, k)
    x = fresh_x(m, k, 100 + m)
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, *METHODS["int8"])
    assert out.shape == (m, lin.qweight.shape[0]) and out.dtype == torch.float32
    tight = int8_reference(x, lin)       # the same rounding of x: only the summation order differs
    torch.testing.assert_close(out, tight, rtol=1e-4, atol=1e-4 * tight.abs().max().item())
    ref = reference(x, lin)              # fp32 x: off by the rounding of x, at most half a step each
    w = lin.dequantize().double()
    mins = 0 if lin.mins is None else lin.mins.double().repeat_interleave(w.shape[1] // lin.mins.shape[1], dim=1)
    bound = int8_rounded(x)[1] @ (w - mins).abs().T
    assert ((out - ref).abs().double() <= bound + 1e-4 * ref.abs().max().item()).all()
    assert ((out - ref).norm() / ref.norm()).item() < INT8_REL_ERROR


def test_int8_activations_of_zero_rows_and_blocks():
    """An all-zero block of x has scale 0 (no division by zero); an all-zero row gives zeros."""
    lin = layer("Q4_1", 45, 160)
    x = fresh_x(3, 160, 7)
    x[0] = 0
    x[1, 32:64] = 0
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, *METHODS["int8"])
    assert out[0].abs().max().item() == 0
    torch.testing.assert_close(out, int8_reference(x, lin), rtol=1e-4, atol=1e-4 * out.abs().max().item())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_layer_picks_a_method_by_rows(fmt):
    """QuantLinear's thresholds: dense chunks from MIN_DENSE_ROWS, below it int8 activations up to
    the weight kind's MAX_INT8_ROWS, fp32 registers above (the int8 method's rounding tells it)."""
    lin = layer(fmt, 37, 96)
    dense = MIN_DENSE_ROWS[torch.float32]
    for m in (1, 2, 3, 4, 8, dense - 1, dense, dense + 9):
        x = fresh_x(m, 96, 11)
        int8 = m < dense and m <= MAX_INT8_ROWS[lin.kind]
        expected = int8_reference(x, lin) if int8 else reference(x, lin)
        torch.testing.assert_close(lin(x), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("method", list(METHODS))
def test_pool_threads_in_inference_mode(method):
    """The engine calls the op in inference mode on several threads (the tests' default is one)."""
    lin = layer("Q4_1", 300, 96)
    x = torch.randn(20, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, *METHODS[method])
    finally:
        torch.set_num_threads(threads)
    ref = int8_reference(x, lin) if method == "int8" else reference(x, lin)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("method", list(METHODS))
def test_bf16_input_and_leading_dims(method):
    lin = layer("Q4_1", 37, 96)
    x = torch.randn(2, 5, 96).bfloat16()
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.qweight, lin.scales, lin.mins, *METHODS[method])
    assert out.shape == (2, 5, 37) and out.dtype == torch.bfloat16
    ref = int8_reference(x.float(), lin) if method == "int8" else reference(x.float(), lin)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


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
        torch.ops.kaiten_cpu.quant_linear(torch.randn(1, 64), lin.qweight, lin.scales, lin.mins, *METHODS["int8"])


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass this file's kernel tests."""
    assert_passes_in_isa_build(__file__, isa)

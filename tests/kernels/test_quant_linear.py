"""kaiten_cpu::quant_linear (kernels/csrc/quant_linear_cpu.cpp) against dequantize-then-matmul,
for every GGUF format (int4 with mins; 5-bit with and without; int8 with and without mins, groups of 16 and 32), its
methods (fp32 registers, the panel GEMMs, dequantized chunks into at::mm, int8 activations) and
odd shapes, on fresh random inputs; and the tiles it reads (engine_worker/model/quant_tiles.py).
test_other_isa_builds runs them again on the AVX2 and portable builds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.model.quant_layers import INT8_ROWS, MIN_DENSE_ROWS, QuantEmbedding, QuantLinear
from engine_worker.model.quant_tiles import TILE_ROWS
from kernels.cpu_ops_build import cpu_capability, cpu_ops_available, int8_activations_built, int8_x_levels
from shared.gguf_quant import PackedWeight, concat, repack
from tests.support.gguf_files import gguf_tensor
from tests.support.isa_builds import assert_passes_in_isa_build

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

NEVER = 1 << 30
# min_dense_rows forcing each exact method (int8_rows is 0 unless given)
METHODS = {"registers": NEVER, "dense": 0}
# (format, N, K): N not a multiple of TILE_ROWS, K a multiple of 32 (of 256 for the K-quants)
CASES = [("Q4_0", 37, 96), ("Q4_1", 45, 160), ("Q8_0", 37, 96), ("Q4_K", 19, 512), ("Q6_K", 23, 256),
         ("Q5_0", 29, 96), ("Q5_1", 27, 160), ("Q5_K", 17, 256), ("mixed", 21, 256), ("Q8_0+min", 13, 64)]


def layer(fmt: str, n: int, k: int) -> QuantLinear:
    return QuantLinear(packed(fmt, n, k))


def packed(fmt: str, n: int, k: int) -> PackedWeight:
    if fmt == "mixed":                  # a fused q/k/v of Q4_K and Q6_K parts: int8 with mins, group 16
        return concat([repack(gguf_tensor("Q4_K", n, k), "Q4_K"), repack(gguf_tensor("Q6_K", 5, k, seed=1), "Q6_K")])
    if fmt == "Q8_0+min":               # int8 with mins, group 32 (no GGUF type, the kernel takes it)
        p = repack(gguf_tensor("Q8_0", n, k), "Q8_0")
        mins = np.random.default_rng(2).standard_normal(p.scales.shape).astype(np.float32) * p.scales
        return PackedWeight(p.qweight, p.scales, mins)
    return repack(gguf_tensor(fmt, n, k), fmt)


def quant_linear(x: torch.Tensor, lin: QuantLinear, method: str) -> torch.Tensor:
    return torch.ops.kaiten_cpu.quant_linear(x, lin.tiles, *lin.op_args, METHODS[method])


def reference(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    return (x.double() @ lin.dequantize().double().T).to(x.dtype)


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
    out = quant_linear(x, lin, method)
    ref = reference(x, lin)
    assert out.shape == (m, lin.fmt.n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_method_on_a_large_weight(dtype):
    """A weight of 10 panels and 70 rows of x (5 passes of the panel GEMM's 12 rows and a tail of
    10; fp32 x, and bf16 x on AVX512-BF16; with AMX, 2 passes of 32 rows on the tiles and a tail of
    6), or larger than one dequantized chunk (4 MiB of scratch: 256 bf16 rows of k 8192) where the
    dense method is the chunks into oneDNN (bf16 x in the other builds): every output column
    right."""
    assert_dense_method_right("Q4_0", 300, 8192, 70, 5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_method_in_groups_of_panels(dtype):
    """32 panels of k 1024 (64 KiB each in bf16, 128 KiB in fp32 on AVX-512): the panel GEMMs
    dequantize a quarter of L2's worth at a time, so each thread has several groups, the last one
    short, and 100 rows of x meet every panel of a group before the next is dequantized."""
    assert_dense_method_right("Q4_1", 1000, 1024, 100, 7, dtype)


def assert_dense_method_right(fmt: str, n: int, k: int, m: int, seed: int, dtype: torch.dtype) -> None:
    """The dense method on m rows of x against dequantize-then-matmul in fp64 (bf16 x: within 2e-2
    at the output's scale, fp32 x: 1e-4)."""
    lin = layer(fmt, n, k)
    x = fresh_x(m, k, seed).to(dtype)
    out = quant_linear(x, lin, "dense")
    ref = reference(x, lin).double()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt,n,k", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 6, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(fmt, n, k, m, dtype):
    """bf16 and fp16 x, the output in x's dtype. With more rows than a group has vectors, an
    AVX512-BF16 build rounds the dequantized weights to bf16 for bf16 x and multiplies in bf16 dot
    products summed in fp32, as the dense bf16 GEMM does (on a CPU with AMX, the dense method
    multiplies so on the tiles: its tile kernel up to 32 rows, the panels past that); every method
    stays within 1e-2 of the exact product (of the rounded x) at the output's scale."""
    lin = layer(fmt, n, k)
    x = fresh_x(m, k, m).to(dtype)
    ref = reference(x.double(), lin)
    for method in METHODS:
        out = quant_linear(x, lin, method)
        assert out.dtype == dtype and out.shape == (m, lin.fmt.n)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def int8_rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x as the int8 method sees it, in fp64: per row and block of 32, q = x * (levels / amax)
    rounded to nearest even (fp32 arithmetic, as the kernel: levels / amax one division, where torch
    would take a number over a tensor as the reciprocal times the number), times amax / levels."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-levels, levels)
    return (q.double() * (amax / levels).double()).view(m, k)


def int8_reference(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    """The int8 method's exact result: the dequantized weight times the int8-rounded x (7 bits
    against int8 weights in builds without VNNI)."""
    return int8_rounded(x, int8_x_levels(lin.fmt.bits)) @ lin.dequantize().double().T


@pytest.mark.parametrize("fmt,n,k", CASES)
@pytest.mark.parametrize("m", [1, 3, 6, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_activations(fmt, n, k, m, dtype):
    """In the AVX-512 (with and without VNNI) and AVX2 builds, the int8 method (a row at a time
    against each tile for few rows, the int8 panel GEMM for more) equals its exact reference but
    for the summation order, and stays within 5% of the exact product's norm on these activations with
    outlier channels. Other builds take the exact method for those rows."""
    lin = layer(fmt, n, k)
    x = fresh_x(m, k, m).to(dtype)
    out = torch.ops.kaiten_cpu.quant_linear(x, lin.tiles, *lin.op_args, NEVER, NEVER).double()
    exact = reference(x.double(), lin)
    if not int8_activations_built():
        torch.testing.assert_close(out, exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
        return
    expected = int8_reference(x, lin)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, 1e-4)       # the output rounded to x's dtype
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert (out - exact).norm() < 0.05 * exact.norm()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_come_before_the_dense_method(fmt, dtype):
    """Rows within both thresholds (m <= int8_rows and m >= min_dense_rows) take int8 activations,
    a row at a time (up to 8 rows, 16 on AVX-512) or on the int8 panel: so INT8_ROWS is the rows
    that take them, as it says (AMX hosts had 12 to 16 bf16 rows on the dense method against
    INT8_ROWS 16). Builds without int8 activations take the dense method."""
    lin = layer(fmt, 37, 96)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for m in (1, 3, 12, 16, 20):
        x = fresh_x(m, 96, m).to(dtype)
        out = torch.ops.kaiten_cpu.quant_linear(x, lin.tiles, *lin.op_args, 0, m).double()
        expected = int8_reference(x, lin) if int8_activations_built() else reference(x, lin).double()
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_picks_a_method_by_rows(fmt, dtype):
    """A deterministic QuantLinear (the default) multiplies int8-rounded activations in every row
    (where the build can; else the exact activations in registers). deterministic=False: int8 up to
    INT8_ROWS[x's dtype] rows (every row for fp32 x), past that the exact activations in registers
    below MIN_DENSE_ROWS and by the dense method from it."""
    lin, fast = layer(fmt, 37, 96), QuantLinear(packed(fmt, 37, 96), deterministic=False)
    dense = MIN_DENSE_ROWS[dtype]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for m in sorted({1, 2, 3, 4, 8, 9, INT8_ROWS[torch.bfloat16], INT8_ROWS[torch.bfloat16] + 1, dense - 1, dense, dense + 9}):
        x = fresh_x(m, 96, 11).to(dtype)
        for layer_, int8_rows in ((lin, NEVER), (fast, INT8_ROWS[dtype])):
            int8 = m <= int8_rows and int8_activations_built()
            expected = int8_reference(x, lin) if int8 else reference(x, lin).double()
            torch.testing.assert_close(layer_(x).double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("method", list(METHODS))
def test_pool_threads_in_inference_mode(method):
    """The engine calls the op in inference mode on several threads (the tests' default is one)."""
    lin = layer("Q4_1", 300, 96)
    x = torch.randn(20, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = quant_linear(x, lin, method)
    finally:
        torch.set_num_threads(threads)
    ref = reference(x, lin)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,int8_rows", [(3, 0), (20, 0), (20, NEVER), (70, 0)])
def test_output_does_not_depend_on_how_threads_share_the_weight(rows, int8_rows, dtype):
    """Threads take a weight's panels in shrinking chunks from one queue (few rows: equal shares of
    its tiles). With 1, 2, 3 and 5 threads on this machine's cores (more threads than cores
    interleave their claims), every method gives the same bytes: each output is computed whole by
    whichever thread took its tiles.
    3 rows: registers; 20: the registers or, with int8_rows, the int8 panel GEMM; 70: the dense
    method. 1000 weight rows: 250 tiles, 62 panels of 16 or 31 of 32."""
    lin = layer("Q8_0", 1000, 256)
    x = fresh_x(rows, 256, 5).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs.append(torch.ops.kaiten_cpu.quant_linear(x, lin.tiles, *lin.op_args, 64, int8_rows))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("method", list(METHODS))
def test_bf16_input_and_leading_dims(method):
    lin = layer("Q4_1", 37, 96)
    x = torch.randn(2, 5, 96).bfloat16()
    out = quant_linear(x, lin, method)
    assert out.shape == (2, 5, 37) and out.dtype == torch.bfloat16
    ref = reference(x.float(), lin)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_dequantize_matches_gguf_and_embedding_looks_up_rows():
    import gguf

    data = gguf_tensor("Q4_1", 40, 64)
    lin = QuantLinear(repack(data, "Q4_1"))
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1).reshape(40, 64)
    np.testing.assert_array_equal(lin.dequantize().numpy(), expected)
    ids = torch.tensor([3, 0, 39, 3])
    torch.testing.assert_close(QuantEmbedding(lin, torch.float32)(ids), torch.from_numpy(expected)[ids], rtol=0, atol=0)


@pytest.mark.parametrize("fmt,n,k", CASES + [("Q5_0", 301, 1024)])
@pytest.mark.parametrize("five_bit", [True, False])
def test_embedding_lookup_op_equals_the_python_dequantizer(fmt, n, k, five_bit):
    """kaiten_cpu::dequantize_rows (the embedding's lookup) gives quant_tiles.dequantize's bytes
    for every layout (int4 with mins, 5-bit with and without, int8 with and without, fp16 and fp32
    scales), any rows in any order, repeated, the padded last tile's included, and more rows than
    one thread takes; a row past the table is an error, not padding."""
    lin = QuantLinear(packed(fmt, n, k), five_bit=five_bit)
    n = lin.fmt.n                       # "mixed" has the Q6_K part's rows too
    ids = torch.tensor([n - 1, 0, 5 % n, n - 1, 2, *range(n)])
    got = torch.ops.kaiten_cpu.dequantize_rows(lin.tiles, ids, *lin.op_args)
    want = lin.dequantize(ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), k)
    np.testing.assert_array_equal((got.numpy() + 0.0).view(np.uint32), (want.numpy() + 0.0).view(np.uint32))
    assert torch.equal(QuantEmbedding(lin, torch.bfloat16)(ids[:3]), want[:3].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kaiten_cpu.dequantize_rows(lin.tiles, torch.tensor([n]), *lin.op_args)


@pytest.mark.parametrize("fmt,scale_dtype", [("Q4_0", torch.float16), ("Q4_1", torch.float16),
                                              ("Q8_0", torch.float16), ("Q4_K", torch.float32),
                                              ("Q6_K", torch.float32), ("Q8_0+min", torch.float32)])
def test_tiles_keep_the_files_size_and_lose_nothing(fmt, scale_dtype):
    """fp16 scales and mins where that is exact (the formats that store them so), else fp32; the
    tiles dequantize to the packed weight bit for bit, and Q4_0/Q4_1/Q8_0 take the GGUF file's bytes
    (18, 20 and 34 per 32 weights) plus the last tile's padding."""
    n, k = (19, 512) if fmt in ("Q4_K", "Q6_K") else (37, 96)
    p = packed(fmt, n, k)
    lin = QuantLinear(p)
    assert lin.fmt.scale_dtype == scale_dtype
    np.testing.assert_array_equal(lin.dequantize().numpy(), p.dequantize())
    per_32 = {"Q4_0": 20, "Q4_1": 20, "Q8_0": 34}.get(fmt)   # Q4_0 keeps its -8 d as a min
    if per_32:
        assert lin.tiles.numel() == -(-n // TILE_ROWS) * TILE_ROWS * k // 32 * per_32


@pytest.mark.parametrize("fmt,n,k,per_32", [("Q5_0", 29, 96, 22), ("Q5_1", 27, 160, 24), ("Q5_K", 17, 256, 28)])
def test_five_bit_tiles_hold_what_gguf_dequantizes(fmt, n, k, per_32):
    """Q5_0, Q5_1 and Q5_K take the 5-bit tiles (20 bytes per 32 weights, plus the scales: fp16
    for Q5_0 and Q5_1, as the file; fp32 scale and min for Q5_K's products), not int8's 32; their
    rows dequantize to gguf's values bit for bit, every row and any lookup of rows."""
    import gguf

    data = gguf_tensor(fmt, n, k)
    lin = QuantLinear(repack(data, fmt))
    assert lin.fmt.bits == 5 and lin.kind == "int5"
    assert lin.tiles.numel() == -(-n // TILE_ROWS) * TILE_ROWS * k // 32 * per_32
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt]).reshape(n, k) + 0.0
    np.testing.assert_array_equal((lin.dequantize().numpy() + 0.0).view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([n - 1, 0, 5, n - 1, 2])
    np.testing.assert_array_equal(lin.dequantize(ids).numpy() + 0.0, expected[ids.numpy()])


@pytest.mark.parametrize("fmt,n,k", [("Q5_0", 29, 96), ("Q5_1", 27, 160), ("Q5_K", 17, 256), ("Q5_0", 301, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_five_bit_tiles_compute_what_the_int8_tiles_did(fmt, n, k, dtype):
    """The 5-bit tiles hold the integers the int8 tiles held, and every method (the exact fp32
    registers, the dense GEMMs, int8 activations a row at a time and on the panel) gives the same
    bytes from them, in every build."""
    p = packed(fmt, n, k)
    five, int8 = QuantLinear(p), QuantLinear(p, five_bit=False)
    assert (five.fmt.bits, int8.fmt.bits) == (5, 8)
    for m in (1, 3, 6, 9, 33, 70):
        x = fresh_x(m, k, m).to(dtype)
        for args in ((NEVER, 0), (0, 0), (NEVER, NEVER)):
            out = torch.ops.kaiten_cpu.quant_linear(x, five.tiles, *five.op_args, *args)
            assert torch.equal(out, torch.ops.kaiten_cpu.quant_linear(x, int8.tiles, *int8.op_args, *args)), (m, args)


def test_bad_arguments_are_errors():
    lin = layer("Q8_0", 37, 96)
    with pytest.raises(RuntimeError, match="features"):
        quant_linear(torch.randn(1, 64), lin, "registers")
    n, k, bits, group, has_mins = lin.op_args
    with pytest.raises(RuntimeError, match="tiles for"):
        torch.ops.kaiten_cpu.quant_linear(torch.randn(1, k), lin.tiles, n + 4, k, bits, group, has_mins, 1)
    with pytest.raises(RuntimeError, match="do not match the format"):
        torch.ops.kaiten_cpu.quant_linear(torch.randn(1, k), lin.tiles, n, k, 4, group, True, 1)
    with pytest.raises(RuntimeError, match="unsupported format"):
        torch.ops.kaiten_cpu.quant_linear(torch.randn(1, k), lin.tiles, n, k, 8, 64, has_mins, 1)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX-512 (without VNNI), AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass
    this file's kernel tests."""
    if isa == "avx512" and not cpu_capability()[0].startswith("avx512"):
        pytest.skip("this CPU has no AVX-512")
    assert_passes_in_isa_build(__file__, isa)

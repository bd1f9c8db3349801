"""kaiten_cpu::quant_linear is batch-invariant in a deterministic QuantLinear (the default, issue
#66): a row's output is the same bytes whatever other rows share the call and however many threads
run it, for every tile format and x dtype. In the AVX-512 and AVX2 builds every call takes int8
activations (a row at a time against each tile up to a few rows, the int8 panel GEMM past that:
the two sum each row in the same order); the portable build, and any build with int8 activations
off (INT8_ROWS empty), the exact fp32 registers for every call. test_other_isa_builds runs them
again on the AVX2 and portable builds."""
from __future__ import annotations

import pytest
import torch

from engine_worker.model import quant_layers
from engine_worker.model.quant_layers import QuantLinear
from kernels.cpu_ops_build import cpu_capability, cpu_ops_available
from tests.kernels.test_quant_linear import CASES, fresh_x, packed
from tests.support.isa_builds import assert_passes_in_isa_build

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

# row counts across every switch the op had: int8_block's 8 or 16 rows, the panel's passes of 6 or
# 12 and its tails, the registers' blocks of 4, the dense thresholds (12, 24, 64, 96)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 23, 24, 25, 33, 47, 63, 64, 65, 70]
SUBSETS = [[0], [69], [255], [3, 200, 17], [5, 5, 100, 250, 1, 64, 9, 128, 33]]


def assert_rows_invariant(lin: QuantLinear, x: torch.Tensor) -> None:
    """lin(x)'s rows equal, byte for byte, lin of those rows alone or of any subset of them."""
    with torch.inference_mode():
        full = lin(x)
        for m in ROWS:
            assert torch.equal(lin(x[:m]), full[:m]), f"the first {m} rows"
        for rows in SUBSETS:
            assert torch.equal(lin(x[rows]), full[rows]), f"rows {rows}"


@pytest.mark.parametrize("fmt,n,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_other_rows(fmt, n, k, dtype):
    lin = QuantLinear(packed(fmt, n, k))
    assert_rows_invariant(lin, fresh_x(256, k, 3).to(dtype))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_activations_are_invariant_too(fmt, dtype, monkeypatch):
    """Without int8 activations (INT8_ROWS empty, as the engine tests that compare with HF run; the
    portable build always) a deterministic layer multiplies every call in the fp32 registers."""
    monkeypatch.setattr(quant_layers, "INT8_ROWS", {})
    n, k = {"Q6_K": (23, 256), "Q5_1": (27, 160)}.get(fmt, (37, 96))
    lin = QuantLinear(packed(fmt, n, k))
    if dtype == torch.bfloat16 and cpu_capability()[0] == "avx512bf16":
        pytest.skip("exact bf16 x takes vdpbf16ps from 3 rows on AVX512-BF16: deterministic needs int8 activations there")
    assert_rows_invariant(lin, fresh_x(256, k, 4).to(dtype))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 9, 40, 256])
def test_threads_do_not_change_a_row(fmt, dtype, m):
    """1000 weight rows (250 tiles, many chunks of the thread queue): 1, 2 and 3 threads give the
    same bytes, and the same as the row alone on one thread."""
    k = 256
    lin = QuantLinear(packed(fmt, 1000, k))
    x = fresh_x(m, k, 6).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            with torch.inference_mode():
                outs.append(lin(x))
        torch.set_num_threads(1)
        with torch.inference_mode():
            alone = lin(x[m - 1:])
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.equal(alone, outs[0][m - 1:])


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_other_isa_builds(isa):
    """The AVX-512 (without VNNI), AVX2 and portable builds of the extension (KAITEN_CPU_ISA) pass
    this file's tests."""
    if isa == "avx512" and not cpu_capability()[0].startswith("avx512"):
        pytest.skip("this CPU has no AVX-512")
    assert_passes_in_isa_build(__file__, isa)

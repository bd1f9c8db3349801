"""shared/gguf_quant.py: GGUF blocks repacked without loss (bit-identical to gguf's dequantizer)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from shared.gguf_quant import PackedWeight, concat, repack
from tests.support.gguf_files import gguf_tensor

T = gguf.GGMLQuantizationType
# type: (kind, group, with mins); every group a size the CPU kernel takes (int4: 32; int8: 16 or 32)
LAYOUTS = {"Q4_0": ("int4", 32, True), "Q4_1": ("int4", 32, True), "Q4_K": ("int4", 32, True),
           "Q5_0": ("int8", 32, False), "Q5_1": ("int8", 32, True), "Q5_K": ("int8", 32, True),
           "Q6_K": ("int8", 16, False), "Q8_0": ("int8", 32, False)}


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_repack_is_bit_identical_to_gguf(type_name):
    k = 512
    data = gguf_tensor(type_name, 24, k)
    packed = repack(data, type_name)
    expected = gguf.quants.dequantize(data, T[type_name]).reshape(24, k)
    assert packed.shape == (24, k)
    assert (packed.kind, packed.group, packed.mins is not None) == LAYOUTS[type_name]
    # + 0.0 turns -0.0 into 0.0: Q4_0's d * (q - 8) is -0.0 for q = 8 and a negative d, q * d - 8 d is 0.0
    np.testing.assert_array_equal((packed.dequantize() + 0.0).view(np.uint32), (expected + 0.0).view(np.uint32))


def test_rows_and_concat_of_mixed_layouts_are_lossless():
    parts = [repack(gguf_tensor("Q4_K", 8, 256, seed=1), "Q4_K"), repack(gguf_tensor("Q6_K", 4, 256, seed=2), "Q6_K"),
             repack(gguf_tensor("Q8_0", 4, 256, seed=3), "Q8_0")]
    fused = concat(parts)
    assert (fused.kind, fused.group) == ("int8", 16)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    same = concat(parts[:1] * 2)
    assert (same.kind, same.group) == ("int4", 32)
    perm = np.arange(8)[::-1]
    np.testing.assert_array_equal(parts[0].rows(perm).dequantize(), parts[0].dequantize()[perm])
    assert isinstance(same, PackedWeight)

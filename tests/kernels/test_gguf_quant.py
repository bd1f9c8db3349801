"""shared/gguf_quant.py: GGUF blocks repacked without loss (bit-identical to gguf's dequantizer)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from shared.gguf_quant import PackedWeight, concat, repack

T = gguf.GGMLQuantizationType
# (type, byte offsets of fp16 fields inside a block): K-quants are filled with random bytes, whose
# fp16 fields are set to ordinary values (random bits would be NaNs and infinities)
K_QUANT_F16 = {"Q4_K": (0, 2), "Q6_K": (208,)}


def gguf_tensor(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [n, row bytes] of a random tensor of `type_name`."""
    rng = np.random.default_rng(seed)
    qtype = T[type_name]
    if type_name not in K_QUANT_F16:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    for off in K_QUANT_F16[type_name]:
        b[..., off:off + 2] = rng.uniform(1e-3, 1e-1, (n, k // block)).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


@pytest.mark.parametrize("type_name,k", [("Q4_0", 96), ("Q4_1", 96), ("Q8_0", 96), ("Q4_K", 512), ("Q6_K", 512)])
def test_repack_is_bit_identical_to_gguf(type_name, k):
    data = gguf_tensor(type_name, 24, k)
    packed = repack(data, type_name)
    expected = gguf.quants.dequantize(data, T[type_name]).reshape(24, k)
    assert packed.shape == (24, k)
    assert packed.kind == ("int8" if type_name in ("Q8_0", "Q6_K") else "int4")
    assert packed.group == (16 if type_name == "Q6_K" else 32)
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

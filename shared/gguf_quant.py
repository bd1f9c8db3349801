"""GGUF quantized tensors repacked, without loss, into two layouts (stored next to the model; the
engine tiles them for its kernel at load, engine_worker/model/quant_tiles.py).

A packed weight [N, K] holds groups of ``group`` consecutive inputs of a row, each with an fp32
scale and (optionally) an fp32 min; an element is ``q * scale + min``:

* ``int4``: ``qweight`` uint8 [N, K / 2], group 32, always with mins. Byte i of a group's 16 holds
  element i in its low nibble and element i + 16 in its high nibble (GGUF's Q4_0 order).
  From Q4_0 (min = -8 d), Q4_1 (min = m) and Q4_K (scale = d * sc, min = -dmin * m, per 32).
* ``int8``: ``qweight`` int8 [N, K], group 32 or 16. Without mins: Q8_0 (32), Q6_K (q - 32, per
  16) and Q5_0 (q - 16, per 32). With mins, the 5-bit values 0..31 as stored: Q5_1 (min = m) and
  Q5_K (scale = d * sc, min = -dmin * m, per 32).

``dequantize()`` computes each element as GGUF's own numpy dequantizer does (one rounding, after
an exact product), so it is bit-identical to ``gguf.quants.dequantize`` (up to the sign of zero). numpy only: the converter
runs without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = 1
# The file a converted model keeps its quantized matrices in: safetensors (``load`` reads it), named
# so that no tool globbing *.safetensors takes it for a weight shard of the model (vLLM did).
QUANTIZED_FILE = "gguf_quantized.kaiten"
INT4_GROUP = 32
QK_K = 256


@dataclass(slots=True)
class PackedWeight:
    qweight: np.ndarray            # uint8 [N, K/2] (int4) or int8 [N, K] (int8)
    scales: np.ndarray             # float32 [N, K / group]
    mins: np.ndarray | None        # float32 [N, K / group]; None: symmetric

    @property
    def kind(self) -> str:
        return "int4" if self.qweight.dtype == np.uint8 else "int8"

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.qweight.shape
        return (n, 2 * k) if self.kind == "int4" else (n, k)

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def rows(self, index: np.ndarray) -> "PackedWeight":
        """The rows `index` (a permutation or selection of output features)."""
        return PackedWeight(self.qweight[index], self.scales[index], None if self.mins is None else self.mins[index])

    def int_values(self) -> np.ndarray:
        """The stored integers [N, K] in input order (int8 for int4 too: 0..15)."""
        if self.kind == "int8":
            return self.qweight
        n, k = self.shape
        g = self.qweight.reshape(n, k // INT4_GROUP, 1, INT4_GROUP // 2)
        return ((g >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).astype(np.int8).reshape(n, k)

    def dequantize(self) -> np.ndarray:
        n, k = self.shape
        q = self.int_values().astype(np.float32).reshape(n, -1, self.group)
        w = q * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, k)


def _blocks(data: np.ndarray, nbytes: int) -> np.ndarray:
    """GGUF tensor bytes [N, row bytes] as blocks [N, blocks per row, nbytes]."""
    return np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _from_q4_0(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 18)
    d = _f16(b[..., 0:2])
    return PackedWeight(b[..., 2:].reshape(b.shape[0], -1), d, -8 * d)


def _from_q4_1(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 20)
    return PackedWeight(b[..., 4:].reshape(b.shape[0], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _from_q8_0(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 34)
    return PackedWeight(b[..., 2:].reshape(b.shape[0], -1).view(np.int8), _f16(b[..., 0:2]), None)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (4 bytes, bit j for element j) as 0 or 16 per element."""
    return ((qh[..., :, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(*qh.shape[:-1], 32) << 4


def _q5_values(b: np.ndarray, qh: slice, qs: slice) -> np.ndarray:
    """The 5-bit values 0..31 of Q5_0/Q5_1 blocks [N, blocks, bytes], [N, K] in input order."""
    lo = b[..., qs, None] >> np.array([0, 4], dtype=np.uint8)          # [N, nb, 16, 2]
    lo = (lo & 0x0F).swapaxes(-1, -2).reshape(*b.shape[:2], 32)        # low nibbles: elements 0..15
    return (lo | _fifth_bits(b[..., qh])).reshape(b.shape[0], -1)


def _from_q5_0(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 22)
    return PackedWeight(_q5_values(b, slice(2, 6), slice(6, 22)).astype(np.int8) - 16, _f16(b[..., 0:2]), None)


def _from_q5_1(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 24)
    return PackedWeight(_q5_values(b, slice(4, 8), slice(8, 24)).astype(np.int8), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins packed in a Q4_K block's 12 bytes."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _from_q4_k(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 144)
    n, nb = b.shape[:2]
    sc, mn = _q4_k_scale_min(b[..., 4:16])
    scales = (_f16(b[..., 0:2])[..., None] * sc).reshape(n, -1)
    mins = -(_f16(b[..., 2:4])[..., None] * mn).reshape(n, -1)
    # 32 bytes per pair of sub-blocks: low nibbles the first 32 elements, high nibbles the next 32
    q = b[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return PackedWeight(_pack_nibbles((q & 0x0F).reshape(n, -1)), scales, mins)


def _from_q5_k(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 176)
    n, nb = b.shape[:2]
    sc, mn = _q4_k_scale_min(b[..., 4:16])
    scales = (_f16(b[..., 0:2])[..., None] * sc).reshape(n, -1)
    mins = -(_f16(b[..., 2:4])[..., None] * mn).reshape(n, -1)
    # as Q4_K's nibbles, plus a fifth bit: bit i of byte l is element l of sub-block i
    lo = b[..., 48:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    hi = b[..., 16:48].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = (lo & 0x0F).reshape(n, nb, 8, 32) | ((hi & 1) << 4)
    return PackedWeight(q.astype(np.int8).reshape(n, -1), scales, mins)


def _from_q6_k(data: np.ndarray) -> PackedWeight:
    b = _blocks(data, 210)
    n, nb = b.shape[:2]
    ql, qh = b[..., 0:128], b[..., 128:192]
    scales = (_f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1)
    lo = ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    hi = qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (lo & 0x0F).reshape(n, nb, 2, 4, 32) | ((hi & 0x03) << 4).reshape(n, nb, 2, 4, 32)
    return PackedWeight((q.astype(np.int8) - 32).reshape(n, -1), scales, None)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 [N, K] into the int4 layout (per 32: element i low, element i + 16 high)."""
    g = q.astype(np.uint8).reshape(q.shape[0], -1, 2, INT4_GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(q.shape[0], -1)


REPACKERS = {"Q4_0": _from_q4_0, "Q4_1": _from_q4_1, "Q5_0": _from_q5_0, "Q5_1": _from_q5_1, "Q8_0": _from_q8_0,
             "Q4_K": _from_q4_k, "Q5_K": _from_q5_k, "Q6_K": _from_q6_k}


def repack(data: np.ndarray, type_name: str) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, row bytes], as GGUFReader gives them) repacked."""
    return REPACKERS[type_name](data)


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Weights stacked along N (a fused projection). Parts of different layouts become int8 at the
    finest group among them (int4 values 0..15 fit int8, scales and mins repeat): still lossless."""
    if len({(p.kind, p.group, p.mins is None) for p in parts}) == 1:
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
        return PackedWeight(np.concatenate([p.qweight for p in parts]), np.concatenate([p.scales for p in parts]), mins)
    group = min(p.group for p in parts)

    def widened(p: PackedWeight) -> PackedWeight:
        r = p.group // group
        mins = np.zeros_like(p.scales) if p.mins is None else p.mins
        return PackedWeight(p.int_values(), np.repeat(p.scales, r, axis=1), np.repeat(mins, r, axis=1))

    return concat([widened(p) for p in parts])


def to_tensors(weights: dict[str, PackedWeight]) -> dict[str, np.ndarray]:
    """Safetensors entries: ``<module>.qweight``, ``.scales`` and, where there are mins, ``.mins``
    for each ``<module>.weight`` name."""
    out = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        out[f"{module}.qweight"], out[f"{module}.scales"] = w.qweight, w.scales
        if w.mins is not None:
            out[f"{module}.mins"] = w.mins
    return out


def load(path) -> dict[str, PackedWeight]:
    """The packed weights of a QUANTIZED_FILE written with to_tensors, by ``<module>`` name."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        version = (f.metadata() or {}).get("kaiten_quant_format")
        if version != str(FORMAT_VERSION):
            raise ValueError(f"{path}: quantized format {version!r}, this build reads {FORMAT_VERSION}")
        keys = set(f.keys())
        return {m: PackedWeight(f.get_tensor(f"{m}.qweight"), f.get_tensor(f"{m}.scales"),
                                f.get_tensor(f"{m}.mins") if f"{m}.mins" in keys else None)
                for m in sorted(k.removesuffix(".qweight") for k in keys if k.endswith(".qweight"))}

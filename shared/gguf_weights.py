"""A GGUF file's tensors as a Hugging Face model's weights: ``model.safetensors`` and, for the
matrices stored in a type the engine multiplies as stored, the same matrices repacked without
loss (``shared.gguf_quant``) into the sidecar (gguf_quant.QUANTIZED_FILE).

* F32, F16 and BF16 tensors are written as they are (an F32 file gives an fp32 model equal to the
  one it was made from); every other type is dequantized with ``gguf.quants.dequantize`` and
  rounded to bf16.
* Matrices of a type in ``gguf_quant.REPACKERS`` also go into the sidecar, under their Hugging
  Face module names (``model.layers.0.self_attn.q_proj``; Phi-3's fused ``qkv_proj`` and
  ``gate_up_proj`` stay fused, as Hugging Face's Phi-3 has them; a tied embedding is there as
  ``model.embed_tokens``). Other quantized types (Q2_K, Q3_K, the IQ and TQ types, MXFP4) are
  served from the bf16 copy; one log line names them.
* What llama.cpp's converter did is undone as the family says (``shared.gguf_families``): q/k
  rows un-permuted (a row selection, lossless for quantized rows too), Gemma's norms less the 1
  stored in them.

numpy only: the conversion needs no torch, so the slim image converts too.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from shared.gguf_families import CONFIG_TENSORS, Family, hf_name

log = logging.getLogger("kaiten.convert")

FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# numpy dtypes as safetensors names them; uint16 arrays hold bf16 bits (numpy has no bf16)
_SAFETENSORS_DTYPES = {"uint16": "BF16", "float16": "F16", "float32": "F32", "uint8": "U8", "int8": "I8"}


def model_dtype(tensors) -> str:
    """The config's torch_dtype: the matrices' type where they all have one float type (F32: an
    fp32 model), else bfloat16 (the type the others are dequantized to)."""
    matrices = {t.tensor_type.name for t in tensors if len(t.shape) == 2 and t.name not in CONFIG_TENSORS}
    return FLOAT_TYPES[matrices.pop()] if len(matrices) == 1 and matrices <= FLOAT_TYPES.keys() else "bfloat16"


def unpermute_qk(w, n_heads: int):
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF half-split halves)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, in_features)
             .swapaxes(1, 2)
             .reshape(out_features, in_features))


def _qk_rows(family: Family, config: dict, gguf_name: str, n_rows: int) -> np.ndarray | None:
    """The row order that undoes llama.cpp's q/k permutation (weights and biases), if it did one."""
    if not family.permuted_qk or not gguf_name.startswith("blk."):
        return None
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(gguf_name.split(".")[2])
    return None if heads is None else unpermute_qk(np.arange(n_rows)[:, None], heads)[:, 0]


def _values(t) -> np.ndarray:
    """A tensor as model.safetensors stores it, in Hugging Face's shape: float types as they are
    (bf16 as its bits), others dequantized and rounded to bf16."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))     # GGUF lists dimensions innermost first
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        return t.data.reshape(shape)
    if kind == "BF16":
        return t.data.view(np.uint16).reshape(shape)
    return bf16_bits(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))


def _minus_one(a: np.ndarray) -> np.ndarray:
    """Gemma's norm weight from the w + 1 llama.cpp stores, in fp32 and back to a's type. Not w
    itself where w + 1 was rounded, but in fp32, for -0.5 <= w <= 1, the difference is exact, so
    the factor the model multiplies by, 1 + (result), is the 1 + w of the original model."""
    if a.dtype == np.uint16:
        return bf16_bits((a.astype(np.uint32) << 16).view(np.float32) - np.float32(1))
    return (a.astype(np.float32) - np.float32(1)).astype(a.dtype)


def convert_weights(reader, family: Family, config: dict, out_dir: Path) -> None:
    """Write model.safetensors and, where the file has matrices the engine serves as stored,
    gguf_quant.QUANTIZED_FILE."""
    from shared import gguf_quant
    from shared.progress import Progress

    tensors, packed, dequantized = {}, {}, {}
    progress = Progress(log, f"converting {len(reader.tensors)} tensors to model.safetensors", len(reader.tensors))
    for t in reader.tensors:
        progress.advance()
        if t.name in CONFIG_TENSORS:
            continue
        name, kind = hf_name(family, t.name), t.tensor_type.name
        w = _values(t)
        rows = _qk_rows(family, config, t.name, w.shape[0])
        if rows is not None:
            w = w[rows]
        if family.norms_plus_one and t.name.endswith("norm.weight"):
            w = _minus_one(w)
        tensors[name] = w
        if kind in gguf_quant.REPACKERS and w.ndim == 2:
            q = gguf_quant.repack(t.data, kind)
            packed[name] = q if rows is None else q.rows(rows)
        elif kind not in FLOAT_TYPES:
            dequantized[kind] = dequantized.get(kind, 0) + 1
    if dequantized:
        log.warning("%s: served dequantized to bf16, not as stored (the engine multiplies %s as stored)",
                    ", ".join(f"{n} {k} tensors" for k, n in sorted(dequantized.items())),
                    "/".join(gguf_quant.REPACKERS))
    embed = tensors["model.embed_tokens.weight"]
    if embed.shape[1] != config["hidden_size"]:
        raise ValueError(f"embedding shape {tuple(embed.shape)} does not match the metadata")
    save_safetensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    if packed:
        save_safetensors(gguf_quant.to_tensors(packed), out_dir / gguf_quant.QUANTIZED_FILE,
                         metadata={"format": "pt", "kaiten_quant_format": str(gguf_quant.FORMAT_VERSION)})
    progress.finish()


def bf16_bits(w):
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch rounds; NaN stays NaN."""
    bits = w.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(w)
    if nan.any():
        rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (uint16 ones as BF16) in the safetensors format (the header: its 8-byte
    little-endian length, then JSON padded to 8 bytes; then the data, in header order). Written
    here, not with safetensors.numpy, so that converting imports no more than numpy."""
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))

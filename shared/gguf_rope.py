"""RoPE parameters as a Hugging Face config holds them, rebuilt from what llama.cpp's converter
(convert_hf_to_gguf.py) keeps of them in a GGUF file.

* ``{arch}.rope.freq_base``: rope_theta.
* ``{arch}.rope.scaling.type`` linear or yarn, with ``.factor``, ``.original_context_length``,
  ``.yarn_attn_factor``, ``.yarn_beta_fast`` and ``.yarn_beta_slow``: the same rope type.
* llama3 scaling (Llama 3.1/3.2) keeps no metadata at all, only the per-frequency factors it
  produces, as the tensor ``rope_freqs``: ``llama3_parameters`` finds the factor, low/high
  frequency factors and original context that give those factors.
* longrope (Phi-3) keeps its two factor lists as tensors (``rope_factors_long``/``_short``), the
  original context and the attention factor: ``longrope_parameters``.

numpy only, as the rest of the converter.
"""
from __future__ import annotations

import math

import numpy as np


def f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def default_parameters(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


def scaling_from_metadata(meta, arch: str, theta: float) -> dict | None:
    """Linear or yarn parameters from ``{arch}.rope.scaling.*``; None where the file has none."""
    key = f"{arch}.rope.scaling."
    kind = meta.get(key + "type", "none")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": f32(meta.require(key + "factor"))}
    if kind == "yarn":
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": f32(meta.require(key + "factor")),
                  "original_max_position_embeddings": int(meta.require(key + "original_context_length"))}
        for gguf_name, hf_name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                   ("yarn_beta_slow", "beta_slow")):
            if (value := meta.get(key + gguf_name)) is not None:
                params[hf_name] = f32(value)
        return params
    raise ValueError(f"unsupported rope scaling {kind!r} for {arch}")


def longrope_parameters(theta: float, long: np.ndarray, short: np.ndarray, original_context: int,
                        attn_factor: float | None) -> dict:
    """Phi-3's longrope from its factor tensors; the attention factor as llama.cpp computed it (the
    same formula Hugging Face uses when the config has none)."""
    params = {"rope_type": "longrope", "rope_theta": theta,
              "long_factor": [f32(x) for x in long], "short_factor": [f32(x) for x in short],
              "original_max_position_embeddings": original_context}
    if attn_factor is not None:
        params["attention_factor"] = f32(attn_factor)
    return params


# llama3 scaling as Meta's and Hugging Face's configs write it: every released Llama 3.1 and 3.2
# uses these two, with the factor (8 or 32) and original context (8192) varying.
_LLAMA3_LOW_HIGH = (1.0, 4.0)


def llama3_parameters(factors: np.ndarray, theta: float, rotary_dim: int) -> dict | None:
    """The llama3 parameters whose frequency factors (as llama.cpp computes them from a Hugging
    Face config) are `factors`; None where every factor is 1 (no scaling).

    llama.cpp's factor for a frequency of wavelength w is 1 above the high-frequency wavelength
    L / high, `factor` below the low one L / low, and 1 / ((1 - s) / factor + s) between them, with
    s = (L / w - low) / (high - low). Only L / low and L / high matter, so low and high are taken as
    Hugging Face's configs have them (1 and 4) and L solved for; anything else is fitted. Each
    candidate is checked by recomputing the factors."""
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    if len(wavelen) != len(factors):
        raise ValueError(f"rope_freqs has {len(factors)} factors, the rotary dimension {rotary_dim} needs {len(wavelen)}")
    for low, high, context in _llama3_candidates(factors, factor, wavelen):
        if np.allclose(_llama3_factors(wavelen, factor, low, high, context), factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": f32(factor), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": context}
    raise ValueError("rope_freqs does not follow llama3 rope scaling; no Hugging Face rope type gives these factors")


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, context: int) -> np.ndarray:
    smooth = (context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, medium))


def _llama3_candidates(factors: np.ndarray, factor: float, wavelen: np.ndarray):
    """(low, high, original context) to try, the usual low and high first."""
    medium = (factors != 1.0) & (factors != factor)
    # the interpolation weight s of each medium frequency, from its factor
    smooth = (factor / factors[medium] - 1) / (factor - 1)
    low, high = _LLAMA3_LOW_HIGH
    if medium.any():
        yield low, high, round(float(np.median(wavelen[medium] * (low + smooth * (high - low)))))
    else:
        # No frequency between the two: any context with the same split of ones and factors
        # gives the same model; the largest power of two below the first scaled wavelength.
        first_scaled = wavelen[factors == factor].min()
        yield low, high, 2 ** int(math.floor(math.log2(first_scaled * (1 - 1e-9))))
    if medium.sum() >= 2:
        # s = a / w - b for a = L / (high - low), b = low / (high - low); with low = 1: L = a / b
        a, minus_b = np.polyfit(1 / wavelen[medium], smooth, 1)
        context = round(a / -minus_b)
        yield 1.0, float(f"{1 + 1 / -minus_b:.6g}"), context

"""Tiny random Hugging Face models of each GGUF family Kaiten converts (shared/gguf_families.py),
with configs that make each family's differences matter, written as GGUF files by llama.cpp's own
converter (tests/support/llama_cpp_source.py). No tests here.

llama.cpp's converter only takes a tokenizer it recognizes: the models get SmolLM2's byte-level
BPE one (49,152 tokens, from the default model), which the families' converters accept (Phi-3's
when tokenizer_config.json names GPT2Tokenizer; Gemma 3's when there is no tokenizer.model). Not
Qwen2's: transformers 5 loads any model_type qwen2 tokenizer as Qwen2Tokenizer, whose own
pre-tokenizer gives llama.cpp an encoding it does not know. Qwen2 gets a tiny SentencePiece
tokenizer instead (its converter tries that first), which Kaiten's converter does not serve: its
weights and config are converted without the tokenizer (convert_model_only).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.support.llama_cpp_source import convert_hf_to_gguf

SEQ_LEN = 96                  # longer than every window and original context below
WINDOW = 16
ORIGINAL_CONTEXT = 64
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2)

# family -> (config class, its arguments beyond _COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)),
    # 6 layers: llama.cpp's pattern of 5 sliding, 1 full; the query scale it assumes (the head dim)
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=32, sliding_window=WINDOW,
                                         query_pre_attn_scalar=32, final_logit_softcapping=30.0, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # rotary dim 8 of 16: four long and four short factors
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, tie_word_embeddings=False, partial_rotary_factor=0.5,
                                original_max_position_embeddings=ORIGINAL_CONTEXT, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "long_factor": [1.0, 1.5, 3.0, 6.5], "short_factor": [1.0, 1.1, 1.2, 1.4]})),
    # layer 3 of 4 is NoPE, the interval llama.cpp hard-codes
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, tie_word_embeddings=True)),
}
# Gemma's norms multiply by 1 + w: zero-centred weights
_ZERO_CENTRED_NORMS = {"gemma3"}
SENTENCEPIECE_FAMILIES = {"qwen2"}
_SPM_CORPUS = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
               "A paged KV cache stores keys and values in blocks. 0123456789\n") * 20


def copy_tokenizer(src: Path, dst: Path, family: str) -> int:
    """SmolLM2's tokenizer files into `dst`; its vocabulary size."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    if family == "phi3":          # llama.cpp's Phi-3 takes a byte-level BPE by this class name only
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    return json.loads((src / "config.json").read_text())["vocab_size"]


def write_sentencepiece(path: Path, vocab_size: int = 384) -> int:
    """A tiny SentencePiece tokenizer.model in `path`; its vocabulary size."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_SPM_CORPUS.splitlines()), model_writer=model,
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return vocab_size


def build_family_model(family: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random fp32 model of `family` saved in `path` with SmolLM2's tokenizer (a tiny SentencePiece
    one for SENTENCEPIECE_FAMILIES)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    if family in SENTENCEPIECE_FAMILIES:
        vocab = write_sentencepiece(path)
    else:
        vocab = copy_tokenizer(tokenizer_dir, path, family)
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides}, vocab_size=vocab,
                                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():     # norms and biases too (init leaves them 1 or 0, which hides mistakes)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
                if family not in _ZERO_CENTRED_NORMS:
                    p.add_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def llama_cpp_gguf(model_dir: Path, out: Path) -> Path:
    """`model_dir` as llama.cpp's convert_hf_to_gguf.py writes it, in F32."""
    return convert_hf_to_gguf(model_dir, out, "f32")


def convert_model_only(gguf_file: Path, out: Path) -> Path:
    """What convert_gguf makes of a file, less the tokenizer: config.json and the weights."""
    from shared import gguf_convert
    from shared.gguf_weights import convert_weights

    out.mkdir(parents=True, exist_ok=True)
    reader = gguf_convert._open_gguf(gguf_file)
    family, config = gguf_convert._model_config(gguf_convert._Meta(reader), reader)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    convert_weights(reader, family, config, out)
    return out


def rewrite_gguf(src: Path, dst: Path, extra: dict | None = None, qtypes: dict[str, str] | None = None) -> Path:
    """`src` again, with metadata `extra` ({key: (value, GGUFValueType)}) added and the tensors named
    in `qtypes` ({GGUF name: type}) requantized from their F32 values: gguf's own quantizer, and
    quantize_q4_k for Q4_K, which gguf lacks."""
    import gguf

    def quantized(t):
        kind = (qtypes or {}).get(t.name)
        if kind is None:
            return None
        values = np.ascontiguousarray(np.asarray(t.data), dtype=np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        return (quantize_q4_k(values) if kind == "Q4_K" else gguf.quants.quantize(values, qtype)), qtype
    return _rewrite(gguf.GGUFReader(str(src)), dst, extra or {}, quantized)


def _rewrite(reader, dst: Path, extra: dict, replace) -> Path:
    """The file `reader` reads, written to `dst` with metadata `extra` added and each tensor t
    replaced by replace(t) where that is not None: values (F32), or (raw blocks, their type)."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in extra.items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        new = replace(t)
        if new is None:
            plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if plain else t.tensor_type)
        elif isinstance(new, tuple):
            w.add_tensor(t.name, new[0], raw_dtype=new[1])
        else:
            w.add_tensor(t.name, np.ascontiguousarray(new, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) as Q4_K blocks, uint8 [n, k / 256 * 144]: per sub-block
    of 32 a 6-bit scale and min of the block's fp16 d and dmin, values 0..15. A plain encoding, not
    llama.cpp's search for the best scales: any valid one does for tests that compare against what
    the blocks decode to."""
    n, k = x.shape
    sub = x.reshape(n, k // 256, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - lo) / 15
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = (-lo.min(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float64), 1e-30)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float64), 1e-30)[..., None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float64)[..., None] * sc
    offset = dmin.astype(np.float64)[..., None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 15).astype(np.uint8)
    # the 12 scale bytes (gguf.quants.Q4_K.get_scale_min's layout)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], axis=-1)
    # 32 bytes per pair of sub-blocks: the first's values in the low nibbles, the second's in the high
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs], axis=-1)
    return blocks.reshape(n, -1)


def dequantized_gguf(src: Path, dst: Path) -> Path:
    """`src` again with every quantized tensor written as F32, its values as gguf's dequantizer
    decodes them: the exact reference of a quantized file."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    quantized = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
                 if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)}
    return _rewrite(reader, dst, {}, lambda t: quantized.get(t.name))

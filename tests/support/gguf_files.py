"""GGUF data for tests (no tests here): random tensors of each quantized type, and the tiny model
written as a GGUF file the way llama.cpp's converter writes one (llama.* metadata, a gpt2-style
tokenizer, q/k rows permuted), with the `gguf` package."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from tests.support.tiny_model import CHAT_TEMPLATE

T = gguf.GGMLQuantizationType
# (type, byte offsets of fp16 fields inside a block): K-quants are filled with random bytes, whose
# fp16 fields are set to ordinary values (random bits would be NaNs and infinities)
K_QUANT_F16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


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


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute: HF's half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, path: Path, pre: str = "gpt-2", qtype: str | None = None,
                     embed_qtype: str | None = None) -> Path:
    """The tiny HF model directory as a GGUF file: F32, or its matrices quantized with gguf's own
    quantizer to `qtype` (the embedding and output layer to `embed_qtype`, if given)."""
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            gname = f"blk.{i}.{layer[module]}.weight"
            if module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, cfg["num_attention_heads"])
            elif module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, cfg["num_key_value_heads"])
        else:
            gname = names[name]
        t = np.ascontiguousarray(t, dtype=np.float32)
        kind = embed_qtype or qtype if gname in ("token_embd.weight", "output.weight") else qtype
        if kind and t.ndim == 2:
            kind = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, gguf.quants.quantize(t, kind), raw_dtype=kind)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""A tiny random Llama-family model and a tiny BPE tokenizer, built in seconds for tests.

The tokenizer mirrors SmolLM2's layout: byte-level BPE, ChatML chat template, and the special
tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (eos).
"""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. Paris is the capital of France.
A paged KV cache stores keys and values in fixed-size blocks. Continuous batching admits
new requests at every decode step. Hello world! How are you today? I am fine, thank you.
Redis streams carry requests; pub/sub carries tokens back to the gateway. 0123456789
Émilie aime le café. 東京は日本の首都です。 Ünïcödé ✓ emoji 🙂 tests the byte fallback.
""" * 4


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 384,
                     tie_word_embeddings: bool = False, max_position_embeddings: int = 512,
                     dtype: str = "float32") -> Path:
    """Write a random model directory (config.json, model.safetensors, tokenizer files) to `path`,
    its weights stored in `dtype` (float32 or bfloat16)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # A wide init spreads the logits, so greedy argmax is not decided by rounding noise.
        initializer_range=0.2,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms catch missing weights
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _family_config(family: str, common: dict):
    """A tiny config of `family` whose differences from Llama matter on the tests' prompts (up to
    150 tokens, 24 generated): windows shorter than them, rope scaling whose original context is,
    NoPE layers, partial rotary, a head_dim apart from hidden_size / heads."""
    import transformers

    if family == "llama3":          # Llama 3.1/3.2: llama3 rope scaling, tied embeddings
        return transformers.LlamaConfig(**common | {"tie_word_embeddings": True}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    if family == "llama-linear":
        return transformers.LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 4.0})
    if family == "llama-yarn":
        return transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    if family == "mistral":         # a window on every layer
        return transformers.MistralConfig(**common, sliding_window=24)
    if family == "qwen2":           # q/k/v biases; the second layer slides
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    if family == "qwen3":           # q/k norms, head_dim 32 with 4 heads of a 64 hidden size
        return transformers.Qwen3Config(**common, head_dim=32)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **common | {"rope_theta": 1e6}, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    if family == "phi3":            # partial rotary, LongRoPE from a 64-token original context
        rotary_half = int(16 * 0.5) // 2
        return transformers.Phi3Config(**common, partial_rotary_factor=0.5, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)]}, original_max_position_embeddings=64)
    if family == "smollm3":         # the second layer has no rotary embedding
        return transformers.SmolLM3Config(**common, no_rope_layers=[1, 0])
    raise ValueError(family)


FAMILIES = ("llama3", "llama-linear", "llama-yarn", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "smollm3")


def build_tiny_family(path: str | Path, family: str, seed: int = 0) -> Path:
    """A tiny random model of one of FAMILIES, fp32, with the tests' tokenizer."""
    import torch
    import transformers

    path = Path(path)
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2)
    config = _family_config(family, common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:     # Gemma's norms scale by 1 + w: small offsets either way
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(base_dir: str | Path, path: str | Path, rank: int = 8, targets=tuple(LORA_TARGETS),
                       seed: int = 0, base_model=None, **lora_kw) -> Path:
    """A PEFT LoRA adapter of `base_dir` (or of the HF model `base_model`) with random non-zero
    weights (init_lora_weights=False), saved with save_pretrained to `path`."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = base_model or transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, **lora_kw)
    get_peft_model(model, config).save_pretrained(path)
    return Path(path)

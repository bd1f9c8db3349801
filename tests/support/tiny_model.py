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

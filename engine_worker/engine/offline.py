"""The offline API: `LLM(model_dir).generate(prompts, params)`, and `kaiten generate`."""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from dataclasses import dataclass, field

from engine_worker.engine.llm_engine import LLMEngine, RequestOutput
from engine_worker.engine.sampling_params import SamplingParams
from engine_worker.kv_store.redis_store import attach_kv_store
from shared.config import EngineConfig


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    def __init__(self, model: str = "", **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, offline=True).with_overrides(**engine_args))
        attach_kv_store(self.engine)
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.config.model)
        return self._tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A text prompt's ids with the tokenizer's special tokens (Gemma's and Llama 3's BOS), as
        vLLM's LLM and its completions API encode a prompt; token ids as given."""
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=True)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return self.generate([list(ids)], params)[0]

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, lora_name: str = "") -> str:
        """Queue one request for the next step(), through the LoRA adapter `lora_name` ("": none).
        Returns its request id; ValueError if invalid."""
        request_id = f"offline-{next(self._ids)}"
        self.engine.add_request(request_id, self.encode(prompt), params or SamplingParams(), lora_name=lora_name)
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine step: the streaming API (each output carries that step's new tokens)."""
        return self.engine.step()

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora_names: list[str] | None = None) -> list[Completion]:
        """Run every prompt to completion (prompt i through the adapter lora_names[i], "" for
        none); results come back in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora_names if lora_names is not None else [""] * len(prompts)
        if len(params_list) != len(prompts) or len(loras) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt, and one adapter name per prompt")
        encoded = [self.encode(p) for p in prompts]
        ids = [self.submit(p, sp, lora) for p, sp, lora in zip(encoded, params_list, loras)]
        results = {rid: Completion(rid, p) for rid, p in zip(ids, encoded)}
        while any(results[r].finish_reason is None for r in ids):
            for out in self.step():
                if out.request_id in results:
                    _accumulate(results[out.request_id], out)
        for c in results.values():
            c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return [results[r] for r in ids]


def _accumulate(c: Completion, out: RequestOutput) -> None:
    c.token_ids.extend(out.new_token_ids)
    if out.new_logprobs:
        c.logprobs.extend(out.new_logprobs)
    if out.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        c.finish_reason, c.error, c.stop_reason = out.finish_reason, out.error, out.stop_reason
        c.num_cached_tokens, c.metrics = out.num_cached_tokens, out.metrics


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kaiten generate", description="Generate offline with the engine.")
    ap.add_argument("prompt", nargs="+", help="chat messages from the user, one request each")
    ap.add_argument("--model", default=os.environ.get("KAITEN_MODEL", ""),
                    help="a model directory, a GGUF file or a Hugging Face repo id in the local cache "
                         "(env KAITEN_MODEL; default: the default SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KAITEN_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from shared.model_source import MODEL_ERRORS
    try:
        llm = LLM(args.model, dtype=args.dtype)
    except MODEL_ERRORS as e:
        print(f"kaiten generate: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for prompt in args.prompt:
        out = llm.chat([{"role": "user", "content": prompt}], params)
        print(f">>> {prompt}\n{out.text}\n")
    return 0

"""Fixtures of the cluster tests: the uninterrupted run that the failover tests compare streams with."""
from __future__ import annotations

import pytest

from tests.support.engine_cluster import CHAT, CHAT_TOKENS, N_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The uninterrupted greedy texts (the offline engine)."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    texts = [c.text for c in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_TOKENS,
                                                                  ignore_eos=True))]
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=CHAT_TOKENS, ignore_eos=True)).text
    return {"texts": texts, "chat": chat}

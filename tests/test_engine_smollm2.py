"""The engine on the real default model, SmolLM2-135M-Instruct (converted from its GGUF)."""
import pytest

from engine_worker import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm2_dir():
    from shared.gguf_convert import ensure_default_model
    return str(ensure_default_model())


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="auto", kv_cache_memory="256MiB")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length")
    # A batch of different chats alongside does not change the answer.
    others = [[{"role": "user", "content": q}] for q in ("Name a colour.", "Count to five.", "Say hello.")]
    batch = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
             for m in [question] + others]
    outs = llm.generate([list(ids) for ids in batch], SamplingParams(temperature=0, max_tokens=32))
    assert outs[0].token_ids == out.token_ids
    llm.engine.check_block_accounting()

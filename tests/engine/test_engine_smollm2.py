"""The engine on the real default model, SmolLM2-135M-Instruct (converted from its GGUF)."""
import pytest

from engine_worker import LLM, SamplingParams
from engine_worker.model import quant_layers


@pytest.fixture(scope="module")
def smollm2_dir():
    from shared.gguf_convert import ensure_default_model
    return str(ensure_default_model())


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2_dir):
    """fp32, the dtype the HF-equality tests use, with the projections' activations exact. The chat
    answer's first token is a near tie ('The' vs 'L', 0.1 nats apart in fp32), so this is not
    asserted in bf16, nor with int8 activations (fp32's default in every row where the build has
    them), where rounding may flip it: llama-server answers "L'Étoile, ..." from the same Q4_1 file.
    The next test checks the serving defaults on a prompt with a clear answer."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_layers, "INT8_ROWS", {})
        llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory="256MiB")
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


@pytest.mark.slow
def test_smollm2_serving_dtype_completes_paris(smollm2_dir):
    """dtype auto (bf16 on CPUs with native bf16): ' Paris' leads ' the' by about 2.4 nats here."""
    llm = LLM(smollm2_dir, dtype="auto", kv_cache_memory="256MiB")
    outs = llm.generate(["The capital of France is"] * 3, SamplingParams(temperature=0, max_tokens=4))
    assert all(o.text.startswith(" Paris") for o in outs), [o.text for o in outs]
    llm.engine.check_block_accounting()

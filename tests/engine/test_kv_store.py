"""The shared KV store with in-process engines (the tiny model, fp32) and a real Redis: a prefix
computed on one engine is loaded on another with greedy output unchanged; whatever the store holds
or does (nothing, another layout's values, corrupt values, too little memory, down), outputs never
change and no request is lost."""
from __future__ import annotations

import os
import random

import pytest
import redis

from engine_worker.engine.llm_engine import LLMEngine
from engine_worker.engine.sampling_params import SamplingParams
from engine_worker.kv_store.redis_store import RedisKVStore
from shared.block_hash import prefix_block_hashes
from tests.support.engine_support import engine_config

pytestmark = pytest.mark.timeout(180)

CHUNK_TOKENS = 32                      # 2 blocks: the tiny model's KV is too small for the measured chunk


def prompts(n: int = 3, shared: int = 200, own: int = 30, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 384) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 384) for _ in range(own + 7 * i)] for i in range(n)]


def make_engine(model_dir, url: str | None, queue_chunks: int = 64, **kw) -> LLMEngine:
    kw.setdefault("attention_backend", os.environ.get("KAITEN_TEST_KV_BACKEND", "auto"))
    engine = LLMEngine(engine_config(model_dir, kv_store_chunk_tokens=CHUNK_TOKENS, **kw))
    if url:
        store = RedisKVStore(url, engine.kv_layout(), queue_chunks=queue_chunks, timeout_s=1.0)
        engine.attach_kv_connector(store, engine.kv_layout())
    return engine


def run(engine: LLMEngine, batch: list[list[int]], max_tokens: int = 12) -> dict[str, tuple[list[int], int]]:
    """Greedy outputs and cached prompt tokens, by request id; every request must finish."""
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    cached: dict[str, int] = {}
    for _ in range(10_000):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.finish_reason == "length", o
                cached[o.request_id] = o.num_cached_tokens
        if not engine.has_unfinished():
            break
    engine.check_block_accounting()
    return {rid: (tokens, cached[rid]) for rid, tokens in out.items()}


def close(engine: LLMEngine) -> None:
    """Stop its store's threads after the queued writes (close() is idempotent)."""
    if engine.kv is not None:
        engine.kv.connector.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = make_engine(tiny_model_dir, None)
    return {rid: tokens for rid, (tokens, _) in run(engine, prompts()).items()}


def tokens_of(result) -> dict[str, list[int]]:
    return {rid: tokens for rid, (tokens, _) in result.items()}


def test_a_prefix_computed_on_one_engine_is_loaded_on_another(tiny_model_dir, redis_url, reference):
    a, b = make_engine(tiny_model_dir, redis_url), make_engine(tiny_model_dir, redis_url)
    try:
        assert tokens_of(run(a, prompts())) == reference
        close(a)                               # its queued writes are finished
        assert a.stats().kv_store_saved_chunks > 0
        result = run(b, prompts())
        assert tokens_of(result) == reference
        st = b.stats()
        assert st.kv_store_hit_chunks > 0 and st.kv_store_loaded_tokens >= 192
        assert result["r0"][1] >= 192          # the shared 200-token prefix: 6 chunks of 32 loaded
    finally:
        close(a), close(b)


def corrupt_every_value(url: str) -> int:
    r = redis.Redis.from_url(url)
    keys = r.keys("kaiten:kv:*")
    for key in keys:
        value = bytearray(r.get(key))
        value[-5] ^= 0x40
        r.set(key, bytes(value))
    return len(keys)


@pytest.mark.parametrize("damage", ["flushall", "corrupt", "truncate", "other_layout"])
def test_whatever_the_store_holds_outputs_are_unchanged(tiny_model_dir, redis_url, reference, damage):
    a = make_engine(tiny_model_dir, redis_url)
    run(a, prompts())
    close(a)
    r = redis.Redis.from_url(redis_url)
    keys = r.keys("kaiten:kv:*")
    assert keys
    if damage == "flushall":
        r.flushall()
    elif damage == "corrupt":
        corrupt_every_value(redis_url)
    elif damage == "truncate":
        for key in keys:
            r.set(key, r.get(key)[:-100])
    b_kw = {"kv_cache_dtype": "bfloat16"} if damage == "other_layout" else {}
    b = make_engine(tiny_model_dir, redis_url, **b_kw)
    try:
        if damage == "other_layout":          # a's values under b's keys: another dtype's entries
            prefix_b = f"kaiten:kv:{b.kv_layout().layout_id.hex()}:".encode()
            for key in keys:
                r.rename(key, prefix_b + key.split(b":", 3)[3])
        result = run(b, prompts())
        if damage != "other_layout":
            assert tokens_of(result) == reference
        st = b.stats()
        assert st.kv_store_hit_chunks == 0 and st.kv_store_loaded_tokens == 0
        if damage != "flushall":
            assert st.kv_store_invalid_chunks > 0
    finally:
        close(b)


def test_a_store_that_is_down_or_full_changes_nothing(tiny_model_dir, redis_url, reference):
    r = redis.Redis.from_url(redis_url)
    r.config_set("maxmemory", "64kb")           # below one chunk: every write fails
    r.config_set("maxmemory-policy", "allkeys-lru")
    a = make_engine(tiny_model_dir, redis_url)
    try:
        assert tokens_of(run(a, prompts())) == reference
        close(a)
        st = a.stats()
        assert st.kv_store_errors > 0 and st.kv_store_saved_chunks == 0
    finally:
        r.config_set("maxmemory", "0")
    dead = make_engine(tiny_model_dir, "redis://127.0.0.1:1/0")
    try:
        assert tokens_of(run(dead, prompts())) == reference
        assert dead.stats().kv_store_errors > 0
    finally:
        close(dead)


def test_a_continuation_loads_the_streams_kv_and_computes_at_most_a_chunk(tiny_model_dir, redis_url):
    prompt = prompts(1)[0]
    a = make_engine(tiny_model_dir, redis_url)
    (whole, _), = run(a, [prompt], max_tokens=70).values()
    close(a)                                    # a running sequence's chunks were written as they filled
    b = make_engine(tiny_model_dir, redis_url)
    try:
        delivered = whole[:50]
        b.add_request("cont", prompt + delivered, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                      num_generated=len(delivered))
        got, cached = [], 0
        while b.has_unfinished():
            for o in b.step():
                got += o.new_token_ids
                cached = o.num_cached_tokens
        assert got == whole[50:]
        assert cached >= len(prompt) + len(delivered) - CHUNK_TOKENS
        assert b.stats().kv_store_loaded_tokens == cached
    finally:
        close(b)


def test_a_preempted_sequence_swapped_through_the_store_equals_an_unswapped_run(tiny_model_dir, redis_url):
    batch = prompts(4, shared=0, own=150, seed=3)
    plenty = run(make_engine(tiny_model_dir, None), batch, max_tokens=80)
    small = make_engine(tiny_model_dir, redis_url, kv_cache_memory=str(48 * 8192))   # 48 blocks: 4 x 15+ needed
    try:
        assert tokens_of(run(small, batch, max_tokens=80)) == tokens_of(plenty)
        st = small.stats()
        assert st.num_preemptions > 0 and st.kv_store_loaded_tokens > 0
    finally:
        close(small)


def test_writes_dropped_while_the_queue_is_full_are_made_later(tiny_model_dir, redis_url, reference):
    """The store stalls (writes paused) with a write queue of one chunk: chunks that find it full
    are dropped and counted; once it answers again they are written after a later step, so the
    store ends with every full chunk the engine computed."""
    r = redis.Redis.from_url(redis_url)
    a = make_engine(tiny_model_dir, redis_url, queue_chunks=1)
    batch = prompts()
    for i, p in enumerate(batch):
        a.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    r.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
    try:
        while a.has_unfinished():
            for o in a.step():
                out[o.request_id] += o.new_token_ids
            if a.stats().kv_store_dropped_writes > 0:
                r.execute_command("CLIENT", "UNPAUSE")
        close(a)
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        close(a)
    assert out == reference and a.stats().kv_store_dropped_writes > 0
    bs, per_chunk = a.block_manager.block_size, CHUNK_TOKENS // a.block_manager.block_size
    want = set()
    for p, tokens in zip(batch, out.values()):
        hashes = prefix_block_hashes(p + tokens[:-1], bs)      # the last token sampled is never computed
        want |= {hashes[i - 1] for i in range(per_chunk, len(hashes) + 1, per_chunk)}
    assert {int(k.rsplit(b":", 1)[1], 16) for k in r.keys("kaiten:kv:*")} == want


def test_an_adapter_changed_under_its_name_gets_another_store_name(tmp_path):
    from engine_worker.engine.kv_layout import AdapterIds
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"one")
    ids = AdapterIds(lambda name: str(tmp_path / "a"))
    first = ids("sql")
    assert first.startswith("sql-") and ids("sql") == first and ids("") == ""
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"two")
    assert ids("sql") == first                  # served: its name is kept while it runs
    ids.forget("sql")                           # removed and added again
    assert ids("sql") != first

"""Decode CUDA graphs: capture sizes, padding of a decode batch into the static buffers, the KV
budget arithmetic, and (on a GPU) graph replay against eager execution."""
from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model.cuda_graphs import DecodeGraphRunner, capture_sizes
from engine_worker.model.model_runner import ModelRunner, kv_budget_from_profile
from kernels.interface import AttentionMetadata
from shared.config import EngineConfig


def test_capture_sizes():
    assert capture_sizes(512)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(512)[-1] == 512
    assert all(b - a == 16 for a, b in zip(capture_sizes(512)[4:], capture_sizes(512)[5:]))
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(1) == [1]


def test_kv_budget_from_profile():
    gib = 2**30
    # 80 GiB GPU, 1 GiB used outside torch, 3 GiB torch peak: 0.9 * 80 - 3 - 1 = 68 GiB
    assert kv_budget_from_profile(80 * gib, 76 * gib, 3 * gib, 3 * gib, 0.9) == int(72 * gib) - 4 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(80 * gib, 76 * gib, 0, 0, 1.5)


def _prefill_then_decode_inputs(runner: ModelRunner, lens: list[int]):
    """Prefill sequences of `lens` tokens into scattered blocks; return one decode step's inputs."""
    bs, dev = runner.block_size, runner.device
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(runner.num_blocks, generator=gen).tolist()
    tables, ids, pos, slots = [], [], [], []
    for n in lens:
        table = [perm.pop() for _ in range(n // bs + 1)]          # room for the decode token
        tables.append(table)
        ids += torch.randint(3, runner.model_config.vocab_size, (n,), generator=gen).tolist()
        pos += list(range(n))
        slots += [table[p // bs] * bs + p % bs for p in range(n)]
    width = max(map(len, tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(cu, torch.tensor(lens, dtype=torch.int32), bt, torch.tensor(slots), max(lens),
                             max(lens), lens, lens)
    runner.model(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, meta, runner.backend)
    n = len(lens)
    dec_slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, lens)]
    meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32), torch.tensor([p + 1 for p in lens], dtype=torch.int32),
                             bt, torch.tensor(dec_slots), 1, max(lens) + 1, [1] * n, [p + 1 for p in lens])
    return torch.tensor([7] * n, device=dev), torch.tensor(lens, device=dev), meta


@torch.inference_mode()
def test_padded_decode_batch_matches_the_unpadded_one(tiny_model_dir):
    """What a graph replays, run eagerly on the CPU: the padded batch gives the real rows the
    same hidden states, and the pad rows (slot -1) write nothing to the KV cache."""
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB",
                                      num_threads=1), str(tiny_model_dir))
    assert runner.graphs is None                                 # CPU: eager only
    lens = [5, 17, 33]
    ids, pos, meta = _prefill_then_decode_inputs(runner, lens)
    eager = runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    graphs = DecodeGraphRunner(runner.model, runner.kv_caches, runner.backend, max_batch=8,
                               max_blocks_per_seq=8, max_seqlen_k=128, device=runner.device)
    p_ids, p_pos, p_meta = graphs.fill(ids, pos, meta)
    assert p_ids.shape[0] == graphs.padded_size(3) == 4
    assert p_meta.slot_mapping[3].item() == -1 and p_meta.seqlens_k[3].item() == 0
    padded = runner.model(p_ids, p_pos, runner.kv_caches, p_meta, runner.backend)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)

    written = meta.slot_mapping
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        keep = torch.ones(k0.shape[0] * k0.shape[1], dtype=torch.bool)
        keep[written] = False
        assert torch.equal(k0.flatten(0, 1)[keep], k1.flatten(0, 1)[keep])
        assert torch.equal(v0.flatten(0, 1)[keep], v1.flatten(0, 1)[keep])


def test_block_table_wider_than_captured_is_refused(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB",
                                      num_threads=1), str(tiny_model_dir))
    graphs = DecodeGraphRunner(runner.model, runner.kv_caches, runner.backend, max_batch=4,
                               max_blocks_per_seq=2, max_seqlen_k=32, device=runner.device)
    meta = AttentionMetadata(torch.arange(2, dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                             torch.zeros((1, 3), dtype=torch.int32), torch.tensor([39]), 1, 40)
    with pytest.raises(ValueError, match="exceeds the captured"):
        graphs.fill(torch.tensor([1]), torch.tensor([39]), meta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_cuda_graph_decode_matches_eager(tiny_model_dir, backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    dtype = "float32" if backend == "triton" else "bfloat16"
    prompts = [[1] + list(range(10, 10 + n)) for n in (3, 20, 50, 7, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(tiny_model_dir), dtype=dtype, device="cuda", attention_backend=backend,
                  kv_cache_memory="64MiB", max_num_seqs=8, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]

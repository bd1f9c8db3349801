"""Served (a real engine worker and gateway on Redis): the same request, repeated, gives the same
text alone, after its prefix-cache hits and among 24 concurrent others (docs/deterministic.md)."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.support.engine_support import e2e_worker, wait_until
from tests.support.gateway_support import start_gateway, stream_completion
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

PROMPT = "The capital of France is the city where a paged KV cache keeps its blocks"


async def _texts(client: httpx.AsyncClient, bodies: list[dict]) -> list[str]:
    outs = await asyncio.gather(*(stream_completion(client, b) for b in bodies))
    assert all(o["done"] and not o["errors"] for o in outs), outs
    return [o["text"] for o in outs]


def test_the_same_request_gives_the_same_text_repeated_and_under_load(tiny_model_dir):
    rng = random.Random(5)
    load = [{"prompt": [rng.randrange(3, 384) for _ in range(rng.randrange(2, 90))], "max_tokens": 12,
             "temperature": rng.choice([0, 0.8]), "stream": True} for _ in range(24)]
    watched = [{"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True},
               {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 11, "stream": True}]
    server = RedisServer().start()
    worker = e2e_worker(server.url, tiny_model_dir, "det-w", engine_kw={"num_threads": 2}).start()
    srv = start_gateway(server.url, tiny_model_dir)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, trust_env=False, timeout=120,
                                     limits=httpx.Limits(max_connections=40)) as client:
            alone = [await _texts(client, [b]) for b in watched for _ in range(3)]     # misses, then hits
            loaded = await _texts(client, watched * 2 + load)
        return alone, loaded

    try:
        wait_until(lambda: srv.gw.monitor.live_engines(), 10)
        alone, loaded = asyncio.run(main())
    finally:
        srv.stop()
        worker.stop()
        server.stop()
    greedy, sampled = alone[0][0], alone[3][0]
    assert greedy and sampled
    assert [a[0] for a in alone] == [greedy] * 3 + [sampled] * 3
    assert loaded[:4] == [greedy, sampled, greedy, sampled]

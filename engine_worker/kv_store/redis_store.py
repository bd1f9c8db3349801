"""RedisKVStore: the engine's KV connector on a Redis of its own (``--kv-store-url``: plain,
Sentinel or Cluster, through shared/redis_conn.py), with ``maxmemory`` and ``allkeys-lru``.

Two threads, each with its own connection, keep Redis off the step loop:
- the loader reads a fetch's chunks with pipelined GETs, FETCH_GROUP at a time, and checks each
  (kv_chunk.decode); it stops at the first missing or refused one;
- the saver writes the chunks queued by ``save``; the queue holds at most ``queue_chunks`` and a
  save that finds it full is dropped and counted, so a slow store never stalls a step.
After a store error both give up for DOWN_BACKOFF_S (fetches end as misses, writes are dropped),
so a dead store costs a request a miss, not a timeout each.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace

import redis
import torch

from engine_worker.engine import kv_chunk
from engine_worker.engine.kv_connector import FetchRequest, FetchResult, KVConnector, KVConnectorStats, SaveChunk
from engine_worker.engine.kv_layout import KVLayout
from shared.redis_conn import redact_url, redis_client

log = logging.getLogger("kaiten.kv_store")

FETCH_GROUP = 4
DOWN_BACKOFF_S = 1.0
QUEUE_CHUNKS = 64
DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def chunk_key(layout: KVLayout, adapter: str, block_hash: int) -> str:
    """A chunk's key: the layout (model, dtype, geometry, version), the adapter, its last block's hash."""
    return f"kaiten:kv:{layout.layout_id.hex()}:{adapter}:{block_hash:016x}"


class RedisKVStore(KVConnector):
    def __init__(self, url: str, layout: KVLayout, *, queue_chunks: int = QUEUE_CHUNKS, timeout_s: float = 2.0):
        self.url, self.layout = url, layout
        self.dtype = DTYPES[layout.kv_dtype]
        self._clients = [redis_client(url, retries=0, socket_timeout=timeout_s, socket_connect_timeout=0.5,
                                      client_name=f"kaiten-kv-{role}", max_connections=2) for role in ("load", "save")]
        self._fetches: queue.Queue = queue.Queue()
        self._saves: queue.Queue = queue.Queue(maxsize=queue_chunks)
        self._done: list[FetchResult] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stats = KVConnectorStats()
        self._down_until = [0.0, 0.0]                # loader's, saver's
        self._closed = False
        self._threads = [threading.Thread(target=self._load_loop, daemon=True, name="kaiten-kv-load"),
                         threading.Thread(target=self._save_loop, daemon=True, name="kaiten-kv-save")]
        for t in self._threads:
            t.start()
        log.info("KV store at %s: chunks of %d blocks (%d KiB)", redact_url(url), layout.chunk_blocks,
                 layout.chunk_blocks * layout.block_bytes // 1024)

    # ---- the engine's side (the loop thread) ---------------------------------------------------
    def fetch(self, request: FetchRequest) -> None:
        self._fetches.put(request)

    def done(self) -> list[FetchResult]:
        with self._lock:
            out, self._done = self._done, []
            self._ready.clear()
        return out

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def has_room(self) -> bool:
        return not self._saves.full()

    def save(self, chunk: SaveChunk) -> bool:
        try:
            self._saves.put_nowait(chunk)
            return True
        except queue.Full:
            self._count(dropped_writes=1)
            return False

    def stats(self) -> KVConnectorStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Stop the threads; the writes queued are made first (for at most a few seconds)."""
        if self._closed:
            return
        self._closed = True
        self._fetches.put(None)
        try:
            self._saves.put(None, timeout=2.0)
        except queue.Full:
            pass
        for t in self._threads:
            t.join(5)
        for c in self._clients:
            c.close()

    # ---- the threads -------------------------------------------------------------------------
    def _count(self, **deltas) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _failed(self, which: int, e: Exception) -> None:
        self._count(errors=1)
        if self._down_until[which] < time.monotonic():
            log.warning("KV store %s: %s; %s for %.0f s", redact_url(self.url), e,
                        "loads miss" if which == 0 else "writes are dropped", DOWN_BACKOFF_S)
        self._down_until[which] = time.monotonic() + DOWN_BACKOFF_S

    def _load_loop(self) -> None:
        while (request := self._fetches.get()) is not None:
            t0 = time.perf_counter()
            blocks = sum(len(ref.block_hashes) for ref in request.chunks)
            kv = torch.empty((blocks, *self.layout.block_shape()), dtype=self.dtype)
            n = self._read(request, kv) if time.monotonic() >= self._down_until[0] else 0
            kv = kv[:n * self.layout.chunk_blocks]
            seconds = time.perf_counter() - t0
            self._count(fetches=1, hit_chunks=n, miss_chunks=0 if n == len(request.chunks) else 1,
                        load_seconds=seconds, bytes_loaded=kv.nbytes)
            with self._lock:
                self._done.append(FetchResult(request.ticket, request.first_block, n, kv, seconds))
                self._ready.set()

    def _read(self, request: FetchRequest, kv: torch.Tensor) -> int:
        """Chunks read into `kv`, up to the first missing or refused one."""
        client, C = self._clients[0], self.layout.chunk_blocks
        for start in range(0, len(request.chunks), FETCH_GROUP):
            refs = request.chunks[start:start + FETCH_GROUP]
            try:
                pipe = client.pipeline(transaction=False)
                for ref in refs:
                    pipe.get(chunk_key(self.layout, request.adapter, ref.block_hashes[-1]))
                values = pipe.execute()
            except redis.RedisError as e:
                self._failed(0, e)
                return start
            for i, (ref, value) in enumerate(zip(refs, values)):
                if not kv_chunk.decode(self.layout, ref.block_hashes, ref.token_ids, value,
                                       kv[(start + i) * C:(start + i + 1) * C]):
                    if value is not None:
                        self._count(invalid_chunks=1)
                    return start + i
        return len(request.chunks)

    def _save_loop(self) -> None:
        client = self._clients[1]
        while (chunk := self._saves.get()) is not None:
            if time.monotonic() < self._down_until[1]:
                self._count(dropped_writes=1)
                continue
            t0 = time.perf_counter()
            value = kv_chunk.encode(self.layout, chunk.chunk.block_hashes, chunk.chunk.token_ids,
                                    chunk.payload.reshape(-1).view(torch.uint8).numpy())
            try:
                client.set(chunk_key(self.layout, chunk.adapter, chunk.chunk.block_hashes[-1]), value)
            except redis.RedisError as e:
                self._failed(1, e)
                continue
            self._count(saved_chunks=1, bytes_stored=len(value), store_seconds=time.perf_counter() - t0)


def attach_kv_store(engine) -> RedisKVStore | None:
    """Give `engine` (an LLMEngine) the store its config's kv_store_url names, if any."""
    url = engine.config.kv_store_url
    if not url:
        return None
    layout = engine.kv_layout()
    store = RedisKVStore(url, layout)
    engine.attach_kv_connector(store, layout)
    return store

"""Cache-aware routing: which stream a new request goes to, among the engines of its model.

The gateway hashes the prompt's full blocks (``shared.block_hash``, the prefix cache's own
function, chained from the request's LoRA adapter's root) and counts, for each live engine of the
request's model that accepts work, how many leading blocks it holds:
what its last block list said (``EngineMonitor``) plus what this gateway learned since (``_Sent``):
the prompts it routed there, so a burst before the next heartbeat sees its own effect, and the
prompt and output of each request that finished there, so a chat's next turn finds its history. Then, in the manner of
SGLang's router:

- ``no_hit``: the best engine holds less than ``cache_threshold`` of the prompt: the model's shared
  stream, where any of its engines with room takes it (the queue, as without routing); where the
  engines share a KV store, the least loaded engine's own stream (see ``_unrouted``).
- ``load_spill``: the best engine (most blocks; the least loaded among equals) is busier than the
  least loaded engine by more than ``balance_abs_threshold`` requests and ``balance_rel_threshold``
  times: the least loaded engine's own stream.
- ``store_spill``: the engines share a KV store (their heartbeats say ``kv_store``), the prompt's
  blocks the best engine holds are held by the least loaded one or by the store (a block in a
  store-sharing engine's published list, or of a request that finished there, was computed, so
  written), and the best engine is busier by more than
  ``store_balance_threshold`` requests: the least loaded engine's own stream. There the prefix
  costs a load, not a prefill, so placement spreads load instead of piling it on one cache.
- ``prefix_hit``: else the best engine's own stream.
- ``fallback``: routing is off (``--routing queue``), no engine reports its blocks, or none is live.

A request for a LoRA adapter never goes to the shared stream (an engine without the adapter could
take it): only engines that announce the adapter are candidates, and where the rule above says
the shared stream, the least loaded of them gets it. With none, the decision has no stream.

Load is an engine's running + waiting requests from its heartbeat plus those this gateway sent it
since. A request routed to an engine that dies, drains or does not admit it within
``spill_timeout`` is moved by the watchdog (router.py) like any failover.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shared import names
from shared.block_hash import prefix_block_hashes

from .engines import EngineInfo, EngineMonitor

ROUTING_POLICIES = ("prefix", "queue")
REASONS = ("prefix_hit", "load_spill", "store_spill", "no_hit", "fallback")
STORE_BALANCE_THRESHOLD = 1         # requests: spill to a store-sharing engine past this imbalance
MAX_SENT_HASHES = 65_536            # per engine: optimistic knowledge is bounded


@dataclass(slots=True)
class Decision:
    stream: str
    engine_id: str | None            # None: the shared stream
    reason: str
    hit_blocks: int = 0


@dataclass(slots=True)
class _Sent:
    """What this gateway knows of one engine that its block list and heartbeat may not show yet:
    the requests it routed there, and the blocks those (and finished requests) left in its cache."""
    requests: deque = field(default_factory=deque)           # time.monotonic() of each routed request
    batches: deque = field(default_factory=deque)            # (time.monotonic(), block hashes, routed)
    hashes: dict[int, float] = field(default_factory=dict)   # block hash -> when last learned
    computed: dict[int, float] = field(default_factory=dict) # those of finished requests: computed there

    def add(self, t: float, hashes: list[int], routed: bool) -> None:
        if routed:
            self.requests.append(t)
        if len(self.hashes) + len(hashes) > MAX_SENT_HASHES:
            return
        self.batches.append((t, hashes, routed))
        for h in hashes:
            self.hashes[h] = t
            if not routed:
                self.computed[h] = t

    def forget_before(self, t: float) -> None:
        while self.requests and self.requests[0] < t:
            self.requests.popleft()
        while self.batches and self.batches[0][0] < t:
            _, hashes, _ = self.batches.popleft()
            for h in hashes:
                if self.hashes.get(h, t) < t:
                    del self.hashes[h]
                if self.computed.get(h, t) < t:
                    del self.computed[h]


class Placer:
    def __init__(self, monitor: EngineMonitor, policy: str = "prefix", cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 8, balance_rel_threshold: float = 1.5,
                 liveness_timeout: float = 1.5):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.monitor = monitor
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.liveness_timeout = liveness_timeout
        self._sent: dict[str, _Sent] = {}

    def place(self, prompt_ids: list[int], engines: list[EngineInfo], shared_stream: str, lora_name: str = "",
              now: float | None = None) -> Decision:
        """Where a request of a model goes: `engines` are the model's (EngineMonitor.view), and
        `shared_stream` its stream that any of them reads."""
        now = time.monotonic() if now is None else now
        live = self._live(engines, now, lora_name)
        engines = self._one_block_size(live) if self.policy == "prefix" else []
        if not engines:
            return self._unrouted(live, shared_stream, lora_name, now, "fallback")
        block_size = int(engines[0].get("block_size"))
        # The engine never serves a prompt's last token from its cache: neither do we count it.
        hashes = prefix_block_hashes(prompt_ids, block_size, (len(prompt_ids) - 1) // block_size, lora_name)
        loads = {e.engine_id: self._load(e, now) for e in engines}
        hits = {e.engine_id: self._hit_blocks(e, hashes) for e in engines}
        best = max(engines, key=lambda e: (hits[e.engine_id], -loads[e.engine_id]))
        best_hit = hits[best.engine_id]
        if not hashes or best_hit * block_size < self.cache_threshold * len(prompt_ids):
            return self._unrouted(engines, shared_stream, lora_name, now, "no_hit", hashes, best_hit)
        least = min(engines, key=lambda e: loads[e.engine_id])
        lo, hi = loads[least.engine_id], loads[best.engine_id]
        if hi > lo + self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self._send(least, hashes, now, "load_spill", hits[least.engine_id])
        if hi > lo + STORE_BALANCE_THRESHOLD and self._in_store(least, engines, hits, hashes) >= best_hit:
            return self._send(least, hashes, now, "store_spill", hits[least.engine_id])
        return self._send(best, hashes, now, "prefix_hit", best_hit)

    def _in_store(self, engine: EngineInfo, engines: list[EngineInfo], hits: dict[str, int], hashes: list[int]) -> int:
        """Leading blocks `engine` has or can load: its own, or those a store-sharing engine
        computed, so wrote: in its published list, or of a request that finished there since (a
        chat's history, before the next block list says so). Blocks only sent to an engine are not
        in the store yet: a burst on a new prefix waits for the one engine computing it."""
        if not engine.get("kv_store"):
            return hits[engine.engine_id]
        stored = 0
        for e in engines:
            if e.get("kv_store"):
                sent = self._sent.get(e.engine_id)
                computed = sent.computed if sent is not None else {}
                stored = max(stored, next((i for i, h in enumerate(hashes) if h not in e.blocks and h not in computed),
                                          len(hashes)))
        return max(hits[engine.engine_id], stored)

    def _unrouted(self, engines: list[EngineInfo], shared_stream: str, lora_name: str, now: float, reason: str,
                  hashes: list[int] = (), hit: int = 0) -> Decision:
        """No engine's cache decides: the shared stream, or for an adapter its least loaded engine.
        Engines sharing a KV store: the least loaded one too, so this gateway knows where the new
        prefix is being computed and sends the requests that share it there, not to engines that
        would compute it again at the same time (they load it once it is written)."""
        store = bool(hashes) and reason == "no_hit" and all(e.get("kv_store") for e in engines)
        if not lora_name and not store:
            return Decision(shared_stream, None, reason, hit)
        if not engines:
            return Decision("", None, reason)
        least = min(engines, key=lambda e: self._load(e, now))
        return self._send(least, list(hashes), now, reason, 0)

    def _live(self, engines: list[EngineInfo], now: float, lora_name: str) -> list[EngineInfo]:
        """The engines that are alive, accept work and hold the adapter (if one is asked for)."""
        out = []
        for e in engines:
            if not e.heartbeat or now - e.last_alive > self.liveness_timeout or not e.get("accepting", True):
                continue
            if lora_name and lora_name not in (e.heartbeat.get("adapters") or {}):
                continue
            out.append(e)
        return out

    @staticmethod
    def _one_block_size(live: list[EngineInfo]) -> list[EngineInfo]:
        """Those that report their blocks, if all of one block size."""
        live = [e for e in live if e.get("block_size") and e.blocks_version is not None]
        sizes = {int(e.get("block_size")) for e in live}
        return live if len(sizes) == 1 else []

    def _sent_to(self, engine: EngineInfo, now: float) -> _Sent:
        sent = self._sent.setdefault(engine.engine_id, _Sent())
        # What was sent a heartbeat interval (plus a poll) before the latest reading is in it.
        interval = float(engine.get("heartbeat_interval", 0.5)) + self.monitor.poll_interval
        sent.forget_before(min(engine.last_alive, engine.blocks_seen or engine.last_alive) - interval)
        return sent

    def _load(self, engine: EngineInfo, now: float) -> float:
        sent = self._sent_to(engine, now)
        return int(engine.get("num_running")) + int(engine.get("num_waiting")) + len(sent.requests)

    def _hit_blocks(self, engine: EngineInfo, hashes: list[int]) -> int:
        held, sent = engine.blocks, self._sent.get(engine.engine_id)
        extra = sent.hashes if sent is not None else {}
        n = 0
        for h in hashes:
            if h not in held and h not in extra:
                break
            n += 1
        return n

    def _send(self, engine: EngineInfo, hashes: list[int], now: float, reason: str, hit: int) -> Decision:
        self._sent.setdefault(engine.engine_id, _Sent()).add(now, hashes, routed=True)
        return Decision(names.engine_stream(engine.engine_id), engine.engine_id, reason, hit)

    def learned(self, engine_id: str | None, token_ids: list[int], lora_name: str = "",
                now: float | None = None) -> None:
        """A request finished on `engine_id`: its prompt and output are in that engine's cache now (the
        next turn of a chat resends them), before its next block list says so."""
        engine = self.monitor.engines.get(engine_id) if engine_id else None
        if self.policy != "prefix" or engine is None or not engine.get("block_size"):
            return
        hashes = prefix_block_hashes(token_ids, int(engine.get("block_size")), lora_name=lora_name)
        self._sent.setdefault(engine_id, _Sent()).add(time.monotonic() if now is None else now, hashes, routed=False)

    def forget(self, engine_ids: set[str]) -> None:
        """Drop what was sent to engines no longer known."""
        for engine_id in [e for e in self._sent if e not in engine_ids]:
            del self._sent[engine_id]

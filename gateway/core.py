"""The gateway's state: Redis clients, the reply router, the engine monitor, submission and aborts.

Liveness: while it runs, the gateway keeps ``names.gateway_alive_key(gateway_id)`` set with a TTL
of ``GATEWAY_ALIVE_TTL_S`` (refreshed every third of it by gateway/backend/alive.py's thread, and SET in the
same pipeline as every XADD), and deletes it on a clean stop; engines abort the requests of a
gateway whose key is gone.
Its Redis commands share a bounded pool (``redis_max_connections``): under load they wait for a
free connection instead of opening more.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from shared import names
from shared.config import GatewayConfig
from shared.generation_defaults import load_generation_defaults
from shared.protocol import Abort, GenerateRequest, encode

from .api.errors import APIError
from .api.openai_api import ModelContext, ParsedRequest
from .backend.alive import AliveKey
from .backend.engines import EngineMonitor
from .backend.failover import Failover
from .backend.generation import SubGeneration, SubRequest
from .backend.output import OutputProcessor, RequestState, StopChecker
from .backend.placement import Placer
from .backend.router import ReplyRouter
from .metrics import GatewayMetrics

log = logging.getLogger("kaiten.gateway")

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_model_dir(model: str) -> str:
    """--model as a directory: a directory, a GGUF file (converted once), a cached HF repo id, or ""
    for the default model (shared.model_source)."""
    from shared.model_source import resolve_model
    return str(resolve_model(model))


def load_chat_template(value: str) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM's rule)."""
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _model_config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def bounded_redis(url: str, max_connections: int, client_name: str, wait_s: float = 10.0):
    """An asyncio Redis client on a BlockingConnectionPool: at most `max_connections` connections;
    a command that finds them all busy waits (up to `wait_s`) for one to be released."""
    from shared.redis_conn import async_redis_client
    return async_redis_client(url, client_name=client_name, max_connections=max_connections, pool_wait_s=wait_s)


class Gateway:
    def __init__(self, config: GatewayConfig, gateway_id: str | None = None, redis_client: Any = None):
        if config.max_failovers < 0 or config.failover_timeout <= 0 or config.redis_grace < 0:
            raise ValueError("max_failovers and redis_grace must be >= 0 and failover_timeout > 0, got "
                             f"{config.max_failovers!r}, {config.redis_grace!r} and {config.failover_timeout!r}")
        self.config = config
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:16]}"
        self.alive_key = names.gateway_alive_key(self.gateway_id)
        self.model_dir = resolve_model_dir(config.model)
        self.served_model_name = config.served_model_name or (Path(self.model_dir).name if self.model_dir else "model")
        self.model_names = [self.served_model_name]
        dir_name = Path(self.model_dir).name if self.model_dir else ""
        if dir_name and dir_name not in self.model_names:
            self.model_names.append(dir_name)
        cfg = _model_config(self.model_dir) if self.model_dir else {}
        self._cfg_max_len = int(cfg.get("max_position_embeddings") or 0) or None
        self._cfg_vocab = int(cfg.get("vocab_size") or 0) or None
        self.chat_template = load_chat_template(config.chat_template)
        self.generation_defaults = load_generation_defaults(self.model_dir, config.generation_config)
        self.metrics = GatewayMetrics(self.served_model_name)
        # Generated tokens are always detokenized here, in-process; prompts go through `tokenizer`
        # (the same tokenizer, or the tokenizer service when config.tokenizer_url is set).
        from tokenizer_service import ChatTokenizer, make_tokenizer
        self.text_tokenizer = ChatTokenizer.from_pretrained(self.model_dir)
        self.tokenizer = make_tokenizer(self.model_dir, config.tokenizer_url, self.text_tokenizer)
        self.redis = redis_client
        self._own_redis = redis_client is None
        self.sub_redis = None
        self.monitor: EngineMonitor | None = None
        self.placer: Placer | None = None
        self.router: ReplyRouter | None = None
        self.failover: Failover | None = None
        self.alive: AliveKey | None = None
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self.started_at = time.time()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        from shared.redis_conn import async_redis_client
        try:
            await asyncio.wait_for(self.tokenizer.start(), 10.0)
        except Exception as e:      # the tokenizer service may come up later
            log.warning("tokenizer not ready yet: %s: %s", type(e).__name__, e)
        if self.redis is None:
            self.redis = bounded_redis(self.config.redis_url, self.config.redis_max_connections,
                                       f"kaiten-gateway-{self.gateway_id}")
        # A dedicated client for the one pub/sub connection: its reads wait with their own timeout
        # (1 s, below socket_timeout); the router PINGs a quiet channel (router.py: a partition that
        # drops packets is noticed within about 7 s, like a reset connection).
        self.sub_redis = async_redis_client(self.config.redis_url, socket_timeout=5.0,
                                            health_check_interval=5, retries=1,
                                            client_name=f"kaiten-gateway-sub-{self.gateway_id}")
        self.monitor = EngineMonitor(self.redis, self.config.engine_timeout)
        self.monitor.on_poll.append(lambda m: self.metrics.update_load(m.load()))
        c = self.config
        self.placer = Placer(self.monitor, c.routing, c.routing_cache_threshold, c.routing_balance_abs_threshold,
                             c.routing_balance_rel_threshold, c.failover_timeout)
        self.monitor.on_poll.append(lambda m: self.placer.forget(set(m.engines)))
        self.router = ReplyRouter(self.sub_redis, self.gateway_id, self.monitor, self.config.engine_timeout,
                                  failover_timeout=self.config.failover_timeout,
                                  spill_timeout=self.config.routing_spill_timeout)
        self.router.on_abort_needed = self.abort_soon
        self.failover = Failover(self.redis, self.gateway_id, self.router, self.config.max_failovers, self.metrics,
                                 self.config.redis_grace)
        self.router.on_move = self.failover.move
        if self.config.redis_grace > 0:          # else a lost reply channel fails what is in flight
            self.router.on_suspend = self.failover.suspend
        self.router.processor = OutputProcessor(self.text_tokenizer, self.metrics, self.router.counters,
                                                finish=self._finished,
                                                fail=self.router.fail, abort=self.abort_soon)
        self.alive = AliveKey(self.config.redis_url, self.gateway_id)
        await asyncio.to_thread(self.alive.set)
        self.alive.start()
        self._tasks = [asyncio.create_task(self.router.run(), name="kaiten-reply-reader"),
                       asyncio.create_task(self.router.watchdog(), name="kaiten-watchdog"),
                       asyncio.create_task(self.monitor.run(), name="kaiten-engine-monitor")]
        # Best effort: be subscribed and know the engines before serving (Redis may be down).
        await self.router.wait_subscribed(timeout=5.0)
        try:
            await asyncio.wait_for(self.monitor.polled.wait(), 2.0)
        except asyncio.TimeoutError:
            pass
        log.info("gateway %s serving %s (reply channel %s)", self.gateway_id, self.served_model_name,
                 self.router.channel)
        log.info("default sampling for unset request fields: %s", self.generation_defaults.describe())

    def _finished(self, s: RequestState) -> None:
        self.router.unregister(s.request_id)
        self.placer.learned(s.engine_id, s.prompt_ids + s.token_ids)

    async def stop(self) -> None:
        if self.router is not None:
            from .api.errors import GenerationError
            self.router.fail_all(lambda: GenerationError(503, "the gateway is shutting down", code="shutdown"))
        if self.failover is not None:
            await self.failover.wait_idle(2.0)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=2.0)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self.router is not None:
            await self.router.close()
        if self.alive is not None:
            await asyncio.to_thread(self.alive.stop)
        if self.redis is not None:
            try:
                await asyncio.wait_for(self.redis.delete(self.alive_key), 2.0)
            except Exception:       # Redis down: the key expires on its own
                pass
        for client, own in ((self.sub_redis, True), (self.redis, self._own_redis)):
            if client is not None and own:
                try:
                    await client.aclose(close_connection_pool=True)
                except Exception:
                    pass
        try:
            await self.tokenizer.aclose()
        except Exception:
            pass

    # ------------------------------------------------------------------ model facts
    def max_model_len(self) -> int:
        n = self.monitor.max_model_len() if self.monitor else None
        if n:
            return n
        if self._cfg_max_len:
            return self._cfg_max_len
        tl = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tl, int) and 0 < tl < 10**7:
            return tl
        return DEFAULT_MAX_MODEL_LEN

    def vocab_size(self) -> int:
        v = self.monitor.vocab_size() if self.monitor else None
        if v:
            return v
        if self._cfg_vocab:
            return self._cfg_vocab
        return int(getattr(self.tokenizer, "vocab_size", 0) or 0) or 2**31

    def model_context(self) -> ModelContext:
        return ModelContext(names=self.model_names, max_model_len=self.max_model_len(),
                            vocab_size=self.vocab_size(), max_n=self.config.max_n, tokenizer=self.tokenizer,
                            chat_template=self.chat_template, defaults=self.generation_defaults)

    def status(self) -> dict[str, Any]:
        load = self.monitor.load()
        return {"model": self.served_model_name, "engines": load["engines"],
                "num_requests_running": load["num_running"],
                "num_requests_waiting": load["num_waiting"] + load["backlog"],
                "kv_cache_usage": round(load["kv_cache_usage"], 4), "gateway_id": self.gateway_id,
                "max_model_len": self.max_model_len(),
                "in_flight": len(self.router.streams),
                "generation_defaults": self.generation_defaults.as_dict()}

    # ------------------------------------------------------------------ admission
    def admit(self, parsed: ParsedRequest) -> None:
        """429/503 before anything is queued when the engines' queues (plus the backlog) are full."""
        mon = self.monitor
        if not mon.live_engines():
            raise APIError(503, "no engine is available to serve requests; try again later",
                           code="no_engine", retry_after=max(1.0, self.config.engine_timeout / 2))
        load = mon.load()
        since = mon.backlog.time
        local = [s for s in self.router.streams.values() if s.first_delta is None and s.submitted > since]
        n_new = parsed.num_choices
        new_tokens = sum(len(p) for p in parsed.prompts) * parsed.n
        waiting = load["num_waiting"] + load["backlog"] + len(local)
        mean_tokens = new_tokens / max(1, n_new)
        waiting_tokens = (load["num_waiting_tokens"] + load["backlog"] * mean_tokens
                          + sum(s.num_prompt_tokens for s in local))
        if waiting + n_new > self.config.max_queued_requests:
            raise APIError(429, f"the server is overloaded: {int(waiting)} requests are waiting "
                                f"(limit {self.config.max_queued_requests}); retry later",
                           code="overloaded", retry_after=1.0)
        if waiting_tokens > 0 and waiting_tokens + new_tokens > self.config.max_queued_tokens:
            raise APIError(429, f"the server is overloaded: {int(waiting_tokens)} prompt tokens are waiting "
                                f"(limit {self.config.max_queued_tokens}); retry later",
                           code="overloaded", retry_after=1.0)

    # ------------------------------------------------------------------ submission
    async def submit(self, parsed: ParsedRequest, request_id: str) -> list[SubGeneration]:
        """Register every choice with the router, then XADD them (one pipeline)."""
        if not await self.router.wait_subscribed():
            raise APIError(503, "the gateway cannot reach Redis (reply channel not subscribed)",
                           code="redis_unavailable", retry_after=1.0)
        now_m, now = time.monotonic(), time.time()
        timeout = self.config.request_timeout
        gens: list[SubGeneration] = []
        payloads = []
        single = parsed.num_choices == 1
        for pi, ids in enumerate(parsed.prompts):
            place = self.placer.place(ids, now_m)          # the n choices of a prompt share its blocks
            self.metrics.routed(place.reason, parsed.n)
            for j in range(parsed.n):
                index = pi * parsed.n + j
                rid = request_id if single else f"{request_id}-{index}"
                sub = SubRequest(index, rid, ids, parsed.sub_params(j), parsed.stop, parsed.prompt_texts[pi])
                opts = parsed.output
                state = RequestState(rid, index, ids, now_m + timeout,
                                     self.text_tokenizer.detokenizer(ids, opts.skip_special_tokens),
                                     StopChecker(parsed.stop, opts.include_stop_str_in_output,
                                                 parsed.params.get("min_tokens", 0)),
                                     want_logprobs=parsed.logprobs is not None, options=opts, submitted=now_m,
                                     params=sub.params, wall_deadline=now + timeout, routed_to=place.engine_id)
                gens.append(SubGeneration(sub, state))
                payloads.append((place.stream, encode(GenerateRequest(rid, self.gateway_id, ids, sub.params,
                                                                      arrival_time=now, deadline=now + timeout))))
        for g in gens:
            self.router.register(g.state)
        try:
            # The liveness key goes first, so an engine never sees a request of a gateway it
            # cannot find. No MAXLEN: a trim could drop entries not served yet; engines XDEL.
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self.alive_key, self.gateway_id, px=int(names.GATEWAY_ALIVE_TTL_S * 1000))
            for stream, data in payloads:
                pipe.xadd(stream, {names.PAYLOAD_FIELD: data})
            await pipe.execute()
        except BaseException as e:      # Redis errors, or the caller cancelled (client gone)
            for g in gens:
                self.router.unregister(g.sub.request_id)
            self.abort_soon([g.sub.request_id for g in gens])   # some may have been queued
            if not isinstance(e, Exception):
                raise
            log.warning("XADD failed: %s: %s", type(e).__name__, e)
            raise APIError(503, f"cannot queue the request: Redis is unavailable ({type(e).__name__})",
                           code="redis_unavailable", retry_after=1.0) from None
        self.metrics.in_flight.set(len(self.router.streams))
        return gens

    def close(self, gens: list[SubGeneration]) -> None:
        """Done with these generations: forget them; abort those the engine may still be running."""
        ids = []
        for g in gens:
            self.router.unregister(g.state.request_id)      # the engine-side id (a continuation's)
            if g.needs_abort:
                g.state.abort_sent = True
                ids.append(g.state.request_id)
        if ids:
            self.abort_soon(ids)
        self.metrics.in_flight.set(len(self.router.streams))

    def abort_soon(self, request_ids: list[str]) -> None:
        """XADD aborts in the background (safe to call from a cancelled task's cleanup)."""
        if not request_ids:
            return
        task = asyncio.get_running_loop().create_task(self.abort(request_ids))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def abort(self, request_ids: list[str]) -> None:
        for attempt in range(3):
            try:
                pipe = self.redis.pipeline(transaction=False)
                for rid in request_ids:
                    pipe.xadd(names.ABORT_STREAM, {names.PAYLOAD_FIELD: encode(Abort(rid, self.gateway_id))},
                              maxlen=names.ABORT_STREAM_MAXLEN, approximate=True)
                await pipe.execute()
                return
            except Exception as e:
                if attempt == 2:
                    log.warning("could not publish %d aborts: %s: %s", len(request_ids), type(e).__name__, e)
                    return
                await asyncio.sleep(0.2 * (attempt + 1))

    # ------------------------------------------------------------------ accounting
    def record(self, gens: list[SubGeneration], error: APIError | None = None) -> None:
        m = self.metrics
        prompts_seen = set()
        for g in gens:
            key = id(g.sub.prompt_ids)
            if key not in prompts_seen:
                prompts_seen.add(key)
                m.prompt_tokens.inc(g.num_prompt_tokens)
            if g.finish_reason is not None:
                m.success(g.finish_reason)
                m.e2e.observe((g.finished_at or time.monotonic()) - g.arrival)
        if error is not None:
            m.error(error.code)

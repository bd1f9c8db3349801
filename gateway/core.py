"""The gateway's state: Redis clients, the reply router, the engine monitor, submission and aborts.

Liveness: while it runs, the gateway keeps ``names.gateway_alive_key(gateway_id)`` set with a TTL
of ``GATEWAY_ALIVE_TTL_S`` (refreshed every third of it by gateway/backend/alive.py's thread, and SET in the
same pipeline as every XADD), and AliveKey deletes it, on its own connection, on a clean stop; engines abort the requests of a
gateway whose key is gone.
Its Redis commands share a bounded pool (``redis_max_connections``): under load they wait for a
free connection instead of opening more.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from shared import names
from shared.config import GatewayConfig
from shared.models_file import load_models_file
from shared.protocol import Abort, GenerateRequest, encode

from .api.errors import APIError
from .api.openai_api import ModelContext, ParsedRequest
from .backend.alive import AliveKey
from .backend.engines import EngineMonitor, load_of
from .backend.failover import Failover
from .backend.generation import SubGeneration, SubRequest
from .backend.output import OutputProcessor, RequestState, StopChecker
from .backend.placement import Placer
from .backend.router import ReplyRouter
from .metrics import GatewayMetrics
from .models import ModelRegistry, ModelSpec, ServedModel, resolve_model_dir

log = logging.getLogger("kaiten.gateway")
# Each step of a shutdown waits at most this long: a close that stalls (a socket's wait_closed
# behind a reader that holds its transport, redis-py#3941) must not keep the process from exiting.
CLOSE_TIMEOUT_S = 5.0
STARTING_RETRY_AFTER_S = 5.0      # Retry-After of a 503 engines_starting: a stage takes seconds


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancels the tasks and waits for them, for at most CLOSE_TIMEOUT_S. The cancellation is
    repeated: one that lands as a task's own timeout fires can be taken for that timeout (a reader
    in get_message(timeout=...)), and the task then runs on."""
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    pending = set(tasks)
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)
    if pending:
        log.warning("shutdown: %s did not stop within %.0f s", ", ".join(t.get_name() for t in pending), CLOSE_TIMEOUT_S)


async def _bounded(what: str, aw) -> None:
    """Awaits a shutdown step for at most CLOSE_TIMEOUT_S; a stall is logged by name, errors ignored."""
    try:
        await asyncio.wait_for(aw, CLOSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        log.warning("shutdown: %s did not finish within %.0f s; going on", what, CLOSE_TIMEOUT_S)
    except Exception:
        pass


def bounded_redis(url: str, max_connections: int, client_name: str, wait_s: float = 10.0):
    """An asyncio Redis client on a BlockingConnectionPool: at most `max_connections` connections;
    a command that finds them all busy waits (up to `wait_s`) for one to be released."""
    from shared.redis_conn import async_redis_client
    return async_redis_client(url, client_name=client_name, max_connections=max_connections, pool_wait_s=wait_s)


def model_specs(config: GatewayConfig) -> list[ModelSpec]:
    """The models configured: --model (with --served-model-name and --chat-template; "" is the
    default model, unless other models are named), each further --model, and those of --models-file."""
    specs = []
    if config.model or not (config.extra_models or config.models_file):
        specs.append(ModelSpec(resolve_model_dir(config.model), config.served_model_name, config.chat_template,
                               tokenizer_url=config.tokenizer_url))
    elif config.served_model_name:
        raise ValueError(f"--served-model-name {config.served_model_name!r} names the first --model, and none is "
                         "given: name the models file's models with its served_model_name")
    specs += [ModelSpec(resolve_model_dir(m)) for m in config.extra_models]
    if config.models_file:
        for entry in load_models_file(config.models_file):
            specs.append(ModelSpec(resolve_model_dir(entry.model), entry.served_model_name, entry.chat_template))
    return specs


class Gateway:
    def __init__(self, config: GatewayConfig, gateway_id: str | None = None, redis_client: Any = None):
        if config.max_failovers < 0 or config.failover_timeout <= 0 or config.redis_grace < 0:
            raise ValueError("max_failovers and redis_grace must be >= 0 and failover_timeout > 0, got "
                             f"{config.max_failovers!r}, {config.redis_grace!r} and {config.failover_timeout!r}")
        self.config = config
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:16]}"
        self.alive_key = names.gateway_alive_key(self.gateway_id)
        self.metrics = GatewayMetrics()
        # Generated tokens are always detokenized here, in-process; prompts go through each model's
        # `tokenizer` (the same tokenizer, or for --model the tokenizer service at config.tokenizer_url).
        # --generation-config names a directory for the first model; auto or vllm holds for every one.
        mode = config.generation_config if config.generation_config in ("auto", "vllm") else "auto"
        self.models = ModelRegistry(self.metrics, mode)
        for i, spec in enumerate(model_specs(config)):
            self.models.add(spec, config.generation_config if i == 0 else None)
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
        await self.models.start()
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
        self.monitor.watched.update(m.name for m in self.models.models.values())
        self.monitor.on_poll.append(self._polled)
        c = self.config
        self.placer = Placer(self.monitor, c.routing, c.routing_cache_threshold, c.routing_balance_abs_threshold,
                             c.routing_balance_rel_threshold, c.failover_timeout)
        self.monitor.on_poll.append(lambda m: self.placer.forget(set(m.engines)))
        self.router = ReplyRouter(self.sub_redis, self.gateway_id, self.monitor, self.config.engine_timeout,
                                  failover_timeout=self.config.failover_timeout,
                                  spill_timeout=self.config.routing_spill_timeout)
        self.router.on_abort_needed = self.abort_soon
        self.failover = Failover(self.redis, self.gateway_id, self.router, self.config.max_failovers,
                                 self.config.redis_grace, target=self.target)
        self.router.on_move = self.failover.move
        if self.config.redis_grace > 0:          # else a lost reply channel fails what is in flight
            self.router.on_suspend = self.failover.suspend
        self.router.processor = OutputProcessor(self.router.counters, finish=self._finished,
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
        log.info("gateway %s serving %s (reply channel %s)", self.gateway_id, ", ".join(self.models.models),
                 self.router.channel)
        for m in self.models.models.values():
            log.info("%s: default sampling for unset request fields: %s", m.name, m.defaults.describe())

    def _polled(self, monitor: EngineMonitor) -> None:
        """After each poll: every model's engines and adapters, and its gauges."""
        self.models.refresh(monitor)
        in_flight: dict[str, int] = {}
        for s in self.router.streams.values() if self.router is not None else ():
            in_flight[s.model.name] = in_flight.get(s.model.name, 0) + 1
        for m in self.models.models.values():
            m.metrics.backlog.set(m.view.backlog.lag)
            m.metrics.in_flight.set(in_flight.get(m.name, 0))

    def _finished(self, s: RequestState) -> None:
        self.router.unregister(s.request_id)
        self.placer.learned(s.engine_id, s.prompt_ids + s.token_ids, s.lora_name)

    async def stop(self) -> None:
        if self.router is not None:
            from .api.errors import GenerationError
            self.router.fail_all(lambda: GenerationError(503, "the gateway is shutting down", code="shutdown"))
        if self.failover is not None:
            await self.failover.wait_idle(2.0)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=2.0)
        await _cancel_all(self._tasks)
        self._tasks = []
        if self.router is not None:
            await _bounded("the reply channel's close", self.router.close())
        if self.alive is not None:
            await asyncio.to_thread(self.alive.stop)
        for client, own in ((self.sub_redis, True), (self.redis, self._own_redis)):
            if client is not None and own:
                await _bounded("a Redis client's close", client.aclose(close_connection_pool=True))
        await _bounded("the models' close", self.models.aclose())

    # ------------------------------------------------------------------ models
    def resolve(self, requested: str | None) -> ModelContext:
        """A request's "model" field: a model, or an adapter of one (404 if neither)."""
        model, lora_name = self.models.resolve(requested)
        return model.context(model.name if requested is None else requested, lora_name, self.config.max_n)

    def status(self) -> dict[str, Any]:
        default = self.models.default
        load = default.view.load or load_of(default.view.live, 0)
        return {"model": default.name, "engines": len(default.view.live),
                "starting": [s.describe() for s in self.monitor.starting_for(default.name)],
                "compiling": [s.describe() for s in self.monitor.compiling_for(default.name)],
                "num_requests_running": load["num_running"],
                "num_requests_waiting": load["num_waiting"] + load["backlog"],
                "kv_cache_usage": round(load["kv_cache_usage"], 4), "gateway_id": self.gateway_id,
                "max_model_len": default.max_model_len(),
                "in_flight": len(self.router.streams),
                "generation_defaults": default.defaults.as_dict(),
                "models": [self._model_status(m) for m in self.models.models.values()]}

    @staticmethod
    def _model_status(m: ServedModel) -> dict[str, Any]:
        load = m.view.load
        return {"model": m.name, "engines": len(m.view.live), "max_model_len": m.max_model_len(),
                "num_requests_running": int(load.get("num_running", 0)),
                "num_requests_waiting": int(load.get("num_waiting", 0) + load.get("backlog", 0)),
                "adapters": sorted(m.view.adapters), "generation_defaults": m.defaults.as_dict()}

    # ------------------------------------------------------------------ admission
    def admit(self, parsed: ParsedRequest) -> None:
        """429/503 before anything is queued: the model has no engine (for an adapter: none that holds
        it), or its engines' queues (plus its stream's backlog) are full."""
        ctx = parsed.ctx
        model: ServedModel = ctx.served
        view = model.view
        retry = max(1.0, self.config.engine_timeout / 2)
        if not view.live and (starting := self.monitor.starting_for(model.name)):
            raise APIError(503, f"the engines of model '{model.name}' are starting ({starting[0].describe()}); "
                                f"try again in a few seconds", code="engines_starting",
                           retry_after=STARTING_RETRY_AFTER_S)
        if not view.live:
            raise APIError(503, f"no engine is available to serve model '{model.name}'; try again later",
                           code="no_engine", retry_after=retry)
        if ctx.lora_name and ctx.lora_name not in view.adapters:
            raise APIError(503, f"no engine holds the adapter '{ctx.lora_name}'; try again later",
                           code="no_engine", retry_after=retry)
        load = view.load
        since = view.backlog.time
        local = [s for s in self.router.streams.values()
                 if s.model is model and s.first_delta is None and s.submitted > since]
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
        model: ServedModel = parsed.ctx.served
        lora_name = parsed.ctx.lora_name
        for pi, ids in enumerate(parsed.prompts):
            # The n choices of a prompt share its blocks.
            place = self.placer.place(ids, model.view.engines, model.stream, lora_name, now_m)
            if not place.stream:
                raise APIError(503, f"no engine holds the adapter '{lora_name}'; try again later",
                               code="no_engine", retry_after=1.0)
            model.metrics.routed(place.reason, parsed.n)
            for j in range(parsed.n):
                index = pi * parsed.n + j
                rid = request_id if single else f"{request_id}-{index}"
                sub = SubRequest(index, rid, ids, parsed.sub_params(j), parsed.stop, parsed.prompt_texts[pi])
                opts = parsed.output
                state = RequestState(rid, index, ids, now_m + timeout,
                                     model.text_tokenizer.detokenizer(ids, opts.skip_special_tokens),
                                     StopChecker(parsed.stop, opts.include_stop_str_in_output,
                                                 parsed.params.get("min_tokens", 0)),
                                     want_logprobs=parsed.logprobs is not None, options=opts, submitted=now_m,
                                     params=sub.params, wall_deadline=now + timeout, routed_to=place.engine_id,
                                     model=model, lora_name=lora_name)
                gens.append(SubGeneration(sub, state))
                payloads.append((place.stream, encode(GenerateRequest(rid, self.gateway_id, ids, sub.params,
                                                                      arrival_time=now, deadline=now + timeout,
                                                                      lora_name=lora_name))))
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
        return gens

    def target(self, s: RequestState) -> str:
        """The stream a moved request goes to: its model's shared stream; for an adapter, the
        least loaded (or best cached) engine holding it ("" if none does)."""
        if not s.lora_name:
            return s.model.stream
        place = self.placer.place(s.prompt_ids + s.token_ids, s.model.view.engines, s.model.stream, s.lora_name)
        s.routed_to = place.engine_id
        return place.stream

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
        m = gens[0].state.model.metrics if gens else self.models.default.metrics
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

    def metrics_of(self, parsed: ParsedRequest | None) -> Any:
        """The series a request counts in (before its model is known: the first model's)."""
        return parsed.ctx.served.metrics if parsed is not None and parsed.ctx is not None \
            else self.models.default.metrics

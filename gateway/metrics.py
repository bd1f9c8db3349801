"""The gateway's Prometheus series (vLLM-style names), on a per-gateway CollectorRegistry.

Request series (histograms, counters) count what THIS gateway served: sum them over gateways.
The queue, prefill and decode times come from the engine's own event times on each request's
terminal delta (one engine clock, so the differences are exact).

Engine series (running, waiting, KV usage, preemptions, prefix cache, step time) are not here:
each engine exports its own, once (engine_worker/metrics.py). The one deployment-wide value a
gateway exports, ``kaiten:request_stream_backlog``, is each gateway's view of a model's Redis
stream: take ``max`` over gateways, never ``sum``. Every series carries ``model_name``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from .backend.placement import REASONS as ROUTING_REASONS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
PHASE_BUCKETS = E2E_BUCKETS                    # queue, prefill and decode times (vLLM uses the same)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

class GatewayMetrics:
    """The gateway's registry and metric families; ``model(name)`` binds them to one model's label."""

    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]
        self.ttft = Histogram("kaiten:time_to_first_token_seconds", "Time to first token (gateway clock).", lbl,
                              registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("kaiten:inter_token_latency_seconds", "Time between token deliveries.", lbl,
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("kaiten:e2e_request_latency_seconds", "Request latency, arrival to last token.", lbl,
                             registry=r, buckets=E2E_BUCKETS)
        self.queue_time = Histogram("kaiten:request_queue_time_seconds",
                                    "Time a request waited in the engine before its first schedule.", lbl,
                                    registry=r, buckets=PHASE_BUCKETS)
        self.prefill_time = Histogram("kaiten:request_prefill_time_seconds",
                                      "First schedule to first token (engine clock).", lbl, registry=r,
                                      buckets=PHASE_BUCKETS)
        self.decode_time = Histogram("kaiten:request_decode_time_seconds", "First token to the last (engine clock).",
                                     lbl, registry=r, buckets=PHASE_BUCKETS)
        self.prompt_len = Histogram("kaiten:request_prompt_tokens", "Prompt length of finished requests.", lbl,
                                    registry=r, buckets=LENGTH_BUCKETS)
        self.output_len = Histogram("kaiten:request_generation_tokens", "Output length of finished requests.", lbl,
                                    registry=r, buckets=LENGTH_BUCKETS)
        self.backlog = Gauge("kaiten:request_stream_backlog",
                             "Requests in the model's stream no engine has read yet (the same on every gateway: "
                             "max).", lbl, registry=r)
        self.in_flight = Gauge("kaiten:gateway_requests_in_flight", "Engine requests this gateway waits on.", lbl,
                               registry=r)
        self.prompt_tokens = Counter("kaiten:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r)
        self.generation_tokens = Counter("kaiten:generation_tokens", "Generated tokens delivered.", lbl, registry=r)
        self.failovers = Counter("kaiten:request_failovers",
                                 "Requests moved to another engine because theirs was lost or shut down.", lbl,
                                 registry=r)
        self.routed = Counter("kaiten:routing_decisions", "Requests routed, by reason (gateway/backend/placement.py).",
                              lbl + ["reason"], registry=r)
        self.success = Counter("kaiten:request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.errors = Counter("kaiten:request_errors", "Requests that ended with an error, by code.",
                              lbl + ["code"], registry=r)
        self.rejected = Counter("kaiten:requests_rejected", "Requests refused before submission, by status.",
                                lbl + ["status"], registry=r)

    def model(self, model_name: str) -> ModelMetrics:
        return ModelMetrics(self, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """The series of one model: each child bound once, so recording costs no label lookup."""

    def __init__(self, families: GatewayMetrics, model_name: str):
        self.families, self.model_name = families, model_name
        f, m = families, model_name
        self.ttft, self.itl, self.e2e = f.ttft.labels(m), f.itl.labels(m), f.e2e.labels(m)
        self.queue_time, self.prefill_time = f.queue_time.labels(m), f.prefill_time.labels(m)
        self.decode_time = f.decode_time.labels(m)
        self.prompt_len, self.output_len = f.prompt_len.labels(m), f.output_len.labels(m)
        self.backlog, self.in_flight = f.backlog.labels(m), f.in_flight.labels(m)
        self.prompt_tokens, self.generation_tokens = f.prompt_tokens.labels(m), f.generation_tokens.labels(m)
        self.failovers = f.failovers.labels(m)
        self._routed = {reason: f.routed.labels(m, reason) for reason in ROUTING_REASONS}

    def routed(self, reason: str, n: int = 1) -> None:
        self._routed[reason].inc(n)

    def success(self, finish_reason: str) -> None:
        self.families.success.labels(self.model_name, finish_reason).inc()

    def error(self, code: str | None) -> None:
        self.families.errors.labels(self.model_name, code or "error").inc()

    def rejected(self, status: int) -> None:
        self.families.rejected.labels(self.model_name, str(status)).inc()

    def finished(self, num_prompt_tokens: int, num_output_tokens: int, times: dict | None) -> None:
        """A request the engine finished: its lengths, and its phases from the engine's event times
        (queued, scheduled, first_token, finished: one engine clock)."""
        self.prompt_len.observe(num_prompt_tokens)
        self.output_len.observe(num_output_tokens)
        t = times or {}
        queued, scheduled, first, done = (float(t.get(k) or 0) for k in ("queued", "scheduled", "first_token",
                                                                          "finished"))
        if queued and scheduled >= queued:
            self.queue_time.observe(scheduled - queued)
        if scheduled and first >= scheduled:
            self.prefill_time.observe(first - scheduled)
        if first and done >= first:
            self.decode_time.observe(done - first)


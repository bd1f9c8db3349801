"""Prometheus metrics with vLLM-style names, on a per-gateway CollectorRegistry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]

        def own(kind, name: str, doc: str, **kw):
            """A metric of this registry, bound to this gateway's model."""
            return kind(name, doc, lbl, registry=r, **kw).labels(model_name)

        self.ttft = own(Histogram, "kaiten:time_to_first_token_seconds", "Time to first token (gateway clock).",
                        buckets=TTFT_BUCKETS)
        self.itl = own(Histogram, "kaiten:inter_token_latency_seconds", "Time between token deliveries.",
                       buckets=ITL_BUCKETS)
        self.e2e = own(Histogram, "kaiten:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                       buckets=E2E_BUCKETS)
        self.running = own(Gauge, "kaiten:num_requests_running", "Requests running on the live engines.")
        self.waiting = own(Gauge, "kaiten:num_requests_waiting", "Requests waiting (engine queues and stream backlog).")
        self.kv_usage = own(Gauge, "kaiten:kv_cache_usage_perc", "Mean KV-cache usage of the live engines (0..1).")
        self.engines = own(Gauge, "kaiten:num_engines", "Live engines (fresh heartbeat).")
        self.prefix_hit = own(Gauge, "kaiten:prefix_cache_hit_rate", "Mean prefix-cache hit rate of the live engines.")
        self.in_flight = own(Gauge, "kaiten:gateway_requests_in_flight", "Engine requests this gateway waits on.")
        self.prompt_tokens = own(Counter, "kaiten:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = own(Counter, "kaiten:generation_tokens", "Generated tokens delivered.")
        self.failovers = own(Counter, "kaiten:request_failovers",
                             "Requests moved to another engine because theirs was lost or shut down.")
        self._success = Counter("kaiten:request_success", "Finished requests by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self._errors = Counter("kaiten:request_errors", "Requests that ended with an error, by code.",
                               lbl + ["code"], registry=r)
        self._rejected = Counter("kaiten:requests_rejected", "Requests refused before submission, by status.",
                                 lbl + ["status"], registry=r)

    def success(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def error(self, code: str | None) -> None:
        self._errors.labels(self.model_name, code or "error").inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def update_load(self, load: dict) -> None:
        self.running.set(load["num_running"])
        self.waiting.set(load["num_waiting"] + load["backlog"])
        self.kv_usage.set(load["kv_cache_usage"])
        self.prefix_hit.set(load["prefix_cache_hit_rate"])
        self.engines.set(load["engines"])

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The engine's own Prometheus series, labelled with its id, served on its own /metrics port.

Each engine exports its series once (gateways export none of them), so ``sum`` over the
``engine`` label is the deployment's total. The loop ``update()``s them from the stats it
already takes every iteration and observes each step. A small HTTP server on a thread of its
own answers ``GET /metrics`` in Prometheus's text format, as the gateways do (prometheus_client's
OpenMetrics output would rename ``kaiten:x`` to ``kaiten_x``).
"""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("kaiten.worker")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.5, 5.0, 10.0, 30.0)
ROUND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# (stats field, metric name, help): gauges set, and counters advanced, from the engine's stats.
GAUGES = (
    ("num_running", "kaiten:num_requests_running", "Requests running on the engine."),
    ("num_waiting", "kaiten:num_requests_waiting", "Requests waiting in the engine's queue."),
    ("kv_cache_usage", "kaiten:kv_cache_usage_perc", "The engine's KV-cache usage (0..1)."),
)
COUNTERS = (
    ("num_preemptions", "kaiten:num_preemptions", "Sequences the engine preempted (recomputed later)."),
    ("prefix_cache_queries", "kaiten:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "kaiten:prefix_cache_hits", "Prompt tokens the prefix cache served."),
    ("spec_decode_num_drafts", "kaiten:spec_decode_num_drafts", "Speculative verifications (a sequence's drafts)."),
    ("spec_decode_num_draft_tokens", "kaiten:spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    ("spec_decode_num_accepted_tokens", "kaiten:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("kv_store_hit_chunks", "kaiten:kv_store_hit_chunks", "KV chunks loaded from the shared store."),
    ("kv_store_miss_chunks", "kaiten:kv_store_misses", "KV store fetches that ended before their last chunk."),
    ("kv_store_invalid_chunks", "kaiten:kv_store_invalid_chunks",
     "KV store values refused: corrupt, partial, or another model's or dtype's (each a miss)."),
    ("kv_store_loaded_tokens", "kaiten:kv_store_loaded_tokens", "Prompt tokens whose KV came from the shared store."),
    ("kv_store_bytes_loaded", "kaiten:kv_store_loaded_bytes", "Bytes of KV read from the shared store."),
    ("kv_store_load_seconds", "kaiten:kv_store_load_seconds", "Time spent reading KV from the shared store."),
    ("kv_store_saved_chunks", "kaiten:kv_store_saved_chunks", "KV chunks written to the shared store."),
    ("kv_store_bytes_stored", "kaiten:kv_store_stored_bytes", "Bytes of KV written to the shared store."),
    ("kv_store_store_seconds", "kaiten:kv_store_store_seconds", "Time spent writing KV to the shared store."),
    ("kv_store_dropped_writes", "kaiten:kv_store_dropped_writes",
     "KV chunk writes dropped: the write queue was full or the store down."),
    ("kv_store_errors", "kaiten:kv_store_errors", "Shared KV store errors (each a miss or a lost write)."),
    ("kv_store_loads_skipped", "kaiten:kv_store_loads_skipped",
     "Loads not asked for: a load measured slower here than computing the prompt."),
)


class WorkerEvents:
    """The worker's event counters (requests admitted, handed back, Redis errors, ...) at scrape time,
    as ``kaiten:engine_worker_events_total{event=...}``."""

    def __init__(self, counters, labels: dict[str, str]):
        self.counters = counters
        self.labels = labels

    def describe(self):
        return []                                # the events vary: unchecked

    def collect(self):
        fam = CounterMetricFamily("kaiten:engine_worker_events", "Worker events by kind (see engine_worker/worker.py).",
                                  labels=[*self.labels, "event"])
        for event, n in sorted(self.counters.snapshot().items()):
            fam.add_metric([*self.labels.values(), event], n)
        yield fam


class MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics: the server's registry, text format. No access log."""

    def do_GET(self):
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        pass


class EngineMetrics:
    def __init__(self, model_name: str, engine_id: str, counters):
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": engine_id}

        def own(kind, name: str, doc: str, **kw):
            return kind(name, doc, list(labels), registry=r, **kw).labels(**labels)

        self.gauges = [(f, own(Gauge, name, doc)) for f, name, doc in GAUGES]
        self.counters = [(f, own(Counter, name, doc)) for f, name, doc in COUNTERS]
        self._last = {f: 0 for f, _ in self.counters}
        self.step_time = own(Histogram, "kaiten:engine_step_duration_seconds", "Wall time of one engine step.",
                             buckets=STEP_BUCKETS)
        self.round_time = own(Histogram, "kaiten:engine_redis_round_seconds",
                              "The per-step Redis round trip (publish tokens, ACK, delete).", buckets=ROUND_BUCKETS)
        self.per_position = Counter("kaiten:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft (0: the first).",
                                    [*labels, "position"], registry=r)
        self._labels, self._last_per_position = labels, []
        r.register(WorkerEvents(counters, labels))
        self._server = None

    def update(self, stats: dict) -> None:
        """(loop) Gauges from the engine's current stats; counters by what the cumulative ones grew."""
        for f, g in self.gauges:
            g.set(stats[f])
        for f, c in self.counters:
            grew = stats[f] - self._last[f]
            if grew > 0:
                c.inc(grew)
                self._last[f] = stats[f]
        per_position = stats.get("spec_decode_accepted_per_position", [])
        self._last_per_position += [0] * (len(per_position) - len(self._last_per_position))
        for pos, (now, last) in enumerate(zip(per_position, self._last_per_position)):
            if now > last:
                self.per_position.labels(**self._labels, position=str(pos)).inc(now - last)
                self._last_per_position[pos] = now

    def serve(self, host: str, port: int) -> None:
        """GET /metrics on host:port (0: not served). A port in use costs only the metrics: logged,
        and the engine serves on (several engines on one host need a port each)."""
        if not port:
            return
        try:
            self._server = ThreadingHTTPServer((host, port), MetricsHandler)
        except OSError as e:
            log.warning("cannot serve /metrics on %s:%d (%s): this engine exports no metrics; give each engine on "
                        "a host its own --metrics-port", host, port, e)
            return
        self._server.daemon_threads = True
        self._server.registry = self.registry
        threading.Thread(target=self._server.serve_forever, daemon=True, name="kaiten-metrics").start()
        log.info("metrics at http://%s:%d/metrics", host, self.port)

    @property
    def port(self) -> int:
        return self._server.server_port if self._server is not None else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

"""The worker's Prometheus metrics: engine load and speed, per-request latencies, cancellation
cost, KV and prefix-cache use, and the worker's Redis I/O (docs/operations.md, "Metrics").

Why this shape (cost grows with steps and requests, never with tokens):
* counters and gauges that already exist as plain numbers (the engine client's load figures,
  the worker's `Stats`, the writer's counts, Redis errors by kind) are read when Prometheus
  scrapes, by a collector: no work at all on the hot path;
* the engine's per-step and per-cancel records arrive in batches (worker.telemetry) and are
  observed by `pump()`, a few times a second;
* per-request latencies are observed once, when a request's final is written
  (`request_finished`), from timestamps its outputs already carry;
* the output writer times each commit (one observation a commit, not a token).

Names follow vLLM's where the concept is the same (`vllm:time_to_first_token_seconds` ->
`worker_time_to_first_token_seconds`), so its dashboards port by a rename. Served by a small
WSGI server in a thread on WORKER_METRICS_PORT, guarded by ADMIN_TOKEN like the gateway's.
"""

from __future__ import annotations

import hmac
import logging
import threading
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from shared.slo_buckets import CANCEL_BUCKETS, GAP_BUCKETS, TTFT_BUCKETS, TTLT_BUCKETS
from worker.events import InFlight
from worker.telemetry import LANES, Telemetry

log = logging.getLogger("worker.metrics")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
GRAMMAR_REFUSALS = ("too_large", "timeout", "invalid")    # worker.engine.grammar_compile.REASONS


class WorkerMetrics:
    def __init__(self, *, sources: Callable[[], dict] | None = None):
        """`sources`: returns the live objects the scrape-time collector reads (`engine`, `stats`,
        `writer_stats`, `redis_errors`, `kv_block_tokens`, `max_batch`, `lease_lapsed`); None for a
        registry without them (the metric names alone, e.g. for dashboard checks)."""
        self.registry = r = CollectorRegistry()
        self.sources = sources
        ProcessCollector(registry=r)
        self.batch_size = Histogram("worker_batch_size", "requests computed in one engine step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("worker_iteration_tokens", "tokens computed in one engine step, by kind "
                                          "(prefill: prompt tokens; decode: decode rows)", ["kind"],
                                          buckets=TOKEN_BUCKETS, registry=r)
        self.step_duration = Histogram("worker_step_duration_seconds", "one engine step's wall time: prefill (it "
                                       "carries prompt tokens) or decode (decode rows only)", ["kind"],
                                       buckets=STEP_BUCKETS, registry=r)
        self.queue_time = Histogram("worker_request_queue_time_seconds", "submitted (the gateway's XADD) -> first "
                                    "scheduled in the engine", buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("worker_time_to_first_token_seconds", "submitted -> first token produced",
                              buckets=TTFT_BUCKETS, registry=r)
        self.ttfmt = Histogram("worker_time_to_first_meaningful_token_seconds", "submitted -> first token with "
                               "non-whitespace text", buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("worker_e2e_request_latency_seconds", "submitted -> last token (time to last token)",
                             buckets=TTLT_BUCKETS, registry=r)
        self.tpot = Histogram("worker_time_per_output_token_seconds", "per request: (last token - first token) / "
                              "(tokens - 1)", buckets=GAP_BUCKETS, registry=r)
        self.cancel_latency = Histogram("worker_cancel_latency_seconds", "cancel received by the worker -> the "
                                        "request's KV blocks freed", buckets=CANCEL_BUCKETS, registry=r)
        self.commit_duration = Histogram("worker_output_commit_duration_seconds", "one output commit (history, live "
                                         "copies, acks)", buckets=COMMIT_BUCKETS, registry=r)
        self.commit_requests = Histogram("worker_output_commit_requests", "requests written by one output commit",
                                         buckets=BATCH_BUCKETS, registry=r)
        self.grammar_compile = Histogram("worker_grammar_compile_seconds", "one structured-output schema compiled "
                                         "(beside the engine; a cache hit takes ~0)", buckets=COMPILE_BUCKETS,
                                         registry=r)
        for kind in ("prefill", "decode"):      # present from the start (dashboards: no "no data")
            self.iteration_tokens.labels(kind)
            self.step_duration.labels(kind)
        # counted here (from the batches pump() and request_finished() see), exported by the collector
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancels = 0
        self.finished: dict[str, int] = {}
        self.grammar_refused = dict.fromkeys(GRAMMAR_REFUSALS, 0)
        self.telemetry = Telemetry()       # the latest engine gauges
        r.register(_ScrapeCollector(self))
        self._server: WSGIServer | None = None

    # ---- fed by the service ----------------------------------------------------------------

    def pump(self, telemetry: Telemetry) -> None:
        """Observe the engine's step and cancel records (a few times a second)."""
        prompt = generated = 0
        for rows, prompt_tokens, decode_tokens, sampled, seconds in telemetry.steps:
            self.batch_size.observe(rows)
            kind = "prefill" if prompt_tokens else "decode"
            self.step_duration.labels(kind).observe(seconds)
            if prompt_tokens:
                self.iteration_tokens.labels("prefill").observe(prompt_tokens)
            if decode_tokens:
                self.iteration_tokens.labels("decode").observe(decode_tokens)
            prompt += prompt_tokens
            generated += sampled
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        for seconds in telemetry.cancels:
            self.cancel_latency.observe(seconds)
        self.cancels += len(telemetry.cancels)
        for seconds in telemetry.compiles:
            self.grammar_compile.observe(seconds)
        for reason in telemetry.refusals:
            self.grammar_refused[reason] = self.grammar_refused.get(reason, 0) + 1
        self.telemetry.merge(Telemetry(running=telemetry.running, waiting=telemetry.waiting,
                                       kv_cached=telemetry.kv_cached, sampled_at=telemetry.sampled_at))

    def request_finished(self, st: InFlight) -> None:
        """One request's latencies, once, when its final is written."""
        if not st.finish_reason:
            return
        self.finished[st.finish_reason] = self.finished.get(st.finish_reason, 0) + 1
        submitted = entry_ms(st.entry_id)
        if not submitted:
            return
        for hist, at in ((self.queue_time, st.admitted_ms), (self.ttft, st.first_token_ms),
                         (self.ttfmt, st.meaningful_ms), (self.e2e, st.final_ms)):
            if at and at >= submitted:
                hist.observe((at - submitted) / 1000)
        tokens = st.completion_tokens
        if tokens > 1 and st.first_token_ms and st.final_ms >= st.first_token_ms:
            self.tpot.observe((st.final_ms - st.first_token_ms) / 1000 / (tokens - 1))

    def commit(self, seconds: float, requests: int) -> None:
        self.commit_duration.observe(seconds)
        self.commit_requests.observe(requests)

    # ---- serving ---------------------------------------------------------------------------

    def serve(self, host: str, port: int, admin_token: str) -> int | None:
        """Serve /metrics in a daemon thread; returns the port (None when it cannot bind: the
        worker runs on without metrics, and says so)."""
        app = _guarded(make_wsgi_app(self.registry), admin_token)
        try:
            self._server = make_server(host, port, app, WSGIServer, handler_class=_QuietHandler)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d (%s); running without /metrics", host, port, exc)
            return None
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def entry_ms(entry_id: str) -> int:
    """Redis's wall clock (ms) when the request entry was added: its id's first part."""
    try:
        return int(entry_id.split("-", 1)[0])
    except (ValueError, AttributeError):
        return 0


class _ScrapeCollector:
    """Counters and gauges read from the worker's live objects when Prometheus scrapes."""

    def __init__(self, metrics: WorkerMetrics):
        self.m = metrics

    def describe(self):
        return []       # not known before a scrape: the registry must not collect() on register

    def collect(self):
        m = self.m
        yield _counter("worker_prompt_tokens", "prompt tokens computed by prefill (cache hits not included)",
                       m.prompt_tokens)
        yield _counter("worker_generation_tokens", "tokens generated", m.generation_tokens)
        yield _counter("worker_cancels", "cancels the engine applied", m.cancels)
        done = CounterMetricFamily("worker_request_success", "requests the engine finished, by finish_reason",
                                   labels=["finish_reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            done.add_metric([reason], m.finished.get(reason, 0))
        yield done
        refused = CounterMetricFamily("worker_grammar_compile_refused", "structured-output requests refused for "
                                      "their schema, by reason: too_large (GRAMMAR_MAX_SCHEMA_BYTES), timeout "
                                      "(GRAMMAR_COMPILE_TIMEOUT_S), invalid (xgrammar cannot use it)", labels=["reason"])
        for reason, count in m.grammar_refused.items():
            refused.add_metric([reason], count)
        yield refused
        running = GaugeMetricFamily("worker_num_requests_running", "requests in the engine's running batch, by lane",
                                    labels=["lane"])
        waiting = GaugeMetricFamily("worker_num_requests_waiting", "requests queued in the engine, by lane",
                                    labels=["lane"])
        for lane in LANES:
            running.add_metric([lane], m.telemetry.running.get(lane, 0))
            waiting.add_metric([lane], m.telemetry.waiting.get(lane, 0))
        yield running
        yield waiting
        src = m.sources() if m.sources else {}
        yield _gauge("worker_max_batch", "MAX_BATCH: requests the engine runs at once (slot occupancy = "
                     "worker_num_requests_running / worker_max_batch)", float(src.get("max_batch") or 0))
        engine, stats = src.get("engine"), src.get("stats")
        writer_stats, errors = src.get("writer_stats") or {}, src.get("redis_errors") or {}
        block = max(1, int(src.get("kv_block_tokens") or 1))
        total = int(getattr(engine, "kv_total", 0) or 0)
        used = int(getattr(engine, "kv_used", 0) or 0)
        cached = min(m.telemetry.kv_cached, max(0, total - used))
        yield _gauge("worker_kv_cache_usage_perc", "fraction of KV blocks held by running requests (0-1)",
                     used / total if total else 0.0)
        blocks = GaugeMetricFamily("worker_kv_blocks", "KV blocks: used (held by requests), cached (free, keeping a "
                                   "prefix for reuse, evictable), free", labels=["state"])
        blocks.add_metric(["used"], used // block)
        blocks.add_metric(["cached"], cached // block)
        blocks.add_metric(["free"], max(0, total - used - cached) // block)
        yield blocks
        yield _counter("worker_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       getattr(engine, "prefix_cache_queries", 0))
        yield _counter("worker_prefix_cache_hits", "prompt tokens served from the prefix cache",
                       getattr(engine, "prefix_cache_hits", 0))
        yield _counter("worker_num_preemptions", "requests whose KV blocks were taken back to be recomputed",
                       getattr(engine, "preemptions", 0))
        healthy = engine is not None and engine.is_alive() and not getattr(engine, "unhealthy_reason", "")
        yield _gauge("worker_engine_healthy", "1 while the engine serves, 0 once every step fails or it died",
                     1.0 if healthy else 0.0)
        yield _counter("worker_fenced_writes", "writes refused because another worker took the request over",
                       writer_stats.get("fenced", 0))
        yield _counter("worker_lease_lapses", "times a request's ownership lease passed its deadline (counted "
                       "from when its renewal was sent) unrenewed, so its output was held",
                       writer_stats.get("lease_lapses", 0))
        yield _gauge("worker_requests_lease_lapsed", "requests whose output is held now: their ownership lease passed "
                     "its deadline unrenewed (Redis stalled past the lease)", float(src.get("lease_lapsed") or 0))
        yield _counter("worker_continuations", "requests continued after another worker's failure",
                       getattr(stats, "continued", 0))
        yield _counter("worker_claims", "entries taken over from other workers (dead, handed back)",
                       getattr(stats, "claimed", 0))
        yield _counter("worker_dead_letters", "entries dead-lettered", getattr(stats, "dead", 0))
        yield _counter("worker_route_forwards", "entries routed to another live worker with room (its prefix "
                       "cache), handed to it", getattr(stats, "forwarded", 0))
        redis_errors = CounterMetricFamily("worker_redis_errors", "Redis calls that failed, by kind",
                                           labels=["kind"])
        for kind in ("connection", "timeout", "loading", "refused"):
            redis_errors.add_metric([kind], errors.get(kind, 0))
        yield redis_errors


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _guarded(app, token: str):
    """The WSGI app behind `Authorization: Bearer ADMIN_TOKEN` (empty token: open)."""
    if not token:
        return app

    def guarded(environ, start_response):
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"admin token required (Authorization: Bearer ADMIN_TOKEN)\n"]
        return app(environ, start_response)
    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):   # scrapes every few seconds: not worth a log line each
        pass

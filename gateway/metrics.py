"""Prometheus metrics of one gateway process (own registry, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.process_collector import ProcessCollector


from shared.errors import ErrorCode
from shared.slo_buckets import CANCEL_BUCKETS, GAP_BUCKETS, TTFT_BUCKETS, TTLT_BUCKETS

FINISH_REASONS = ("stop", "length", "cancelled", "error")
CANCEL_ORIGINS = ("client", "http_disconnect", "orphan", "stall")
# the cancels whose end-to-end latency is measured: a client that asked (its cancel frame, or
# its HTTP connection closing) and is told when the engine freed the request's slot
TIMED_CANCEL_ORIGINS = ("client", "http_disconnect")
# socket closes: the client's and the network's, then the server's usual reasons
CLOSE_REASONS = ("client", "lost", ErrorCode.SLOW_CONSUMER.value, ErrorCode.SHUTTING_DOWN.value,
                 ErrorCode.UNAUTHORIZED.value, ErrorCode.INTERNAL.value)
# the gateway's periodic duties (gateway.housekeeping), each with its own failure count
HOUSEKEEPING_DUTIES = ("cancel_watch", "slow_consumers", "stalls", "liveness", "routing", "backlog", "orphans",
                       "leases", "batches")
RESUME_OUTCOMES = ("attached", ErrorCode.RESUME_EXPIRED.value, ErrorCode.RATE_LIMITED.value,
                   ErrorCode.BACKEND_UNAVAILABLE.value)


class HotCounter:
    """A counter bumped on the per-frame path: a plain int (the event loop is the only writer),
    read at scrape time by `HotCounters`. prometheus_client's Counter takes a lock and runs
    three checks per `inc`, a few µs a frame across the frame counters."""
    __slots__ = ("name", "doc", "value")

    def __init__(self, name: str, doc: str):
        self.name, self.doc, self.value = name, doc, 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class HotCounters:
    """The collector that exports HotCounters (as `<name>_total`, like a Counter)."""

    def __init__(self, *counters: HotCounter):
        self.counters = counters

    def describe(self):
        return [CounterMetricFamily(c.name, c.doc) for c in self.counters]

    def collect(self):
        return [CounterMetricFamily(c.name, c.doc, value=c.value) for c in self.counters]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)      # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.active_sockets = Gauge("gateway_active_sockets", "open WebSocket connections", registry=r)
        self.active_requests = Gauge("gateway_active_requests", "requests streaming on this replica", registry=r)
        self.requests = Counter("gateway_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.rejections = Counter("gateway_rejections", "messages rejected by error code", ["code"], registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "accepted -> first chunk sent", buckets=TTFT_BUCKETS,
                              registry=r)
        self.ttfmt = Histogram("gateway_time_to_first_meaningful_token_seconds",
                               "accepted -> first chunk with non-whitespace text sent", buckets=TTFT_BUCKETS,
                               registry=r)
        self.ttlt = Histogram("gateway_time_to_last_token_seconds", "accepted -> last chunk sent (requests that "
                              "produced tokens; resumed ones excluded)", buckets=TTLT_BUCKETS, registry=r)
        self.cancels = Counter("gateway_cancels", "requests this replica cancelled, by origin: client (a cancel "
                               "message), http_disconnect (an HTTP client went away), orphan (a dropped socket or a "
                               "dead gateway's request not resumed within RESUME_GRACE_S), stall (no progress for "
                               "REQUEST_STALL_S)", ["origin"], registry=r)
        self.socket_closes = Counter("gateway_socket_closes", "WebSocket closes by reason: client (a close frame), "
                                     "lost (no close frame: network drop, idle timeout at a proxy, ping timeout), or "
                                     "the server's reason (slow_consumer, unauthorized, shutting_down, internal, ...)",
                                     ["reason"], registry=r)
        self.resumes = Counter("gateway_resumes", "resume attempts (WebSocket resume, SSE Last-Event-ID) by outcome: "
                               "attached, or the refusal's error code", ["outcome"], registry=r)
        self.inter_chunk = Histogram("gateway_inter_chunk_seconds", "gap between chunks of one request",
                                     buckets=GAP_BUCKETS, registry=r)
        self.flushes = HotCounter("gateway_flushes", "chunk frames sent (rate() = flushes per second)")
        self.tokens = HotCounter("gateway_tokens_sent", "output tokens sent to clients")
        self.frames = HotCounter("gateway_frames_sent", "all frames sent")
        r.register(HotCounters(self.flushes, self.tokens, self.frames))
        self.slow_consumers = Counter("gateway_slow_consumer_closes", "sockets closed for not reading", registry=r)
        self.sender_failures = Counter("gateway_sender_failures", "sockets closed because sending failed (a bug: "
                                                                  "see the log)", registry=r)
        self.control_queue_bytes = Gauge("gateway_control_queue_bytes", "control frames (accepted, error, pong) "
                                         "encoded and waiting to be sent, all sockets", registry=r)
        self.stalled = Counter("gateway_stalled_requests", "requests ended with `stalled`: no output for "
                                                           "REQUEST_STALL_S", registry=r)
        self.stale_events = Counter("gateway_stale_events_dropped", "live events dropped because a newer worker "
                                                                    "run (epoch) of their request exists", registry=r)
        self.queue_depth = Gauge("gateway_queue_depth", "the request backlog as this replica last read it from "
                                 "Redis: queued (not yet read by a worker) and pending (read, not finished)",
                                 ["state"], registry=r)
        self.live_workers = Gauge("gateway_live_workers", "workers whose registry heartbeat is younger than "
                                  "WORKER_TTL_S, as this replica last read it", registry=r)
        self.cancel_latency = Histogram("gateway_cancel_latency_seconds", "a client's cancel (its cancel frame, or "
                                        "its HTTP connection closing) reaching this gateway -> the engine freed the "
                                        "request's slot (the worker's cancelled final arrived here), by origin",
                                        ["origin"], buckets=CANCEL_BUCKETS, registry=r)
        self.taken_over = Counter("gateway_orphans_taken_over", "requests of dead gateways this replica parked "
                                                                "for resume", registry=r)
        self.housekeeping_failures = Counter("gateway_housekeeping_failures", "housekeeping runs that failed, by "
                                             "duty (each duty runs on its own; a failure only skips that duty's "
                                             "run: see the log)", ["duty"], registry=r)

        self._zero_series()

    def _zero_series(self) -> None:
        """Every labelled series the dashboard and the alerts query, at 0 from the start: a
        counter that appears only with its first event makes `rate()` miss that event and
        panels show "no data" (Prometheus cannot tell "never happened" from "not exported")."""
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        for code in ErrorCode:
            self.rejections.labels(code.value)
        for outcome in RESUME_OUTCOMES:
            self.resumes.labels(outcome)
        for origin in CANCEL_ORIGINS:
            self.cancels.labels(origin)
        for origin in TIMED_CANCEL_ORIGINS:
            self.cancel_latency.labels(origin)
        for reason in CLOSE_REASONS:
            self.socket_closes.labels(reason)
        for state in ("queued", "pending"):
            self.queue_depth.labels(state)
        for duty in HOUSEKEEPING_DUTIES:
            self.housekeeping_failures.labels(duty)

    def render(self) -> bytes:
        return generate_latest(self.registry)

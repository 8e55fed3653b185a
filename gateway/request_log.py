"""One INFO line per finished request, and the end-to-end latency of a client's cancel.

The line (logger `gateway.request_log`, message `request <rid> finished`; with LOG_FORMAT=json
every field is a key of the JSON object) joins what this gateway measured with what the worker wrote
in the request's final event:

    rid, id (the client's), key, finish_reason, error (its code), seq, resumed,
    ttft_ms / ttfmt_ms / ttlt_ms / total_ms   accepted here -> first chunk / first chunk with
                                              non-whitespace text / last chunk / the end, sent
                                              (this gateway's monotonic clock)
    w_ttft_ms / w_ttfmt_ms / w_ttlt_ms        the worker's: submit -> first token / first
                                              meaningful token / final, produced
    prompt_tokens, cached_tokens, completion_tokens, worker, lane,
    cancel (client | http_disconnect, or null), cancel_ms (cancel -> slot freed, below)

Why at INFO and on the gateway: the gateway is where a request ends for its client, and the
final event already carries the worker's side, so one line per request holds the whole record
(no join in the log store). It costs one dict and one formatted line per REQUEST, never per
token (bench/request_log.py measures it: bench/RESULTS.md, "Per-request log line").

Cancel latency, end to end (`gateway_cancel_latency_seconds{origin}`): from this gateway
receiving the client's cancel (a `cancel` frame, or the HTTP client going away) to the worker's
`cancelled` final arriving here. The engine frees the request's KV blocks and slot when it
applies the cancel and reports the final in that same step; the worker writes finals at once
(they never wait for WORKER_FLUSH_MS), so the figure is "slot freed" plus one Redis hop back.
Both ends are read on this process's monotonic clock: no clocks of two machines are compared.
A request whose session ends before its final comes back (an HTTP client that went away, a
socket closed right after its cancel) is handed to `CancelWatch`, which the inbox tells about
finals nobody else is subscribed to.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from gateway.metrics import TIMED_CANCEL_ORIGINS, GatewayMetrics
from gateway.request_state import RequestState
from shared.events import DoneEvent, ErrEvent, Event, FinalEvent

log = logging.getLogger("gateway.request_log")


def _ms(start: float, at: float | None) -> float | None:
    return None if at is None else round((at - start) * 1000, 1)


def request_record(req: RequestState, final: FinalEvent | None, now: float) -> dict:
    """The per-request line's fields (see the module doc)."""
    usage = final.usage if isinstance(final, DoneEvent) else None
    if isinstance(final, ErrEvent):
        reason, error = "error", final.code
    else:
        reason = (final.finish_reason if final is not None else "") or ("cancelled" if req.cancel_origin else "error")
        error = None
    resumed = req.resumed
    return {
        "message": f"request {req.rid} finished",
        "rid": req.rid,
        "id": req.client_id,
        "key": req.key_id,
        "finish_reason": reason,
        "error": error,
        "seq": max(req.seq, final.seq if final is not None else 0),
        "resumed": resumed,
        "ttft_ms": None if resumed else _ms(req.started, req.first_sent),
        "ttfmt_ms": None if resumed else _ms(req.started, req.meaningful_at),
        "ttlt_ms": None if resumed else _ms(req.started, req.last_sent),
        "total_ms": _ms(req.started, now),
        "w_ttft_ms": usage.ttft_ms if usage else None,
        "w_ttfmt_ms": usage.ttfmt_ms if usage else None,
        "w_ttlt_ms": usage.ttlt_ms if usage else None,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "worker": (final.worker or None) if final is not None else None,
        "lane": (final.lane or None) if final is not None else None,
        "cancel": req.cancel_origin,
        "cancel_ms": req.cancel_ms,
    }


def log_finished(req: RequestState, final: FinalEvent | None, now: float | None = None) -> None:
    """The request's one INFO line (nothing is built when INFO is off)."""
    if log.isEnabledFor(logging.INFO):
        log.info(request_record(req, final, time.monotonic() if now is None else now))


def cancel_confirmed(req: RequestState, final: FinalEvent | None, metrics: GatewayMetrics, now: float) -> None:
    """`final` reached this gateway for a request its client cancelled: a worker's `cancelled`
    final means the engine freed the slot; observe how long after the client's cancel."""
    if (req.cancel_at is None or req.cancel_ms is not None or not isinstance(final, DoneEvent) or final.local
            or final.finish_reason != "cancelled"
            or req.cancel_origin not in TIMED_CANCEL_ORIGINS):
        return
    seconds = max(0.0, now - req.cancel_at)
    req.cancel_ms = round(seconds * 1000, 1)
    metrics.cancel_latency.labels(req.cancel_origin).observe(seconds)


class CancelWatch:
    """Cancelled requests whose session is gone (an HTTP client that went away, a socket closed
    right after its cancel): their final still comes to this gateway's inbox, with nobody
    subscribed. The inbox hands such finals here (`on_unclaimed`, only for requests without a
    subscriber: nothing on the path of live streams); the cancel's latency is observed and the
    request's line logged. A request whose final does not come within `expire_s` (no worker
    confirmed) is logged without it by `expire`, from the housekeeping loop."""

    def __init__(self, metrics: GatewayMetrics, expire_s: float):
        self.metrics = metrics
        self.expire_s = expire_s
        self._by_rid: OrderedDict[str, tuple[RequestState, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_rid)

    def watch(self, req: RequestState) -> None:
        self._by_rid[req.rid] = (req, time.monotonic() + self.expire_s)

    def on_unclaimed(self, ev: Event) -> None:
        """An event for a request no session of this gateway is subscribed to."""
        if not ev.is_final:
            return
        found = self._by_rid.pop(ev.rid, None)
        if found is None:
            return
        now = time.monotonic()
        cancel_confirmed(found[0], ev, self.metrics, now)
        log_finished(found[0], ev, now)

    def expire(self, now: float) -> int:
        """Log (without a worker's final) the requests whose final did not come in time."""
        expired = 0
        while self._by_rid:
            rid, (req, deadline) = next(iter(self._by_rid.items()))
            if deadline > now:
                break
            del self._by_rid[rid]
            log_finished(req, None, now)
            expired += 1
        return expired

"""The requests multiplexed on one session (a WebSocket, or one HTTP response), from acceptance
to their one `done`.

Live events arrive from the process-wide inbox reader (gateway.inbox) through a synchronous
callback (`on_event`) that never awaits, so a slow socket cannot hold up the shared reader or
other sockets. Each request's `StreamJoin` (gateway.stream_join) decides what of it goes out:
tokens exactly after the last delivered one, history reads where live has a hole, the final
(or an `output_lost` error where the history cannot fill a hole). This table only moves the
join's output into the request's chunk buffer, runs the history reads the join asks for, and
wakes the sender.

Resume (gateway.resume) opens a request that is `attaching`: live events are held until the
worker's attach marker says where the history ends, then the join reads the history after the
client's `last_seq` and merges.

Nothing here awaits Redis on behalf of the sender: when a request ends, releasing its lease and
leaving this gateway's `reqs` set, and parking the unfinished requests of a closed session, go to
the gateway's bookkeeper (gateway.bookkeeping). A request's per-key concurrency lease is held
until the REQUEST ends; the worker releases it with its final event, this replica only refreshes
the leases of requests it serves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Awaitable, Callable

from redis.exceptions import RedisError

from gateway.bookkeeping import Bookkeeper
from gateway.flusher import ChunkBuffer
from gateway.frames import done_frame
from gateway.inbox import Inbox
from gateway.metrics import GatewayMetrics
from gateway.request_log import CancelWatch, cancel_confirmed, log_finished
from gateway.request_state import Phase, RequestState
from gateway.settings import GatewaySettings
from gateway.wake import WakeEvent
from shared.errors import ErrorCode
from shared.events import AttachMarker, DoneEvent, ErrEvent, Event, HistoryEvent, Moved, TokEvent
from shared.protocol import Done
from shared.logs import rid_of

log = logging.getLogger("gateway.connection")

HISTORY_READ_ATTEMPTS = 60     # ~1 min of retries before the history counts as unreadable

HistoryReader = Callable[[str, int], Awaitable[list[HistoryEvent]]]


class RequestTable:
    def __init__(self, wake: WakeEvent, *, reader: Inbox, read_history: HistoryReader, bookkeeper: Bookkeeper,
                 metrics: GatewayMetrics, settings: GatewaySettings, cancel_watch: CancelWatch | None = None):
        self._wake = wake
        self.cancel_watch = cancel_watch    # cancelled requests that end with their session
        self.reader = reader
        self.read_history = read_history
        self.bookkeeper = bookkeeper
        self.metrics = metrics
        self.s = settings
        self._by_id: dict[str, RequestState] = {}

    # ------------------------------------------------------------------ the table

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, client_id: str) -> bool:
        return client_id in self._by_id

    def values(self) -> list[RequestState]:
        return list(self._by_id.values())

    def get(self, client_id: str) -> RequestState | None:
        return self._by_id.get(client_id)

    def held_slots(self) -> list[tuple[str, str]]:
        return [(r.key_id, r.rid) for r in self._by_id.values() if r.slot_held]

    # ------------------------------------------------------------------ lifecycle

    def open(self, cid: str, rid: str, key_id: str, *, skip_seq: int = 0, resumed: bool = False) -> RequestState:
        """A new (or resumed) request, subscribed to its output before it is queued."""
        req = RequestState(cid, rid, key_id, ChunkBuffer(self.s.flush_interval_ms / 1000, self.s.flush_max_tokens),
                           skip_seq=skip_seq, resumed=resumed)
        self._by_id[cid] = req
        self.metrics.active_requests.inc()
        # subscribe before the request is queued (or attached), so no live event can be missed
        req.sub = self.reader.subscribe(rid, functools.partial(self.on_event, req), lambda: self._taken_over(req))
        return req

    def drop(self, req: RequestState) -> None:
        """Forget a request that was never accepted (its submit was refused or failed)."""
        self._detach(req)
        self._by_id.pop(req.client_id, None)

    def finish(self, req: RequestState) -> Done:
        """The request's output is all sent: forget it here and build its `done`. Its Redis
        bookkeeping (lease, `reqs`) is queued, not awaited: `done` goes out at once."""
        now = time.monotonic()
        done = done_frame(req, now)
        self.metrics.requests.labels(done.finish_reason).inc()
        if req.last_sent is not None and not req.resumed:
            self.metrics.ttlt.observe(req.last_sent - req.started)
        log_finished(req, req.final, now)
        log.debug("request %s done on this gateway (%s): %s, seq %d", req.rid, req.client_id, done.finish_reason,
                  done.seq, extra=rid_of(req.rid))
        moved = req.moved       # it runs on, for another session: its slot and `reqs` entry are that one's
        self._detach(req)
        self._by_id.pop(req.client_id, None)
        if not moved:
            self.bookkeeper.request_ended(req.key_id, req.rid)
        return done

    def release_all(self) -> None:
        """Session gone: unfinished requests wait for a resume (grace) or are cancelled. Their
        concurrency slots stay taken until they really end (a reconnect loop cannot bypass the limit)."""
        orphans: list[tuple[str, int]] = []
        for req in list(self._by_id.values()):
            moved = req.moved      # (before the detach, which closes its subscription here)
            unfinished = not req.finished
            self._detach(req)
            if not req.cancel_requested and not moved:
                orphans.append((req.rid, req.att))
            elif req.cancel_origin is not None and unfinished and not moved:
                # the client cancelled it and left: its final (the slot freed) still comes here
                if req.final is not None or self.cancel_watch is None:
                    log_finished(req, req.final)
                else:
                    self.cancel_watch.watch(req)
        self._by_id.clear()
        if orphans:
            self.bookkeeper.orphaned(orphans)

    def _detach(self, req: RequestState) -> None:
        if req.sub is not None:
            self.reader.unsubscribe(req.sub)
            req.sub = None
        for timer in (req.cancel_timer, req.attach_timer):
            if timer is not None:
                timer.cancel()
        req.cancel_timer = req.attach_timer = None
        if not req.finished:
            req.advance(Phase.ENDED)
            self.metrics.active_requests.dec()

    # ------------------------------------------------------------------ ended here

    def start_cancel_fallback(self, req: RequestState) -> None:
        """If no worker confirms the cancel (e.g. all dead), finish it here rather than leave the client waiting."""
        req.cancel_timer = asyncio.get_running_loop().call_later(self.s.cancel_fallback_s, self.end_cancelled, req)

    def end_cancelled(self, req: RequestState) -> None:
        """End a cancelled request here (no worker will, or none confirmed in time)."""
        req.cancel_timer = None
        if not req.finished and req.join.end_here(DoneEvent.here(req.rid, req.join.delivered, "cancelled")):
            self._wake.set()

    def _taken_over(self, req: RequestState) -> None:
        """Another session resumed the request (or sent its idempotency key again), of this
        gateway (its inbox subscription replaced ours) or of another one (its `moved` notice came
        through our inbox): it streams there now; end it here, typed, rather than leave it silent."""
        if not req.finished and req.join.end_here(ErrEvent.here(
                req.rid, req.join.delivered, ErrorCode.RESUMED_ELSEWHERE,
                "another connection resumed this request; it streams there now")):
            self._wake.set()

    def end_stalled(self, now: float, stall_s: float) -> list[RequestState]:
        """End requests with no event of any kind for `stall_s` (queued, prefilling or decoding
        alike) with a retryable `stalled` error; returns them so the caller cancels them."""
        stalled = []
        for req in self._by_id.values():
            if (req.final is None and req.streaming and not req.moved
                    and now - req.progress_at > stall_s):
                req.join.end_here(ErrEvent.here(
                    req.rid, req.join.delivered, ErrorCode.STALLED,
                    f"no output for {stall_s:g}s: the worker went silent; retry the request"))
                stalled.append(req)
        if stalled:
            self._wake.set()
        return stalled

    # ------------------------------------------------------------------ output events

    def on_event(self, req: RequestState, ev: Event) -> None:
        """A live event from the inbox (never awaits)."""
        if req.phase is Phase.ENDED:
            return
        if isinstance(ev, (TokEvent, DoneEvent, ErrEvent)):
            req.progress_at = now = time.monotonic()
            self._deliver(req, req.join.live(ev), now)
        elif isinstance(ev, Moved):
            # a resume newer than ours, on another gateway (while our own attach is in flight we
            # do not know our att yet, and an older notice must not end us: ignored then)
            if ev.att > req.att and req.sub is not None and req.phase is not Phase.OPENING:
                self.reader.unsubscribe(req.sub)             # (req.moved from now on)
                self._taken_over(req)
            return
        else:
            req.progress_at = time.monotonic()
            if isinstance(ev, AttachMarker) and ev.att >= req.att:
                req.join.marker()         # everything before this marker is in the history
        if req.join.wants_read:
            self._read_if_wanted(req)

    def read_now(self, req: RequestState) -> None:
        """Read the history after what this request has (no owner yet, or an attach retry)."""
        req.join.wants_read = True
        self._read_if_wanted(req)

    def _deliver(self, req: RequestState, events: list[HistoryEvent], now: float | None = None) -> None:
        join = req.join
        if join.stale != req.stale_seen:
            self.metrics.stale_events.inc(join.stale - req.stale_seen)
            req.stale_seen = join.stale
        if not events:
            return
        if join.gap is not None:
            log.warning("request %s ends with output_lost: %s", req.rid, join.gap, extra=rid_of(req.rid))
        if now is None:
            now = time.monotonic()
        buffer = req.buffer
        for ev in events:
            if type(ev) is TokEvent:
                if ev.prompt_tokens:
                    req.prompt_tokens = ev.prompt_tokens
                buffer.add(ev.text, len(ev.ids), ev.seq, now, ev.logprobs, ev.prompt)
        final = join.final
        if final is not None:
            if req.cancel_at is not None:
                cancel_confirmed(req, final, self.metrics, now)
            self._wake.set()
        elif self._wake.needed(buffer.deadline()):     # else the sender looks by itself in time
            self._wake.set()

    def _read_if_wanted(self, req: RequestState) -> None:
        join = req.join
        if join.wants_read and not join.reading and not join.ended and not req.finished:
            asyncio.get_running_loop().create_task(self._read(req, join.start_read()))

    async def _read(self, req: RequestState, after: int) -> None:
        events: list[HistoryEvent] | None = None
        for attempt in range(HISTORY_READ_ATTEMPTS):
            try:
                events = await self.read_history(req.rid, after)
                break
            except (RedisError, OSError) as exc:
                if req.finished:
                    return
                log.warning("history read for %s failed (%s); retrying", req.rid, exc, extra=rid_of(req.rid))
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
        if req.finished:
            return
        self._deliver(req, req.join.history(events))
        self._read_if_wanted(req)

"""The requests multiplexed on one socket, from acceptance to their one `done` (or a drop).

Live events arrive from the process-wide inbox reader (gateway.inbox) through a synchronous
callback (`on_event`) that only appends to the request's `ChunkBuffer` and wakes the sender: it
never awaits, so a slow socket cannot hold up the shared reader or other sockets. A token event
covers `n` tokens and ends at `seq` (tokens delivered so far); one whose seq is not beyond what
this socket already has is a duplicate and dropped, so history and live can overlap safely; one
that starts past the next expected token is held while the missing ones are read from history.

Resume (gateway.resume) joins history and live: while `attaching`, live events are held back;
the worker's attach marker says "everything <= S is in the history", so the history after the
client's `last_seq` is read (`catch_up`), fed, and then the held live events, deduplicated by seq.

A request's per-key concurrency lease is held until the REQUEST ends: the worker releases it
with its final event. This replica only refreshes the leases of the requests it serves, and
releases one itself when it ends a request no worker will (cancel fallback). A socket that goes
away parks its unfinished requests for a resume (or cancels them); it does not free their slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway.flusher import ChunkBuffer
from gateway.frames import done_frame
from gateway.inbox import Subscriber
from shared.errors import ErrorCode
from shared.protocol import Done
from shared.streams import FINAL_KINDS

if TYPE_CHECKING:
    from gateway.hub import Hub

log = logging.getLogger("gateway.connection")


class RequestState:
    __slots__ = ("client_id", "rid", "key_id", "buffer", "sub", "seq", "fed_seq", "final", "accepted",
                 "started", "first_sent", "last_sent", "att", "cancel_requested", "cancel_timer",
                 "resumed", "slot_held", "finished", "attaching", "catching_up", "catch_again", "held", "attach_timer",
                 "progress_at")

    def __init__(self, client_id: str, rid: str, key_id: str, buffer: ChunkBuffer, *, skip_seq: int = 0,
                 resumed: bool = False):
        self.client_id = client_id
        self.rid = rid
        self.key_id = key_id
        self.buffer = buffer
        self.sub: Subscriber | None = None
        self.seq = skip_seq          # last token seq sent to the client
        self.fed_seq = skip_seq      # last token seq put into the buffer (resume: the client has up to here)
        self.final: dict | None = None
        self.accepted = False
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.att = 0                 # attach counter this socket holds (meta.att after its resume)
        self.cancel_requested = False
        self.cancel_timer: asyncio.TimerHandle | None = None
        self.resumed = resumed
        self.slot_held = False       # this replica refreshes the request's concurrency lease
        self.finished = False
        self.attaching = resumed     # resume: live events wait for the attach marker + history
        self.catching_up = False     # a history read is in flight
        self.catch_again = False     # a marker came during that read: read once more after it
        self.held: list[dict] = []   # live events held back while attaching / catching up
        self.attach_timer: asyncio.TimerHandle | None = None
        self.progress_at = self.started  # last event of any kind for this request (stall watchdog)


class RequestTable:
    def __init__(self, hub: Hub, wake: asyncio.Event):
        self.hub = hub
        self.s = hub.settings
        self._wake = wake
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
        self.hub.metrics.active_requests.inc()
        # subscribe before the request is queued (or attached), so no live event can be missed
        req.sub = self.hub.reader.subscribe(rid, lambda ev: self.on_event(req, ev))
        return req

    def drop(self, req: RequestState) -> None:
        """Forget a request that was never accepted (its submit was refused or failed)."""
        self._detach(req)
        self._by_id.pop(req.client_id, None)
        req.slot_held = False

    async def finish(self, req: RequestState) -> Done:
        """The request's output is all sent: forget it here and build its `done`.

        The lease is released here, before `done` goes out, so the client may start its next
        request at once: the worker releases it too, but in the ack that follows the write of the
        final event, which the client can see first (ZREM twice is harmless). A request ended
        here (cancel fallback, stall) has no worker release at all.
        """
        done = done_frame(req, time.monotonic())
        self.hub.metrics.requests.labels(done.finish_reason).inc()
        self._detach(req)
        self._by_id.pop(req.client_id, None)
        req.slot_held = False
        try:
            await self.hub.submitter.release(req.key_id, req.rid)
            await self.hub.submitter.done_here([req.rid])
        except (RedisError, OSError):
            pass  # the lease expires by itself; a stale `reqs` member is skipped at takeover
        return done

    async def release_all(self) -> None:
        """Socket gone: unfinished requests wait for a resume (grace) or are cancelled now. Their
        concurrency slots stay taken until they really end (a reconnect loop cannot bypass the limit)."""
        orphans: list[tuple[str, int]] = []
        for req in list(self._by_id.values()):
            moved = req.sub is not None and req.sub.closed    # resumed on another socket of this replica
            self._detach(req)
            req.slot_held = False
            if not req.cancel_requested and not moved:
                orphans.append((req.rid, req.att))
        self._by_id.clear()
        if not orphans:
            return
        try:
            if self.s.resume_grace_s > 0:
                await self.hub.submitter.park_orphans(orphans, self.s.resume_grace_s)
            else:
                for rid, _ in orphans:
                    await self.hub.submitter.cancel(rid)
        except (RedisError, OSError) as exc:
            log.warning("could not park/cancel %d request(s) of a closed socket: %s", len(orphans), exc)

    def _detach(self, req: RequestState) -> None:
        if req.sub is not None:
            self.hub.reader.unsubscribe(req.sub)
            req.sub = None
        for timer in (req.cancel_timer, req.attach_timer):
            if timer is not None:
                timer.cancel()
        req.cancel_timer = req.attach_timer = None
        if not req.finished:
            req.finished = True
            self.hub.metrics.active_requests.dec()

    # ------------------------------------------------------------------ cancel

    def start_cancel_fallback(self, req: RequestState) -> None:
        """If no worker confirms the cancel (e.g. all dead), finish it here rather than leave the client waiting."""
        req.cancel_timer = asyncio.get_running_loop().call_later(self.s.cancel_fallback_s, self.end_cancelled, req)

    def end_cancelled(self, req: RequestState) -> None:
        """End a cancelled request here (no worker will, or none confirmed in time)."""
        req.cancel_timer = None
        if req.final is None and not req.finished:
            req.final = {"k": "done", "seq": req.fed_seq, "finish_reason": "cancelled", "usage": {}, "local": True}
            self._wake.set()

    # ------------------------------------------------------------------ stall watchdog

    def end_stalled(self, now: float, stall_s: float) -> list[RequestState]:
        """End requests with no event of any kind for `stall_s` (queued, prefilling or decoding
        alike) with a retryable `stalled` error; returns them so the caller cancels them."""
        stalled = []
        for req in self._by_id.values():
            moved = req.sub is not None and req.sub.closed     # resumed on another socket of this replica
            if (req.final is None and not req.finished and req.accepted and not moved
                    and now - req.progress_at > stall_s):
                req.final = {"k": "err", "seq": req.fed_seq, "code": ErrorCode.STALLED.value, "retryable": True,
                             "message": f"no output for {stall_s:g}s: the worker went silent; retry the request",
                             "local": True}
                stalled.append(req)
        if stalled:
            self._wake.set()
        return stalled

    # ------------------------------------------------------------------ output events

    def on_event(self, req: RequestState, ev: dict) -> None:
        """A live event from the inbox (never awaits)."""
        if req.finished or req.final is not None:
            return
        req.progress_at = time.monotonic()
        kind = ev.get("k")
        if kind == "att":
            if int(ev.get("att") or 0) >= req.att and req.attaching:
                req.attaching = False       # everything before this marker is in the history
                self.catch_up(req)
            return
        if req.attaching or req.catching_up:
            req.held.append(ev)
            return
        if kind == "tok" and _starts_past(ev, req.fed_seq):
            # tokens between what this socket has and this event never came live (e.g. a stale
            # writer's event crossed the new owner's): the history has them; read it, then this
            req.held.append(ev)
            self.catch_up(req)
            return
        self._feed(req, ev)

    def _feed(self, req: RequestState, ev: dict) -> None:
        req.progress_at = time.monotonic()
        kind = ev.get("k")
        seq = int(ev.get("seq") or 0)
        if kind == "tok":
            if seq <= req.fed_seq:
                return                      # already delivered (history and live overlap)
            n = int(ev.get("n") or 0)
            tokens = min(n, seq - req.fed_seq) if n else seq - req.fed_seq
            req.fed_seq = seq
            was_empty = req.buffer.empty
            now = time.monotonic()
            req.buffer.add(ev.get("text") or "", tokens, seq, now)
            if was_empty or req.buffer.due(now):
                self._wake.set()
        elif kind in FINAL_KINDS:
            req.final = ev
            self._wake.set()

    def catch_up(self, req: RequestState) -> None:
        """Read the history after what this socket has, feed it, then the held live events."""
        if req.finished:
            return
        if req.catching_up:
            req.catch_again = True          # the read in flight may predate the marker
            return
        req.catching_up = True
        asyncio.get_running_loop().create_task(self._catch_up(req))

    async def _catch_up(self, req: RequestState) -> None:
        try:
            while True:
                req.catch_again = False
                events = await self._read_history(req)
                if req.finished:
                    return
                for ev in events:
                    if req.final is None:
                        self._feed(req, ev)
                if not req.catch_again:
                    break
        finally:
            req.catching_up = False
        if not req.attaching:
            held, req.held = req.held, []
            for ev in held:
                if req.final is None and not req.finished:
                    self._feed(req, ev)
        self._wake.set()

    async def _read_history(self, req: RequestState) -> list[dict]:
        for attempt in range(60):
            try:
                return await self.hub.submitter.read_history(req.rid, req.fed_seq)
            except (RedisError, OSError) as exc:
                if req.finished:
                    return []
                log.warning("history read for %s failed (%s); retrying", req.rid, exc)
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
        return []


def _starts_past(ev: dict, fed_seq: int) -> bool:
    """A token event whose first token is beyond the next one this socket expects."""
    n = int(ev.get("n") or 0)
    return n > 0 and int(ev.get("seq") or 0) - n > fed_seq

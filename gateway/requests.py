"""The requests multiplexed on one socket, from acceptance to their one `done` (or a drop).

Output events arrive from the process-wide `OutputReader` through a synchronous callback
(`on_event`) that only appends to the request's `ChunkBuffer` and wakes the sender: it never
awaits, so a slow socket cannot hold up the shared reader or other sockets.

A request holds a per-key concurrency slot from submit until its `done` is built (`finish`), it
is dropped before acceptance (`drop`), or its socket goes away (`release_all`, which parks the
unfinished ones for a resume or cancels them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway.flusher import ChunkBuffer
from gateway.frames import done_frame
from gateway.output_reader import Subscription
from shared.protocol import Done

if TYPE_CHECKING:
    from gateway.hub import Hub

log = logging.getLogger("gateway.connection")


class RequestState:
    __slots__ = ("client_id", "rid", "key_id", "buffer", "sub", "seq", "skip_seq", "final", "accepted",
                 "started", "first_sent", "last_sent", "epoch", "cancel_requested", "cancel_timer",
                 "resumed", "slot_held", "finished")

    def __init__(self, client_id: str, rid: str, key_id: str, buffer: ChunkBuffer, *, skip_seq: int = 0,
                 resumed: bool = False):
        self.client_id = client_id
        self.rid = rid
        self.key_id = key_id
        self.buffer = buffer
        self.sub: Subscription | None = None
        self.seq = skip_seq          # last token seq delivered to the client
        self.skip_seq = skip_seq     # resume: token events up to here were already seen
        self.final: dict | None = None
        self.accepted = False
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.epoch = 1
        self.cancel_requested = False
        self.cancel_timer: asyncio.TimerHandle | None = None
        self.resumed = resumed
        self.slot_held = False
        self.finished = False


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
        # subscribe before the request is queued, so no event can be missed
        req.sub = self.hub.reader.subscribe(self.hub.keys.out(rid), lambda eid, ev: self.on_event(req, ev))
        return req

    async def drop(self, req: RequestState) -> None:
        """Forget a request that was never accepted (its submit failed)."""
        self._detach(req)
        self._by_id.pop(req.client_id, None)
        if req.slot_held:
            req.slot_held = False
            await self.hub.limits.release(req.key_id, req.rid)

    async def finish(self, req: RequestState) -> Done:
        """The request's output is all sent: free it and build its `done`.

        The slot is freed before `done` goes out, so a client may start its next request at once.
        """
        done = done_frame(req, time.monotonic())
        self.hub.metrics.requests.labels(done.finish_reason).inc()
        self._detach(req)
        self._by_id.pop(req.client_id, None)
        if req.slot_held:
            req.slot_held = False
            try:
                await self.hub.limits.release(req.key_id, req.rid)
            except (RedisError, OSError):
                pass  # the lease expires by itself
        return done

    async def release_all(self) -> None:
        """Socket gone: unfinished requests wait for a resume (grace) or are cancelled now."""
        orphans: list[tuple[str, int]] = []
        for req in list(self._by_id.values()):
            self._detach(req)
            if req.slot_held:
                req.slot_held = False
                try:
                    await self.hub.limits.release(req.key_id, req.rid)
                except (RedisError, OSError):
                    pass
            if not req.cancel_requested:
                orphans.append((req.rid, req.epoch))
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
        if req.cancel_timer is not None:
            req.cancel_timer.cancel()
            req.cancel_timer = None
        if not req.finished:
            req.finished = True
            self.hub.metrics.active_requests.dec()

    # ------------------------------------------------------------------ cancel

    def start_cancel_fallback(self, req: RequestState) -> None:
        """If no worker confirms the cancel (e.g. all dead), finish it here rather than leave the client waiting."""
        req.cancel_timer = asyncio.get_running_loop().call_later(self.s.cancel_fallback_s, self._cancel_fallback, req)

    def _cancel_fallback(self, req: RequestState) -> None:
        req.cancel_timer = None
        if req.final is None and not req.finished:
            req.final = {"k": "done", "seq": req.seq, "finish_reason": "cancelled", "usage": {}}
            self._wake.set()

    # ------------------------------------------------------------------ output events

    def on_event(self, req: RequestState, ev: dict) -> None:
        if req.finished or req.final is not None:
            return
        kind = ev.get("k")
        seq = int(ev.get("seq") or 0)
        if kind == "tok":
            if seq <= req.skip_seq:
                return
            was_empty = req.buffer.empty
            now = time.monotonic()
            req.buffer.add(ev.get("text") or "", int(ev.get("n") or 1), seq, now)
            if was_empty or req.buffer.due(now):
                self._wake.set()
        elif kind in ("done", "err"):
            req.final = ev
            self._wake.set()

"""`resume`: re-attach a request started on an earlier connection (any replica) to this one,
exactly. A WebSocket `resume` and an SSE reconnect with `Last-Event-ID` (gateway.openai.routes) both
come here (`reattach`).

Authorization and the attach both live here, so what a resume may see is decided in one place:
the request is named by its server-issued `request_id` (128-bit random, required), and the API
key that resumes must be the one that started it (meta.key; an anonymous request may be resumed
by any anonymous socket that presents its request_id, since anonymous clients get a new identity
per connection); anything else is `resume_expired`, with no hint whether the id exists. Each
socket may try at most RESUME_RATE_PER_MIN resumes a minute.

Joining history and live without a gap (docs/transport.md):
1. subscribe rid in this replica's inbox first, holding live events back (`attaching`);
2. one MULTI on slot {r:rid}: meta.gw = this gateway, meta.att += 1, read meta.owner; from now
   on every worker that writes rid routes its live events here;
3. send `attach` to the owner, which flushes, then writes the marker "everything <= S is in
   the history" into our inbox (a worker that takes rid later sends a marker too, as att > 0);
4. on the marker: the request's join (gateway.stream_join) reads the history after
   `last_seq`, delivers it, then the held live events, deduplicated by seq. With no owner the
   history is read at once (a finished request completes from it); with no marker within
   `ATTACH_RETRY_S` the attach is re-sent to the then-current owner and the history read again
   (the owner may have changed).
The per-key concurrency slot stays with the request: a resume takes no new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from redis.exceptions import RedisError

from gateway.auth import may_resume
from gateway.request_state import Phase, RequestState
from gateway.requests import RequestTable
from gateway.submit import Submitter
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Resume
from shared.streams import META_KEY, META_TOOLS
from shared.logs import rid_of

log = logging.getLogger("gateway.resume")

ATTACH_RETRY_S = 1.0


class OrphanCancelled(Exception):
    """The request an idempotent re-send would attach to was cancelled as an orphan first."""

    def __init__(self, rid: str):
        super().__init__(rid)
        self.rid = rid


class ResumeBudget:
    """At most `per_min` resume attempts per socket per minute: request ids are unguessable, and
    this keeps anyone from even trying many of them over one socket. The minute starts at the
    first attempt (not on the clock's minute), so a burst is never split across two windows."""

    __slots__ = ("per_min", "clock", "started", "used")

    def __init__(self, per_min: int, clock=time.monotonic):
        self.per_min = per_min
        self.clock = clock
        self.started: float | None = None
        self.used = 0

    def take(self, cid: str) -> None:
        if self.per_min <= 0:
            return
        now = self.clock()
        if self.started is None or now - self.started >= 60:
            self.started, self.used = now, 0
        self.used += 1
        if self.used > self.per_min:
            raise ProtocolError(ErrorCode.RATE_LIMITED, f"at most {self.per_min} resume attempts per minute "
                                                        "on one socket", cid)


class Resumer:
    def __init__(self, submitter: Submitter):
        self.submitter = submitter

    async def reattach(self, requests: RequestTable, key_id: str, msg: Resume,
                       accept: Callable[[RequestState], None], *, restart_orphan: bool = False) -> RequestState:
        """Open `msg.id` in `requests` again and join its history after `msg.last_seq` with live
        output; `accept` tells the client (transport-specific) before the history is fed.
        `restart_orphan` (an idempotent re-send): raise `OrphanCancelled` instead when an orphan
        sweep cancelled the request before this attach (its client never saw any of it)."""
        cid = msg.id
        rid = msg.request_id      # required by the schema: the 128-bit secret from `accepted`
        meta = await self.submitter.lookup(rid)
        if meta is None or not may_resume(meta.get(META_KEY), key_id):
            # the same answer whether the id is unknown or another key's: no hint that it exists
            raise ProtocolError(ErrorCode.RESUME_EXPIRED, f"no retained output for request {cid!r}", cid)
        req = requests.open(cid, rid, key_id, skip_seq=msg.last_seq, resumed=True)
        req.tool_mode = meta.get(META_TOOLS) or None
        try:
            attached = await self.submitter.attach(rid)
        except (RedisError, OSError):
            requests.drop(req)
            raise
        if attached.orphaned and restart_orphan:
            requests.drop(req)           # cancelled as an orphan before this attach: start it again
            raise OrphanCancelled(rid)
        req.att, owner = attached.att, attached.owner
        req.advance(Phase.STARTED)
        log.debug("request %s resumed here as %r after seq %d (owner %s)", rid, cid, msg.last_seq, owner or "none",
                  extra=rid_of(rid))
        accept(req)
        if owner is None:
            requests.read_now(req)   # nobody runs it now: the history is all there is so far
        self._schedule_retry(requests, req)
        return req

    def _schedule_retry(self, requests: RequestTable, req: RequestState) -> None:
        loop = asyncio.get_running_loop()
        req.attach_timer = loop.call_later(
            ATTACH_RETRY_S, lambda: loop.create_task(self._retry_attach(requests, req)))

    async def _retry_attach(self, requests: RequestTable, req: RequestState) -> None:
        """No marker yet: the owner may have changed or died. Ask the current owner again and
        read the history meanwhile (live events stay held until a marker comes)."""
        req.attach_timer = None
        if not req.join.attaching or req.finished:
            return
        try:
            owner = await self.submitter.owner(req.rid)
            if owner:
                await self.submitter.send_attach(req.rid, owner, req.att)
        except (RedisError, OSError) as exc:
            log.warning("re-attach of %s failed: %s", req.rid, exc, extra=rid_of(req.rid))
        requests.read_now(req)
        if req.join.attaching and not req.finished:
            self._schedule_retry(requests, req)

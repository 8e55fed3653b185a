"""The one request core both transports use: start a request (or re-attach to the one its
idempotency key already started), resume one, cancel one, and the one "draining" refusal.

A WebSocket (gateway.ws.dispatch) and an OpenAI HTTP request (gateway.openai.routes) differ in
how a request comes in and how its output goes out; what happens to it in between is written
here once, over the parts that do the work: the `RequestStarter` (caps, admission, the submit
round trip), the `Resumer` (authorization, attach, the history/live join) and the `Submitter`
(the cancel flag and the owner's control stream). Each transport keeps only its own protocol:
how a refusal is shown, what accepting looks like, what a second cancel means.
"""

from __future__ import annotations

import logging
from typing import Callable

from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.new_request import AlreadyStarted, RequestStarter
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.resume import OrphanCancelled, Resumer
from gateway.sessions import Sessions
from gateway.stream_join import StreamJoin
from gateway.submit import Submitter
from gateway.writer import SHUTDOWN_REASON
from shared.errors import ErrorCode, ProtocolError
from shared.events import TokEvent
from shared.logs import rid_of
from shared.protocol import Generate, Resume

log = logging.getLogger("gateway.requests")

Accept = Callable[[RequestState], None]
RESTARTS = 3        # an idempotent re-send starting its orphan-cancelled request again, at most this often


class RequestCore:
    def __init__(self, *, starter: RequestStarter, resumer: Resumer, submitter: Submitter, sessions: Sessions,
                 metrics: GatewayMetrics):
        self.starter = starter
        self.resumer = resumer
        self.submitter = submitter
        self.sessions = sessions
        self.metrics = metrics

    def check_open(self, client_id: str | None = None) -> None:
        """Refuse new work while this replica drains (`shutting_down`: retry on another one)."""
        if self.sessions.draining:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON, client_id)

    async def start_or_attach(self, requests: RequestTable, key_id: str, msg: Generate, *, accept: Accept,
                              rid: str | None = None, attach_as: Callable[[str], str] | None = None) -> RequestState:
        """A new request in `requests`; or, when `msg`'s idempotency key already started one (a
        client that re-sent its generate), that request, re-attached from its first token as
        `attach_as(its rid)` (default: `msg.id`). `accept` tells the client (transport-specific).
        `rid`: the server id to use for a new request (the HTTP API names its response after it).
        A re-send whose request an orphan sweep cancelled before it could attach (the client's
        socket dropped before `accepted`, and the resume grace ran out) starts it again instead,
        under the same key (the orphan's slot released): the client never saw any of it."""
        replaces = ""
        for _ in range(RESTARTS):
            try:
                req = await self.starter.start(requests, key_id, msg, rid=rid, replaces=replaces)
            except AlreadyStarted as first:
                running = next((r.client_id for r in requests.values() if r.rid == first.rid), None)
                if running is not None:
                    raise ProtocolError(ErrorCode.DUPLICATE_ID, f"idempotency_key already names request "
                                                                f"{running!r} on this socket", msg.id) from None
                client_id = attach_as(first.rid) if attach_as is not None else msg.id
                try:
                    return await self.resumer.reattach(requests, key_id, Resume(id=client_id, last_seq=0,
                                                                                request_id=first.rid), accept,
                                                       restart_orphan=True)
                except OrphanCancelled as gone:
                    # an orphan sweep cancelled it before we attached (its client never saw it):
                    # start it again under the same key instead of attaching to a cancelled request
                    log.info("request %s was cancelled as an orphan before its re-send attached; starting it "
                             "again", gone.rid, extra=rid_of(gone.rid))
                    replaces = gone.rid
                    continue
            accept(req)
            return req
        raise ProtocolError(ErrorCode.BACKEND_UNAVAILABLE, "the request kept being cancelled as an orphan while it "
                                                           "was started again; send it again", msg.id)

    async def resume(self, requests: RequestTable, key_id: str, msg: Resume, *, accept: Accept,
                     check: Callable[[], None] = lambda: None) -> RequestState:
        """Re-attach a request started on an earlier connection (gateway.resume), counting the
        outcome in `gateway_resumes`; `check`: the transport's own refusals, counted too."""
        outcome = "attached"
        try:
            check()
            return await self.resumer.reattach(requests, key_id, msg, accept)
        except ProtocolError as exc:
            outcome = exc.code.value
            raise
        except (RedisError, OSError):
            outcome = ErrorCode.BACKEND_UNAVAILABLE.value
            raise
        finally:
            self.metrics.resumes.labels(outcome).inc()

    async def cancel(self, requests: RequestTable, req: RequestState, origin: str, *,
                     session_ending: bool = False) -> None:
        """The client cancelled `req` (`origin`: client, a cancel message; http_disconnect, its
        HTTP client went away): the cancel flag, and a cancel routed to the owning worker.

        The session stays (a socket): a request still queued ends now, as `cancelled` (no worker
        holds it, and the flag, set first, keeps any from starting it), and one a worker runs
        ends here anyway if no worker confirms within CANCEL_FALLBACK_S. The session is ending
        (`session_ending`): it never sees the request's `done`, so the request is counted here;
        a Redis failure is only logged (nobody is left to tell)."""
        req.cancelling(origin)    # once its session is gone, its final: request_log.CancelWatch
        if session_ending:
            self.metrics.requests.labels("cancelled").inc()
        self.metrics.cancels.labels(origin).inc()
        try:
            owner = await self.submitter.cancel(req.rid)     # flag + owner's control stream
        except (RedisError, OSError) as exc:
            if not session_ending:
                raise
            log.warning("could not cancel %s after a client disconnect: %s", req.rid, exc, extra=rid_of(req.rid))
            return
        if session_ending:
            if owner is None:
                req.cancel_at = None     # still queued: it never starts, no slot to free, nothing to time
        elif owner is None:
            requests.end_cancelled(req)
        else:
            requests.start_cancel_fallback(req)

    async def text_through(self, rid: str, seq: int) -> str:
        """The answer's text through token `seq`, as its history holds it: what a client resuming
        after `seq` has read already (its tool-call parser is rebuilt from it, gateway.openai)."""
        parts: list[str] = []
        for ev in StreamJoin(0, rid=rid).history(await self.submitter.read_history(rid, 0)):
            if not isinstance(ev, TokEvent) or ev.seq - len(ev.ids) >= seq:
                break
            if ev.seq <= seq:
                parts.append(ev.text)
                continue
            rest = ev.tail(seq)           # the event the resume point falls in: its head
            if rest is not None:
                parts.append(ev.text[:len(ev.text) - len(rest.text)])
            break
        return "".join(parts)

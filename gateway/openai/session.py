"""One OpenAI HTTP request as a session: the same request table, `Sender` and watchdogs as a
WebSocket (gateway.sessions), with the response (gateway.openai.response) as its `Writer`.

The composition root builds the session (`Hub.http_session`) before the request starts, so
the request is subscribed in its table; `RunRequest`, the ASGI response a route returns, hands
it the response to write to once Starlette calls it, and drives the request to its end. A
client that disconnects cancels its request at once (through the request core), unless it
asked for `"resumable": true`: then the request waits RESUME_GRACE_S for a reconnect, as a
dropped socket's.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.openai.choices import Choice
from gateway.openai.response import OpenAIResponse
from gateway.request_core import RequestCore
from gateway.request_state import Phase, RequestState
from gateway.requests import RequestTable
from gateway.sender import Sender
from gateway.sessions import Sessions, StreamingSession
from gateway.wake import WakeEvent
from gateway.writer import Writer
from shared.protocol import Accepted


class HttpSession(StreamingSession):
    """One HTTP response as a session: drained, watched and heartbeaten like a socket."""

    def __init__(self, requests: RequestTable, wake: WakeEvent, sessions: Sessions,
                 sender_for: Callable[[Writer], Sender]):
        super().__init__(requests, sessions)
        self.wake = wake
        self._sender_for = sender_for
        self.drained = False

    def stream(self, out: Writer, reqs: RequestState | list[RequestState], *, heartbeats: bool) -> None:
        """Write `reqs` (an answer's choices: one request each) to `out` from now on: open as a
        session, accepted, the sender started."""
        self._attach(out, self._sender_for(out))
        # keep-alive comments on a quiet stream, from the process-wide wheel
        self.sessions.open(self, heartbeats=heartbeats)
        for req in reqs if isinstance(reqs, list) else [reqs]:
            self.sender.queue(Accepted(id=req.client_id, request_id=req.rid))
            req.advance(Phase.STREAMING)  # (a resumed request's history is buffered already, flushed from here)
        self.wake.set()                   # starts the sender task

    def shut_down(self) -> None:
        self.drained = True
        super().shut_down()


class RunRequest(Response):
    """Drives one accepted request to its end over HTTP, with the WebSocket path's Sender."""

    def __init__(self, session: HttpSession, req: RequestState | list[RequestState], core: RequestCore, *,
                 model: str, stream: bool, include_usage: bool, resumable: bool, tools=None,
                 continuous_usage: bool = False, choices: dict[str, Choice] | None = None, echo_only: bool = False):
        # `n` > 1: one request per choice (gateway.openai.choices), the first names the answer
        self.reqs = req if isinstance(req, list) else [req]
        self.session, self.req, self.core = session, self.reqs[0], core
        self.tools, self.choices, self.echo_only = tools, choices, echo_only
        self.continuous_usage = continuous_usage and include_usage and stream
        self.model, self.stream, self.include_usage, self.resumable = model, stream, include_usage, resumable
        self.background = None
        self.out: OpenAIResponse | None = None

    def writer(self, send: Send, headers: list[tuple[bytes, bytes]]) -> OpenAIResponse:
        """The response the session writes to (the Responses API's is a subclass)."""
        req = self.req
        return OpenAIResponse(send, oai_id=req.client_id, model=self.model, stream=self.stream,
                              include_usage=self.include_usage, role_chunk=req.seq == 0, tools=self.tools,
                              prompt_tokens=(lambda: req.prompt_tokens) if self.continuous_usage else None,
                              headers=headers, choices=self.choices, echo_only=self.echo_only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req, conn = self.req, self.session
        out = self.out = self.writer(send, [(b"content-type", b"text/event-stream; charset=utf-8"),
                                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                                            (b"x-request-id", req.rid.encode())])
        disconnect = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        ended = asyncio.get_running_loop().create_task(out.ended.wait())
        gone = False
        try:
            conn.stream(out, self.reqs, heartbeats=self.stream)
            await asyncio.wait([disconnect, ended], return_when=asyncio.FIRST_COMPLETED)
            gone = disconnect.done() or out.broken
            if gone and out.done is None and not conn.drained and not self.resumable:
                # nobody is listening and nobody will come back: every choice still running ends
                # (the sender stops first: no `done` is sent, nor counted, while they are cancelled)
                await conn.sender.stop()
                await cancel_all(self.core, conn, [r for r in self.reqs if not r.finished])
        finally:
            disconnect.cancel()
            ended.cancel()
            await conn.end()      # a resumable or drained request is parked for a resume
        if gone:
            return
        if out.committed:
            await _end_body(send)
            return
        # stream: false, or a stream that ended before its first event (refused by the worker)
        status, body = out.body()
        headers = {"x-request-id": req.rid}
        if status in (429, 503):
            headers["Retry-After"] = "1"
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


async def cancel_all(core: RequestCore, session: HttpSession, reqs: list[RequestState]) -> None:
    """Cancel `reqs` of a session nobody listens to (its client went away, or an answer whose
    later choices could not start)."""
    for req in reqs:
        await core.cancel(session.requests, req, "http_disconnect", session_ending=True)


async def _wait_disconnect(receive: Receive) -> bool:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True


async def _end_body(send: Send) -> None:
    try:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (OSError, RuntimeError):
        pass

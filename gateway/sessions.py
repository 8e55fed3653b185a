"""The open sessions of this replica, and what both transports share.

Both a WebSocket (gateway.ws.connection) and an HTTP response (gateway.openai.session) are a
`StreamingSession`: a `Writer` (gateway.writer: a `FrameSocket`, or the OpenAI response), a
request table and the one sender; they differ only in how requests come in. `Sessions` is the
registry the housekeeping watchdogs and the drain walk.
"""

from __future__ import annotations

import asyncio
import time

from gateway.heartbeats import HeartbeatWheel
from gateway.requests import RequestTable
from gateway.sender import Sender
from gateway.session import Session
from gateway.writer import CLOSE_SERVICE_RESTART, SHUTDOWN_REASON, Writer
from shared.errors import ErrorCode
from shared.protocol import Error

DRAIN_TIMEOUT_S = 5.0     # how long a drain waits for its sessions (the Helm chart's grace period counts it)


class Sessions:
    """Every open session of this replica, and the busy ones (their sender task runs: something
    to send, a request in flight), which are the only ones the watchdogs need to look at; idle
    sessions cost nothing."""

    def __init__(self, heartbeats: HeartbeatWheel):
        self.heartbeats = heartbeats
        self.all: set[Session] = set()
        self.busy: set[Session] = set()
        self.draining = False

    def open(self, session: Session, *, heartbeats: bool = True) -> None:
        self.all.add(session)
        if heartbeats:
            self.heartbeats.add(session, session.last_send + self.heartbeats.interval_s)

    def close(self, session: Session) -> None:
        session.closed = True
        self.all.discard(session)
        self.busy.discard(session)

    def running(self, session: Session, running: bool) -> None:
        if running and not session.closed:
            self.busy.add(session)
        else:
            self.busy.discard(session)

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Tell every session to reconnect elsewhere (SHUTTING_DOWN, close 1012) and wait for them.

        Their unfinished requests are parked as orphans with the resume grace, so the client can
        `resume` on another replica, and another replica's sweeper cancels them if it does not.
        """
        self.draining = True
        for session in list(self.all):
            session.shut_down()
        deadline = time.monotonic() + timeout
        while self.all and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class StreamingSession:
    """What both transports share: the writer, the request table and the sender over them. A
    WebSocket has its writer from the start; an HTTP session gets its response when it streams."""

    socket: Writer
    sender: Sender

    def __init__(self, requests: RequestTable, sessions: Sessions, socket: Writer | None = None,
                 sender: Sender | None = None):
        self.requests = requests
        self.sessions = sessions
        self.closed = False
        if socket is not None and sender is not None:
            self._attach(socket, sender)

    def _attach(self, socket: Writer, sender: Sender) -> None:
        self.socket = socket
        self.sender = sender
        sender.on_running = lambda running: self.sessions.running(self, running)

    @property
    def last_send(self) -> float:
        return self.socket.last_send

    def heartbeat(self) -> None:
        self.sender.heartbeat()

    def shut_down(self) -> None:
        """Graceful drain: tell the client to go elsewhere and resume there."""
        self.sender.push_final(Error(code=ErrorCode.SHUTTING_DOWN, message=SHUTDOWN_REASON, retryable=True))
        self.sender.close_after_flush(CLOSE_SERVICE_RESTART, SHUTDOWN_REASON)

    def check_slow(self, now: float) -> None:
        self.sender.check_slow(now)

    def end_stalled(self, now: float, stall_s: float) -> list[str]:
        """Request ids ended here for lack of progress (the caller cancels them in Redis)."""
        if not len(self.requests):
            return []
        return [req.rid for req in self.requests.end_stalled(now, stall_s)]

    def held_slots(self) -> list[tuple[str, str]]:
        return self.requests.held_slots()

    async def end(self) -> None:
        """The transport is gone: stop sending, hand unfinished requests to the bookkeeper."""
        self.closed = True
        await self.sender.stop()
        self.sessions.close(self)
        self.requests.release_all()

"""One client WebSocket: a reader loop, a table of the requests multiplexed on it, one sender.

The parts, each in its own module:
* socket_io.py  `FrameSocket`: encode/send one frame, time the send, close.
* dispatch.py   `MessageHandler`: the reader loop; auth, generate, cancel, ping (resume.py: resume).
* requests.py   `RequestTable`: each request from acceptance to its one `done`; output events.
* sender.py     `Sender`: the one writing task: control frames, due chunks (flusher.py), `done`,
                heartbeats, slow-consumer closes.
* frames.py     `chunk`/`done` frames from shared/protocol.py's models.

Terminal messages: every accepted request ends with exactly one `done`. A worker-side failure
becomes `done` with finish_reason "error" and `error: {code, message, retryable}`; an `error`
message with an id means the message was refused and nothing was started (or resumed) for it.
"""

from __future__ import annotations

from starlette.websockets import WebSocketDisconnect

from gateway.dispatch import MessageHandler
from gateway.hub import Hub
from gateway.requests import RequestTable
from gateway.sender import Sender, WakeEvent
from gateway.socket_caps import SocketClaim
from gateway.socket_io import CLOSE_SERVICE_RESTART, SHUTDOWN_REASON, FrameSocket
from shared.errors import ErrorCode
from shared.protocol import Error


class Connection:
    def __init__(self, hub: Hub, socket: FrameSocket, *, key_id: str | None, claim: SocketClaim):
        self.hub = hub
        wake = WakeEvent()       # set whenever the sender has something to do
        self.closed = False
        self.socket = socket
        self.requests = RequestTable(hub, wake)
        self.sender = Sender(self.socket, self.requests, wake, hub.settings, hub.metrics,
                             on_running=self._sender_running)
        self.handler = MessageHandler(hub, self.socket, self.sender, self.requests, key_id=key_id, claim=claim)

    async def run(self) -> None:
        hub = self.hub
        hub.connections.add(self)
        hub.metrics.active_sockets.inc()
        hub.heartbeats.add(self, self.socket.last_send + hub.settings.heartbeat_s)
        try:
            await self.handler.read_loop()
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            await self.sender.stop()
            hub.busy.discard(self)
            await self.requests.release_all()
            hub.connections.discard(self)
            hub.metrics.active_sockets.dec()

    def _sender_running(self, running: bool) -> None:
        (self.hub.busy.add if running else self.hub.busy.discard)(self)

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

"""One client WebSocket: a reader loop, a table of the requests multiplexed on it, one sender.

The parts, each in its own module:
* ws/socket.py       `FrameSocket`: encode/send one frame, time the send, close (a `Writer`).
* ws/dispatch.py     `MessageHandler`: the reader loop; auth, generate, cancel, resume, ping,
                     over the one request core (gateway/request_core.py).
* requests.py        `RequestTable`: each request from acceptance to its one `done`; output
                     events through each request's join (stream_join.py).
* sender.py          `Sender`: the one writing task: control frames, due chunks (flusher.py),
                     `done`, heartbeats, slow-consumer closes.
* frames.py          `chunk`/`done` frames from shared/protocol.py's models.
The composition root builds them (`Hub.websocket_session`); this class only runs them as a
session (sessions.py), the same kind of session an HTTP response is.

Terminal messages: every accepted request ends with exactly one `done`. A worker-side failure
becomes `done` with finish_reason "error" and `error: {code, message, retryable}`; an `error`
message with an id means the message was refused and nothing was started (or resumed) for it.
"""

from __future__ import annotations

from starlette.websockets import WebSocketDisconnect

from gateway.metrics import GatewayMetrics
from gateway.requests import RequestTable
from gateway.sender import Sender
from gateway.sessions import Sessions, StreamingSession
from gateway.writer import CLOSE_SERVICE_RESTART
from gateway.ws.dispatch import MessageHandler
from gateway.ws.socket import FrameSocket

CLIENT_CLOSES = (1000, 1001)      # a close frame from the client: normal closure, going away


class Connection(StreamingSession):
    def __init__(self, socket: FrameSocket, requests: RequestTable, sender: Sender, handler: MessageHandler,
                 sessions: Sessions, metrics: GatewayMetrics):
        super().__init__(requests, sessions, socket, sender)
        self.handler = handler
        self.metrics = metrics

    async def run(self) -> None:
        self.sessions.open(self)
        self.metrics.active_sockets.inc()
        try:
            await self.handler.read_loop()
        except WebSocketDisconnect as exc:
            self.handler.disconnect_code = exc.code
        finally:
            await self.end()
            self.metrics.active_sockets.dec()
            self.metrics.socket_closes.labels(self.close_reason()).inc()

    def close_reason(self) -> str:
        """The server's reason when it closed the socket, else `client` (a close frame) or `lost`
        (no close frame: a network drop, a proxy's idle timeout, a ping timeout)."""
        if self.sender.closing is not None:
            code, reason = self.sender.closing
            return "shutting_down" if code == CLOSE_SERVICE_RESTART else reason
        return "client" if self.handler.disconnect_code in CLIENT_CLOSES else "lost"

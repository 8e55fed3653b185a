"""One client WebSocket as frames: encode a server message, send it, time the send, close.

The encoding (JSON text or msgpack binary) is fixed at the handshake; everything above this
module deals in `shared/protocol.py` models, never in bytes. `send_started` is set while a send
is in progress, so a watchdog can tell a client that stopped reading (see sender.py).
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel
from starlette.websockets import WebSocket

from gateway.metrics import GatewayMetrics
from shared.protocol import encode_server

CLOSE_POLICY = 1008
CLOSE_SERVICE_RESTART = 1012
CLOSE_TRY_AGAIN_LATER = 1013
SHUTDOWN_REASON = "server restarting: reconnect and resume"


class FrameSocket:
    def __init__(self, ws: WebSocket, *, binary: bool, metrics: GatewayMetrics):
        self.ws = ws
        self.binary = binary
        self.metrics = metrics
        self.send_started: float | None = None   # monotonic start of the send in progress
        self.last_send = time.monotonic()

    async def receive(self) -> dict:
        return await self.ws.receive()

    async def send(self, msg: BaseModel) -> None:
        payload = encode_server(msg, binary=self.binary)
        self.send_started = time.monotonic()
        try:
            if self.binary:
                await self.ws.send_bytes(payload)
            else:
                await self.ws.send_text(payload)
        finally:
            self.send_started = None
        self.last_send = time.monotonic()
        self.metrics.frames.inc()

    async def close(self, code: int, reason: str) -> None:
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), 2.0)
        except Exception:
            # a client that does not read cannot receive a close frame either: drop the TCP
            # connection so its buffered bytes are freed (ASGI has no abort, so reach the
            # server's transport when the server exposes it, as uvicorn does)
            transport = getattr(getattr(self.ws._send, "__self__", None), "transport", None)
            if transport is not None:
                transport.abort()

"""One client WebSocket as frames: encode a server message, send it, time the send, close, abort.

The encoding (JSON text or msgpack binary) is fixed at the handshake; everything above this
module deals in `shared/protocol.py` models, never in bytes. `send_started` is set while a send
is in progress, so a watchdog can tell a client that stopped reading (see gateway/sender.py).

ASGI has no "abort": a close frame queued behind megabytes a client never reads is never
delivered, and uvicorn's close waits for the write buffer to drain. `ExposeTransport` (an ASGI
middleware) records the server's transport in the scope, so `abort()` can drop the TCP
connection and free its buffers.

It also corks the transport (`CorkedTransport`): the frames a sender pass writes to one socket
(the chunks of its streams that came due together, gateway/sender.py) leave in one write, one
syscall, at the end of the pass (`flush`; other writes at the end of the event-loop
iteration), instead of one each. The socket write was a
third of the gateway's CPU at 256 streams (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket as _socket
import time

from pydantic import BaseModel
from starlette.websockets import WebSocket

from gateway.metrics import GatewayMetrics
from gateway.writer import Payload
from gateway.ws.tool_frames import ToolFrames
from shared.protocol import Chunk, Done, encode_server

log = logging.getLogger("gateway.connection")

CLOSE_TIMEOUT_S = 2.0
TRANSPORT_SCOPE_KEY = "llm_stream.transport"


class CorkedTransport:
    """An asyncio transport whose writes within one event-loop iteration go out as one write
    (the module docstring). A close first writes what is held; an abort drops it, as the
    transport's own abort drops its buffer. Everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._held:
            asyncio.get_running_loop().call_soon(self.flush)
        self._held.append(data)

    def writelines(self, chunks) -> None:
        for data in chunks:
            self.write(data)

    def flush(self) -> None:
        if self._held:
            data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
            self._held = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class ExposeTransport:
    """ASGI middleware: put the server's asyncio transport (uvicorn's protocol has one) in the
    scope, corked (`CorkedTransport`) where the protocol writes through that attribute."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            protocol = getattr(send, "__self__", None)
            transport = getattr(protocol, "transport", None)
            if transport is not None:
                if not isinstance(transport, CorkedTransport):
                    transport = protocol.transport = CorkedTransport(transport)
                scope[TRANSPORT_SCOPE_KEY] = transport
        await self.app(scope, receive, send)


class FrameSocket:
    """The `Writer` (gateway.writer) of a WebSocket, and its reading side."""

    def __init__(self, ws: WebSocket, *, binary: bool, metrics: GatewayMetrics):
        self.ws = ws
        self.binary = binary
        self.metrics = metrics
        self.send_started: float | None = None   # monotonic start of the send in progress
        self.last_send = time.monotonic()
        self.tools: ToolFrames | None = None     # typed tool-call frames (gateway.ws.tool_frames)

    async def receive(self) -> dict:
        return await self.ws.receive()

    def encode(self, msg: BaseModel) -> Payload:
        return encode_server(msg, binary=self.binary)

    async def send(self, msg: BaseModel) -> None:
        if self.tools is not None and isinstance(msg, (Chunk, Done)):
            for frame in await self.tools.frames(msg):      # a request with tools: its calls, typed, first
                await self.send_payload(self.encode(frame))
        await self.send_payload(self.encode(msg))

    async def send_payload(self, payload: Payload) -> None:
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

    def flush(self) -> None:
        transport = self.ws.scope.get(TRANSPORT_SCOPE_KEY)
        if isinstance(transport, CorkedTransport):
            transport.flush()

    async def close(self, code: int, reason: str, *, last: BaseModel | None = None) -> None:
        """Send `last` (the typed explanation), then a close frame; abort if the client does not take them."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if last is not None:
                    await self.send(last)
                await self.ws.close(code=code, reason=reason)
        except Exception:
            # a client that does not read cannot receive a close frame either
            self.abort()

    def limit_send_buffer(self, nbytes: int) -> None:
        """Cap the kernel's send buffer of this socket (SO_SNDBUF; Linux doubles the value). The
        kernel otherwise grows it up to net.ipv4.tcp_wmem's max (4 MiB) for a client that does
        not read, before a send ever blocks; token streams need far less, even over long links."""
        transport = self.ws.scope.get(TRANSPORT_SCOPE_KEY)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and nbytes > 0:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, nbytes)

    def abort(self) -> None:
        """Drop the TCP connection at once (buffered output is discarded)."""
        transport = self.ws.scope.get(TRANSPORT_SCOPE_KEY)
        if transport is None:
            log.warning("cannot abort a socket: the server exposes no transport")
            return
        transport.abort()   # also when a graceful close is already waiting for the buffer to drain

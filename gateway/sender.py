"""The one task that writes to a socket: control frames, due chunks, `done`, heartbeats, the close.

Each pass sends queued control frames, then every request buffer that is due (the flush policy
is flusher.py's), then `done` once a finished request's buffer is empty; an idle socket gets a
`heartbeat`. Chunks are never queued as frames: while the client is slow, tokens merge into
the buffer, so memory is bounded by output text (max_tokens x requests), not by frame count.
Control frames are bounded by `send_queue_max`; a client that lets them pile up, or that
blocks one send for `slow_consumer_s`, is closed with SLOW_CONSUMER.

Closing (`close_after_flush`): everything buffered is handed over first, so a resume has least
to replay, and the closing explanation (e.g. shutting_down) is the last frame before the close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from starlette.websockets import WebSocketDisconnect

from gateway.frames import chunk_frame
from gateway.metrics import GatewayMetrics
from gateway.requests import RequestState, RequestTable
from gateway.settings import GatewaySettings
from gateway.socket_io import CLOSE_TRY_AGAIN_LATER, FrameSocket
from shared.errors import ErrorCode
from shared.protocol import Heartbeat

log = logging.getLogger("gateway.connection")


class Sender:
    def __init__(self, socket: FrameSocket, requests: RequestTable, wake: asyncio.Event, settings: GatewaySettings,
                 metrics: GatewayMetrics):
        self.socket = socket
        self.requests = requests
        self.s = settings
        self.metrics = metrics
        self._wake = wake
        self._control: deque[Any] = deque()
        self._task: asyncio.Task | None = None
        self.closing: tuple[int, str] | None = None
        self._stopped = False

    # ------------------------------------------------------------------ task

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._send_loop())
        self._task.add_done_callback(self._ended)

    async def stop(self) -> None:
        self._stopped = True
        if self._task and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def wait(self, timeout: float) -> None:
        """Let the sender finish (e.g. deliver a refusal and close), at most `timeout` seconds."""
        if self._task:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self._stopped:
            exc = task.exception()
            if not isinstance(exc, (WebSocketDisconnect, OSError, RuntimeError)):
                log.error("sender failed: %r", exc)

    # ------------------------------------------------------------------ control frames

    def queue(self, msg: Any) -> None:
        """Queue a control frame; a client that lets them pile up is closed as a slow consumer."""
        if len(self._control) >= self.s.send_queue_max:
            self.abort_slow(f"{len(self._control)} control frames unread")
            return
        self._control.append(msg)
        self._wake.set()

    def push_final(self, msg: Any) -> None:
        """Queue a frame that explains a close (not subject to the bound: the socket is closing anyway)."""
        self._control.append(msg)

    # ------------------------------------------------------------------ closing

    def close_after_flush(self, code: int, reason: str) -> None:
        if self.closing is None:
            self.closing = (code, reason)
        self._wake.set()

    def check_slow(self, now: float) -> None:
        """Watchdog (housekeeping loop): a send stuck this long means the client is not reading."""
        started = self.socket.send_started
        if started is not None and now - started > self.s.slow_consumer_s and self._task:
            self.abort_slow("the client did not read for %.0fs" % (now - started))

    def abort_slow(self, why: str) -> None:
        if self.closing is not None and self.closing[0] == CLOSE_TRY_AGAIN_LATER:
            return
        log.info("closing slow consumer: %s", why)
        self.metrics.slow_consumers.inc()
        self.closing = (CLOSE_TRY_AGAIN_LATER, ErrorCode.SLOW_CONSUMER.value)
        if self._task:
            self._task.cancel()
        asyncio.get_running_loop().create_task(self.socket.close(CLOSE_TRY_AGAIN_LATER, ErrorCode.SLOW_CONSUMER.value))

    # ------------------------------------------------------------------ the loop

    async def _send_loop(self) -> None:
        hb = self.s.heartbeat_s
        socket = self.socket
        while True:
            timeout = self._next_timeout(hb)
            if not self._wake.is_set() and timeout > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            now = time.monotonic()
            closing = self.closing is not None
            if not closing:
                while self._control:
                    await socket.send(self._control.popleft())
            for req in self.requests.values():
                if req.accepted and not req.finished:
                    # closing: hand over everything buffered, so a resume has least to replay
                    await self._flush_request(req, float("inf") if closing else now)
            if closing:
                # the closing explanation (e.g. shutting_down) is the last frame before the close
                while self._control:
                    await socket.send(self._control.popleft())
                code, reason = self.closing
                await socket.close(code, reason)
                return
            if hb > 0 and time.monotonic() - socket.last_send >= hb:
                await socket.send(Heartbeat(ts=time.time()))

    def _next_timeout(self, hb: float) -> float:
        now = time.monotonic()
        soonest = self.socket.last_send + hb if hb > 0 else now + 3600
        for req in self.requests.values():
            d = req.buffer.deadline()
            if d is not None and d < soonest:
                soonest = d
        return max(0.0, soonest - now)

    async def _flush_request(self, req: RequestState, now: float) -> None:
        if req.buffer.due(now) or (req.final is not None and not req.buffer.empty):
            await self._send_chunk(req, req.buffer.take(now))
        if req.final is not None and req.buffer.empty and not req.finished:
            await self.socket.send(await self.requests.finish(req))

    async def _send_chunk(self, req: RequestState, pending) -> None:
        m = self.metrics
        now = time.monotonic()
        if req.first_sent is None:
            req.first_sent = now
            if not req.resumed:
                m.ttft.observe(now - req.started)
        elif req.last_sent is not None:
            m.inter_chunk.observe(now - req.last_sent)
        req.last_sent = now
        req.seq = pending.seq
        m.flushes.inc()
        m.tokens.inc(pending.tokens)
        await self.socket.send(chunk_frame(req.client_id, pending))

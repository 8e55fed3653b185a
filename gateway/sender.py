"""The one task that writes to a session's `Writer` (gateway.writer: a WebSocket, or an OpenAI
HTTP response): control frames, due chunks, `done`, heartbeats, the close.

Each pass sends queued control frames, then every request buffer that is due or nearly (the
flush policy is flusher.py's), then `done` once a finished request's buffer is empty; an idle
socket gets a `heartbeat`. Chunks are never queued as frames: while the client is slow, tokens
merge into the buffer, so memory is bounded by output text (max_tokens x requests), not by
frame count. Control frames are encoded when queued and bounded by count (`send_queue_max`)
and bytes (`send_queue_max_bytes`); a client that lets them pile up, or that blocks one send for
`slow_consumer_s`, gets a `slow_consumer` error and close 1013 if it takes them within a
moment, and is aborted (TCP dropped) otherwise.

A sender that fails (a bug, an unencodable frame) never leaves the socket open and silent: the
client gets an `internal` error and close 1011 (or an abort), then resumes elsewhere.

Closing (`close_after_flush`): everything buffered is handed over first, so a resume has least
to replay, and the closing explanation (e.g. shutting_down) is the last frame before the close.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect

from gateway.frames import chunk_frame
from gateway.metrics import GatewayMetrics
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.settings import GatewaySettings
from gateway.wake import WakeEvent
from gateway.writer import CLOSE_INTERNAL_ERROR, CLOSE_TRY_AGAIN_LATER, Payload, Writer
from shared.aio import cancel_and_wait, wait_event
from shared.errors import ErrorCode
from shared.protocol import Error, Heartbeat

log = logging.getLogger("gateway.connection")


class Sender:
    def __init__(self, socket: Writer, requests: RequestTable, wake: WakeEvent, settings: GatewaySettings,
                 metrics: GatewayMetrics):
        self.socket = socket
        self.requests = requests
        self.s = settings
        self.metrics = metrics
        self._wake = wake
        self._control: deque[Payload] = deque()
        self._control_bytes = 0
        # backpressure on the reader: set while the control queue is below half its bounds
        self.drained = asyncio.Event()
        self.drained.set()
        self._task: asyncio.Task | None = None
        self.closing: tuple[int, str] | None = None
        self._stopped = False
        self._over = False          # the socket was closed, aborted or failed: nothing more goes out
        self._heartbeat_due = False
        self.on_running = lambda running: None   # told when the sender task starts and ends (Sessions.busy)
        wake.on_set = self._ensure_running

    # ------------------------------------------------------------------ task

    def _ensure_running(self) -> None:
        """Start the sender task unless it runs; it ends by itself once the socket is idle."""
        if self._stopped or self._over or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._send_loop())
        self._task.add_done_callback(self._ended)
        self.on_running(True)

    def heartbeat(self) -> None:
        """Called by the heartbeat wheel: nothing was sent for HEARTBEAT_S."""
        self._heartbeat_due = True
        self._wake.set()

    async def stop(self) -> None:
        self._stopped = True
        await cancel_and_wait(self._task)
        self._discard_control()

    async def wait(self, timeout: float) -> None:
        """Let the sender finish (e.g. deliver a refusal and close), at most `timeout` seconds."""
        if self._task:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass

    def _ended(self, task: asyncio.Task) -> None:
        if task is self._task:      # (a newer task may already run: it stays busy)
            self._wake.until = math.inf
            self.on_running(False)
        if task.cancelled() or task.exception() is None or self._stopped:
            return
        exc = task.exception()
        self._over = True
        self._discard_control()     # also releases a reader held back by backpressure, so it sees the end
        if isinstance(exc, (WebSocketDisconnect, OSError)) or self.closing is not None:
            return      # the client went away or the socket is being closed: the reader sees the disconnect
        log.error("sender failed: %r", exc, exc_info=exc)
        self.metrics.sender_failures.inc()
        self.closing = (CLOSE_INTERNAL_ERROR, ErrorCode.INTERNAL.value)
        failure = Error(code=ErrorCode.INTERNAL, message="the gateway failed to send on this socket: "
                                                         "reconnect and resume", retryable=True)
        asyncio.get_running_loop().create_task(self.socket.close(CLOSE_INTERNAL_ERROR, ErrorCode.INTERNAL.value,
                                                                 last=failure))

    # ------------------------------------------------------------------ control frames

    def queue(self, msg: BaseModel) -> None:
        """Queue a control frame; a client that lets them pile up is closed as a slow consumer."""
        payload = self.socket.encode(msg)
        if len(self._control) >= self.s.send_queue_max or \
                self._control_bytes + len(payload) > self.s.send_queue_max_bytes:
            self.abort_slow(f"{len(self._control)} control frames ({self._control_bytes} bytes) unread")
            return
        self._push(payload)
        self._wake.set()

    def push_final(self, msg: BaseModel) -> None:
        """Queue a frame that explains a close (not subject to the bound: the socket is closing anyway)."""
        self._push(self.socket.encode(msg))

    def _push(self, payload: Payload) -> None:
        self._control.append(payload)
        self._control_bytes += len(payload)
        self.metrics.control_queue_bytes.inc(len(payload))
        if self._backlogged():
            self.drained.clear()

    def _pop(self) -> Payload:
        payload = self._control.popleft()
        self._control_bytes -= len(payload)
        self.metrics.control_queue_bytes.dec(len(payload))
        if not self.drained.is_set() and not self._backlogged():
            self.drained.set()
        return payload

    def _backlogged(self) -> bool:
        return 2 * len(self._control) >= self.s.send_queue_max or 2 * self._control_bytes >= self.s.send_queue_max_bytes

    def _discard_control(self) -> None:
        self.metrics.control_queue_bytes.dec(self._control_bytes)
        self._control.clear()
        self._control_bytes = 0
        self.drained.set()      # nothing left to wait for (also wakes a reader held back on a dead socket)

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
        self._over = True
        if self._task:
            self._task.cancel()
        self._discard_control()
        notice = Error(code=ErrorCode.SLOW_CONSUMER, message=f"the client did not read: {why}", retryable=True)
        asyncio.get_running_loop().create_task(
            self.socket.close(CLOSE_TRY_AGAIN_LATER, ErrorCode.SLOW_CONSUMER.value, last=notice))

    # ------------------------------------------------------------------ the loop

    async def _send_loop(self) -> None:
        socket, wake = self.socket, self._wake
        while True:
            if not wake.is_set():
                if not self._control and not len(self.requests) and self.closing is None:
                    wake.until = math.inf
                    return      # idle: no task while there is nothing to send (the wheel sends heartbeats)
                now = time.monotonic()
                at = self._next_look(now)
                if at is None:
                    wake.until = math.inf
                    await wake.wait()
                elif at > now:
                    wake.until = at     # buffers due before then wake it (gateway.wake)
                    await wait_event(wake, at - now)  # not wait_for: it can lose stop()'s cancel (3.11)
                else:
                    wake.until = -math.inf
                    await asyncio.sleep(0)  # never starve the loop, whatever is due
            else:
                await asyncio.sleep(0)
            wake.until = -math.inf          # awake: it looks at every buffer before it sleeps again
            wake.clear()
            now = time.monotonic()
            closing = self.closing is not None
            if not closing:
                while self._control:
                    await socket.send_payload(self._pop())
            for req in self.requests.values():
                if req.streaming:
                    # closing: hand over everything buffered, so a resume has least to replay
                    await self._flush_request(req, float("inf") if closing else now)
            if closing:
                # the closing explanation (e.g. shutting_down) is the last frame before the close
                while self._control:
                    await socket.send_payload(self._pop())
                code, reason = self.closing
                self._over = True
                await socket.close(code, reason)
                return
            if self._heartbeat_due:
                self._heartbeat_due = False
                if time.monotonic() - socket.last_send >= self.s.heartbeat_s / 2:
                    await socket.send(Heartbeat(ts=time.time()))
            socket.flush()                  # the pass's frames leave together (gateway.ws.socket)

    def _next_look(self, now: float) -> float | None:
        """When the next pass is due: the soonest time a buffer asks to be looked at (its
        deadline, or the end of the interval an empty buffer's last flush started, so the first
        token after a flush needs no wake-up of its own); None when nothing asks."""
        soonest = None
        for req in self.requests.values():
            # only what a pass can send: a request's first event may arrive before its `accepted`
            # is queued (the worker is fast), and must not turn this loop into a busy one
            if not req.streaming:
                continue
            at = req.buffer.look_at(now)
            if at is not None and (soonest is None or at < soonest):
                soonest = at
        return soonest

    async def _flush_request(self, req: RequestState, now: float) -> None:
        if req.buffer.due_in_pass(now) or (req.final is not None and not req.buffer.empty):
            await self._send_chunk(req, req.buffer.take(now))
        if req.final is not None and req.buffer.empty and not req.finished:
            await self.socket.send(self.requests.finish(req))      # no Redis here: bookkeeping is queued

    async def _send_chunk(self, req: RequestState, pending) -> None:
        m = self.metrics
        now = time.monotonic()
        if req.first_sent is None:
            req.first_sent = now
            if not req.resumed:
                m.ttft.observe(now - req.started)
        elif req.last_sent is not None:
            m.inter_chunk.observe(now - req.last_sent)
        if not req.meaningful_sent and pending.text.strip():
            req.meaningful_at = now
            if not req.resumed:
                m.ttfmt.observe(now - req.started)
        req.last_sent = now
        req.seq = pending.seq
        m.flushes.inc()
        m.tokens.inc(pending.tokens)
        await self.socket.send(chunk_frame(req.client_id, pending))

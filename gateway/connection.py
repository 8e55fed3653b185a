"""One client WebSocket: a reader loop, a table of the requests multiplexed on it, one sender.

* Reader (the endpoint coroutine): decodes each frame, answers bad ones with a typed `error`
  for that id only, and handles generate/cancel/resume/ping/auth in arrival order.
* Output events arrive from the process-wide `OutputReader` through a synchronous callback that
  only appends to the request's `ChunkBuffer` and wakes the sender: it never awaits, so a slow
  socket cannot hold up the shared reader or other sockets.
* Sender (one task): sends queued control frames, then every buffer that is due (see
  flusher.py), then `done` once a finished request's buffer is empty; an idle socket gets a
  `heartbeat`. Chunks are never queued as frames: while the client is slow, tokens merge into
  the buffer, so memory is bounded by output text (max_tokens x requests), not by frame count.
  Control frames are bounded by `send_queue_max`; a client that lets them pile up, or that
  blocks one send for `slow_consumer_s`, is closed with SLOW_CONSUMER.

Terminal messages: every accepted request ends with exactly one `done`. A worker-side failure
becomes `done` with finish_reason "error" and `error: {code, message, retryable}`; an `error`
message with an id means the message was refused and nothing was started (or resumed) for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from typing import Any

import msgpack
from redis.exceptions import RedisError
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.flusher import ChunkBuffer
from gateway.hub import Hub
from gateway.output_reader import Subscription
from shared.errors import RETRYABLE, ErrorCode, ProtocolError
from shared.protocol import (
    Accepted, Auth, Cancel, Error, Generate, Heartbeat, Ping, Pong, Resume, decode_frame, error_message,
    parse_client_message,
)
from shared.streams import RequestEntry, SamplingParams

log = logging.getLogger("gateway.connection")

CLOSE_POLICY = 1008
CLOSE_SERVICE_RESTART = 1012
CLOSE_TRY_AGAIN_LATER = 1013
SHUTDOWN_REASON = "server restarting: reconnect and resume"


class RequestState:
    __slots__ = ("client_id", "rid", "key_id", "buffer", "sub", "seq", "skip_seq", "final", "accepted",
                 "started", "first_sent", "last_sent", "epoch", "cancel_requested", "cancel_timer",
                 "resumed", "slot_held", "finished")

    def __init__(self, client_id: str, rid: str, key_id: str, buffer: ChunkBuffer, *, skip_seq: int = 0,
                 resumed: bool = False):
        self.client_id = client_id
        self.rid = rid
        self.key_id = key_id
        self.buffer = buffer
        self.sub: Subscription | None = None
        self.seq = skip_seq          # last token seq delivered to the client
        self.skip_seq = skip_seq     # resume: token events up to here were already seen
        self.final: dict | None = None
        self.accepted = False
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.epoch = 1
        self.cancel_requested = False
        self.cancel_timer: asyncio.TimerHandle | None = None
        self.resumed = resumed
        self.slot_held = False
        self.finished = False


class Connection:
    def __init__(self, hub: Hub, ws: WebSocket, *, binary: bool, key_id: str | None):
        self.hub = hub
        self.s = hub.settings
        self.ws = ws
        self.binary = binary
        self.key_id = key_id                 # None until authenticated
        self.requests: dict[str, RequestState] = {}
        self._control: deque[Any] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._send_started: float | None = None
        self._last_send = time.monotonic()
        self._closing: tuple[int, str] | None = None
        self._shutting_down = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        hub = self.hub
        hub.connections.add(self)
        hub.metrics.active_sockets.inc()
        self._sender = asyncio.get_running_loop().create_task(self._send_loop())
        self._sender.add_done_callback(self._sender_ended)
        try:
            await self._read_loop()
        except WebSocketDisconnect:
            pass
        finally:
            self._closed = True
            if self._sender and not self._sender.done():
                self._sender.cancel()
                try:
                    await self._sender
                except (asyncio.CancelledError, Exception):
                    pass
            await self._release_all()
            hub.connections.discard(self)
            hub.metrics.active_sockets.dec()

    def _sender_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self._closed:
            exc = task.exception()
            if not isinstance(exc, (WebSocketDisconnect, OSError, RuntimeError)):
                log.error("sender failed: %r", exc)

    def shut_down(self) -> None:
        """Graceful drain: tell the client to go elsewhere and resume there."""
        self._shutting_down = True
        self._control.append(Error(code=ErrorCode.SHUTTING_DOWN, message=SHUTDOWN_REASON, retryable=True))
        self._close_after_flush(CLOSE_SERVICE_RESTART, SHUTDOWN_REASON)

    def _close_after_flush(self, code: int, reason: str) -> None:
        if self._closing is None:
            self._closing = (code, reason)
        self._wake.set()

    def check_slow(self, now: float) -> None:
        """Watchdog (housekeeping loop): a send stuck this long means the client is not reading."""
        started = self._send_started
        if started is not None and now - started > self.s.slow_consumer_s and self._sender:
            self._abort_slow("the client did not read for %.0fs" % (now - started))

    def _abort_slow(self, why: str) -> None:
        if self._closing is not None and self._closing[0] == CLOSE_TRY_AGAIN_LATER:
            return
        log.info("closing slow consumer: %s", why)
        self.hub.metrics.slow_consumers.inc()
        self._closing = (CLOSE_TRY_AGAIN_LATER, ErrorCode.SLOW_CONSUMER.value)
        if self._sender:
            self._sender.cancel()
        asyncio.get_running_loop().create_task(self._close_now(CLOSE_TRY_AGAIN_LATER, ErrorCode.SLOW_CONSUMER.value))

    async def _close_now(self, code: int, reason: str) -> None:
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), 2.0)
        except Exception:
            # a client that does not read cannot receive a close frame either: drop the TCP
            # connection so its buffered bytes are freed (ASGI has no abort, so reach the
            # server's transport when the server exposes it, as uvicorn does)
            transport = getattr(getattr(self.ws._send, "__self__", None), "transport", None)
            if transport is not None:
                transport.abort()

    def held_slots(self) -> list[tuple[str, str]]:
        return [(r.key_id, r.rid) for r in self.requests.values() if r.slot_held]

    async def _release_all(self) -> None:
        """Socket gone: unfinished requests wait for a resume (grace) or are cancelled now."""
        orphans: list[tuple[str, int]] = []
        for req in list(self.requests.values()):
            self._detach(req)
            if req.slot_held:
                req.slot_held = False
                try:
                    await self.hub.limits.release(req.key_id, req.rid)
                except (RedisError, OSError):
                    pass
            if not req.cancel_requested:
                orphans.append((req.rid, req.epoch))
        self.requests.clear()
        if not orphans:
            return
        try:
            if self.s.resume_grace_s > 0:
                await self.hub.submitter.park_orphans(orphans, self.s.resume_grace_s)
            else:
                for rid, _ in orphans:
                    await self.hub.submitter.cancel(rid)
        except (RedisError, OSError) as exc:
            log.warning("could not park/cancel %d request(s) of a closed socket: %s", len(orphans), exc)

    def _detach(self, req: RequestState) -> None:
        if req.sub is not None:
            self.hub.reader.unsubscribe(req.sub)
            req.sub = None
        if req.cancel_timer is not None:
            req.cancel_timer.cancel()
            req.cancel_timer = None
        if not req.finished:
            req.finished = True
            self.hub.metrics.active_requests.dec()

    # ------------------------------------------------------------------ reading

    async def _read_loop(self) -> None:
        max_bytes = self.s.max_frame_bytes
        while True:
            if self.key_id is None:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), self.s.auth_timeout_s)
                except asyncio.TimeoutError:
                    await self._refuse(ProtocolError(ErrorCode.UNAUTHORIZED, "no API key received in time"))
                    return
            else:
                message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            frame = message.get("text")
            if frame is None:
                frame = message.get("bytes") or b""
            msg = None
            try:
                msg = parse_client_message(decode_frame(frame, max_bytes=max_bytes))
                if self.key_id is None:
                    if not isinstance(msg, Auth):
                        raise ProtocolError(ErrorCode.UNAUTHORIZED, "authenticate first: send {\"type\": \"auth\", "
                                                                    "\"api_key\": ...}")
                    self.key_id = self.hub.key_checker.identify(msg.api_key)
                    continue
                await self._handle(msg)
            except ProtocolError as exc:
                if self.key_id is None:
                    await self._refuse(exc)
                    return
                self._reject(exc)
            except (RedisError, OSError) as exc:
                log.warning("backend error: %s", exc)
                rid = getattr(msg, "id", None)
                self._reject(ProtocolError(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable", rid))
            if self._closing is not None:
                return

    async def _refuse(self, exc: ProtocolError) -> None:
        """Unauthenticated: say why, then close (policy violation)."""
        self.hub.metrics.rejections.labels(exc.code.value).inc()
        self._control.append(error_message(exc))
        self._close_after_flush(CLOSE_POLICY, exc.code.value)
        if self._sender:
            try:
                await asyncio.wait_for(asyncio.shield(self._sender), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass

    def _reject(self, exc: ProtocolError) -> None:
        self.hub.metrics.rejections.labels(exc.code.value).inc()
        self._queue_control(error_message(exc))

    def _queue_control(self, msg: Any) -> None:
        if len(self._control) >= self.s.send_queue_max:
            self._abort_slow(f"{len(self._control)} control frames unread")
            return
        self._control.append(msg)
        self._wake.set()

    async def _handle(self, msg) -> None:
        if isinstance(msg, Generate):
            await self._generate(msg)
        elif isinstance(msg, Cancel):
            await self._cancel(msg)
        elif isinstance(msg, Resume):
            await self._resume(msg)
        elif isinstance(msg, Ping):
            self._queue_control(Pong(nonce=msg.nonce, ts=time.time()))
        elif isinstance(msg, Auth):
            # an `auth` before any request may (re)identify the socket, e.g. a browser sending
            # its key to a server where keys are optional
            if self.requests:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "authenticate before starting requests")
            self.key_id = self.hub.key_checker.identify(msg.api_key)

    def _check_new_id(self, client_id: str) -> None:
        if self.hub.draining:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON, client_id)
        if client_id in self.requests:
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"request {client_id!r} is still running on this socket",
                                client_id)
        if len(self.requests) >= self.s.max_requests_per_socket:
            raise ProtocolError(ErrorCode.TOO_MANY_REQUESTS_ON_SOCKET,
                                f"at most {self.s.max_requests_per_socket} concurrent requests per socket", client_id)

    async def _generate(self, msg: Generate) -> None:
        s, hub, cid = self.s, self.hub, msg.id
        self._check_new_id(cid)
        if msg.prompt_chars() > s.max_prompt_chars:
            raise ProtocolError(ErrorCode.PROMPT_TOO_LARGE,
                                f"prompt of {msg.prompt_chars()} characters exceeds {s.max_prompt_chars}", cid)
        max_tokens = msg.max_tokens if msg.max_tokens is not None else min(s.default_max_tokens, s.max_tokens_cap)
        if max_tokens > s.max_tokens_cap:
            raise ProtocolError(ErrorCode.MAX_TOKENS_TOO_LARGE,
                                f"max_tokens {max_tokens} exceeds the server cap of {s.max_tokens_cap}", cid)
        if len(msg.stop) > s.max_stop_strings:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"at most {s.max_stop_strings} stop strings", cid)
        try:
            await hub.limits.check_rate(self.key_id)
            await hub.admission.admit()
        except ProtocolError as exc:
            exc.request_id = cid
            raise
        rid = uuid.uuid4().hex
        try:
            await hub.limits.acquire(self.key_id, rid)
        except ProtocolError as exc:
            exc.request_id = cid
            raise
        req = self._new_request(cid, rid)
        req.slot_held = True
        entry = RequestEntry(
            rid=rid,
            params=SamplingParams(max_tokens=max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                                  top_k=msg.top_k, seed=msg.seed, stop=list(msg.stop)),
            prompt=msg.prompt,
            messages=[m.model_dump() for m in msg.messages] if msg.messages is not None else None,
            priority=msg.priority, created_ms=int(time.time() * 1000), key_id=self.key_id,
        )
        try:
            req.epoch = await hub.submitter.submit(entry, cid)
        except (RedisError, OSError):
            await self._drop(req)
            raise
        self._accept(req)

    def _new_request(self, cid: str, rid: str, *, skip_seq: int = 0, resumed: bool = False) -> RequestState:
        req = RequestState(cid, rid, self.key_id, ChunkBuffer(self.s.flush_interval_ms / 1000, self.s.flush_max_tokens),
                           skip_seq=skip_seq, resumed=resumed)
        self.requests[cid] = req
        self.hub.metrics.active_requests.inc()
        # subscribe before the request is queued, so no event can be missed
        req.sub = self.hub.reader.subscribe(self.hub.keys.out(rid), lambda eid, ev: self._on_event(req, ev))
        return req

    def _accept(self, req: RequestState) -> None:
        self._queue_control(Accepted(id=req.client_id, request_id=req.rid))
        req.accepted = True

    async def _drop(self, req: RequestState) -> None:
        self._detach(req)
        self.requests.pop(req.client_id, None)
        if req.slot_held:
            req.slot_held = False
            await self.hub.limits.release(req.key_id, req.rid)

    async def _cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.id)
        if req is None:
            raise ProtocolError(ErrorCode.UNKNOWN_ID, f"no running request {msg.id!r} on this socket", msg.id)
        if req.cancel_requested or req.final is not None:
            return
        req.cancel_requested = True
        await self.hub.submitter.cancel(req.rid)
        # if no worker confirms (e.g. all dead), finish it here rather than leave the client waiting
        req.cancel_timer = asyncio.get_running_loop().call_later(self.s.cancel_fallback_s, self._cancel_fallback, req)

    def _cancel_fallback(self, req: RequestState) -> None:
        req.cancel_timer = None
        if req.final is None and not req.finished:
            req.final = {"k": "done", "seq": req.seq, "finish_reason": "cancelled", "usage": {}}
            self._wake.set()

    async def _resume(self, msg: Resume) -> None:
        cid, hub = msg.id, self.hub
        self._check_new_id(cid)
        rid = await hub.submitter.lookup_alias(self.key_id, cid)
        if rid is None or (msg.request_id is not None and msg.request_id != rid):
            raise ProtocolError(ErrorCode.RESUME_EXPIRED, f"no retained output for request {cid!r}", cid)
        try:
            await hub.limits.acquire(self.key_id, rid)
        except ProtocolError as exc:
            exc.request_id = cid
            raise
        epoch = await hub.submitter.attach(rid)     # only now: a parked orphan is spared
        req = self._new_request(cid, rid, skip_seq=msg.last_seq, resumed=True)
        req.slot_held = True
        req.epoch = epoch
        self._accept(req)

    # ------------------------------------------------------------------ output events

    def _on_event(self, req: RequestState, ev: dict) -> None:
        if req.finished or req.final is not None:
            return
        kind = ev.get("k")
        seq = int(ev.get("seq") or 0)
        if kind == "tok":
            if seq <= req.skip_seq:
                return
            was_empty = req.buffer.empty
            now = time.monotonic()
            req.buffer.add(ev.get("text") or "", int(ev.get("n") or 1), seq, now)
            if was_empty or req.buffer.due(now):
                self._wake.set()
        elif kind in ("done", "err"):
            req.final = ev
            self._wake.set()

    # ------------------------------------------------------------------ sending

    async def _send_loop(self) -> None:
        hb = self.s.heartbeat_s
        while True:
            timeout = self._next_timeout(hb)
            if not self._wake.is_set() and timeout > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            now = time.monotonic()
            closing = self._closing is not None
            if not closing:
                while self._control:
                    await self._send_model(self._control.popleft())
            for req in list(self.requests.values()):
                if req.accepted and not req.finished:
                    # closing: hand over everything buffered, so a resume has least to replay
                    await self._flush_request(req, float("inf") if closing else now)
            if closing:
                # the closing explanation (e.g. shutting_down) is the last frame before the close
                while self._control:
                    await self._send_model(self._control.popleft())
                code, reason = self._closing
                await self._close_now(code, reason)
                return
            if hb > 0 and time.monotonic() - self._last_send >= hb:
                await self._send_model(Heartbeat(ts=time.time()))

    def _next_timeout(self, hb: float) -> float:
        now = time.monotonic()
        soonest = self._last_send + hb if hb > 0 else now + 3600
        for req in self.requests.values():
            d = req.buffer.deadline()
            if d is not None and d < soonest:
                soonest = d
        return max(0.0, soonest - now)

    async def _flush_request(self, req: RequestState, now: float) -> None:
        if req.buffer.due(now) or (req.final is not None and not req.buffer.empty):
            pending = req.buffer.take(now)
            await self._send_chunk(req, pending.text, pending.tokens, pending.seq)
        if req.final is not None and req.buffer.empty and not req.finished:
            await self._finish(req)

    async def _send_chunk(self, req: RequestState, text: str, tokens: int, seq: int) -> None:
        m = self.hub.metrics
        now = time.monotonic()
        if req.first_sent is None:
            req.first_sent = now
            if not req.resumed:
                m.ttft.observe(now - req.started)
        elif req.last_sent is not None:
            m.inter_chunk.observe(now - req.last_sent)
        req.last_sent = now
        req.seq = seq
        m.flushes.inc()
        m.tokens.inc(tokens)
        await self._send_raw({"v": 1, "type": "chunk", "id": req.client_id, "seq": seq, "text": text,
                              "tokens": tokens})

    async def _finish(self, req: RequestState) -> None:
        ev = req.final
        now = time.monotonic()
        usage_in = ev.get("usage") or {}
        usage = {
            "prompt_tokens": int(usage_in.get("prompt_tokens") or 0),
            "completion_tokens": int(usage_in.get("completion_tokens") or 0),
            "total_ms": round((now - req.started) * 1000, 3),
        }
        if req.first_sent is not None:
            usage["ttft_ms"] = round((req.first_sent - req.started) * 1000, 3)
        done: dict[str, Any] = {"v": 1, "type": "done", "id": req.client_id, "seq": max(req.seq, int(ev.get("seq") or 0))}
        if ev.get("k") == "err":
            code = _error_code(ev.get("code"))
            done["finish_reason"] = "error"
            done["error"] = {"code": code.value, "message": str(ev.get("message") or code.value),
                             "retryable": bool(ev.get("retryable", code in RETRYABLE))}
        else:
            reason = ev.get("finish_reason")
            done["finish_reason"] = reason if reason in ("stop", "length", "cancelled", "error") else "stop"
        done["usage"] = usage
        self.hub.metrics.requests.labels(done["finish_reason"]).inc()
        self._detach(req)
        self.requests.pop(req.client_id, None)
        if req.slot_held:   # freed before `done` goes out, so a client may start its next request at once
            req.slot_held = False
            try:
                await self.hub.limits.release(req.key_id, req.rid)
            except (RedisError, OSError):
                pass  # the lease expires by itself
        await self._send_raw(done)

    async def _send_model(self, msg) -> None:
        await self._send_raw(msg.model_dump(mode="json", exclude_none=True))

    async def _send_raw(self, data: dict) -> None:
        self._send_started = time.monotonic()
        try:
            if self.binary:
                await self.ws.send_bytes(msgpack.packb(data, use_bin_type=True))
            else:
                await self.ws.send_text(json.dumps(data, separators=(",", ":"), ensure_ascii=False))
        finally:
            self._send_started = None
        self._last_send = time.monotonic()
        self.hub.metrics.frames.inc()


def _error_code(value) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL

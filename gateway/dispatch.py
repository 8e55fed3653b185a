"""Reading a socket's frames and handling each message: auth, generate, cancel, resume, ping.

Frames are handled in arrival order. A bad frame is answered with a typed `error` for that id
only, so one bad message cannot take down the socket's other requests; before the socket is
authenticated, any refusal closes it (policy violation). An `error` with an id means the
message was refused and nothing was started (or resumed) for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from redis.exceptions import RedisError

from gateway.hub import Hub
from gateway.requests import RequestState, RequestTable
from gateway.resume import resume
from gateway.sender import Sender
from gateway.socket_io import CLOSE_POLICY, SHUTDOWN_REASON, FrameSocket
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import (
    Accepted, Auth, Cancel, Generate, Ping, Pong, Resume, decode_frame, error_message, parse_client_message,
)
from shared.streams import RequestEntry, SamplingParams

log = logging.getLogger("gateway.connection")


class MessageHandler:
    def __init__(self, hub: Hub, socket: FrameSocket, sender: Sender, requests: RequestTable, *,
                 key_id: str | None):
        self.hub = hub
        self.s = hub.settings
        self.socket = socket
        self.sender = sender
        self.requests = requests
        self.key_id = key_id                 # None until authenticated

    # ------------------------------------------------------------------ reading

    async def read_loop(self) -> None:
        max_bytes = self.s.max_frame_bytes
        while True:
            if self.key_id is None:
                try:
                    message = await asyncio.wait_for(self.socket.receive(), self.s.auth_timeout_s)
                except asyncio.TimeoutError:
                    await self._refuse(ProtocolError(ErrorCode.UNAUTHORIZED, "no API key received in time"))
                    return
            else:
                message = await self.socket.receive()
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
                self.reject(exc)
            except (RedisError, OSError) as exc:
                log.warning("backend error: %s", exc)
                rid = getattr(msg, "id", None)
                self.reject(ProtocolError(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable", rid))
            if self.sender.closing is not None:
                return

    async def _refuse(self, exc: ProtocolError) -> None:
        """Unauthenticated: say why, then close (policy violation)."""
        self.hub.metrics.rejections.labels(exc.code.value).inc()
        self.sender.push_final(error_message(exc))
        self.sender.close_after_flush(CLOSE_POLICY, exc.code.value)
        await self.sender.wait(5.0)

    def reject(self, exc: ProtocolError) -> None:
        self.hub.metrics.rejections.labels(exc.code.value).inc()
        self.sender.queue(error_message(exc))

    # ------------------------------------------------------------------ messages

    async def _handle(self, msg) -> None:
        if isinstance(msg, Generate):
            await self._generate(msg)
        elif isinstance(msg, Cancel):
            await self._cancel(msg)
        elif isinstance(msg, Resume):
            await resume(self, msg)
        elif isinstance(msg, Ping):
            self.sender.queue(Pong(nonce=msg.nonce, ts=time.time()))
        elif isinstance(msg, Auth):
            # an `auth` before any request may (re)identify the socket, e.g. a browser sending
            # its key to a server where keys are optional
            if len(self.requests):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "authenticate before starting requests")
            self.key_id = self.hub.key_checker.identify(msg.api_key)

    def check_new_id(self, client_id: str) -> None:
        if self.hub.draining:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON, client_id)
        if client_id in self.requests:
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"request {client_id!r} is still running on this socket",
                                client_id)
        if len(self.requests) >= self.s.max_requests_per_socket:
            raise ProtocolError(ErrorCode.TOO_MANY_REQUESTS_ON_SOCKET,
                                f"at most {self.s.max_requests_per_socket} concurrent requests per socket", client_id)

    def accept(self, req: RequestState) -> None:
        self.sender.queue(Accepted(id=req.client_id, request_id=req.rid))
        req.accepted = True

    async def _generate(self, msg: Generate) -> None:
        s, hub, cid = self.s, self.hub, msg.id
        self.check_new_id(cid)
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
        req = self.requests.open(cid, rid, self.key_id)
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
            await self.requests.drop(req)
            raise
        self.accept(req)

    async def _cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.id)
        if req is None:
            raise ProtocolError(ErrorCode.UNKNOWN_ID, f"no running request {msg.id!r} on this socket", msg.id)
        if req.cancel_requested or req.final is not None:
            return
        req.cancel_requested = True
        await self.hub.submitter.cancel(req.rid)
        self.requests.start_cancel_fallback(req)

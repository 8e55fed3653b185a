"""Reading a socket's frames and handling each message: auth, generate, cancel, resume, ping.

Frames are handled in arrival order. A bad frame is answered with a typed `error` for that id
only, so one bad message cannot take down the socket's other requests; before the socket is
authenticated, any refusal closes it (policy violation), and so does a later `auth` with a key
that is not valid. An `error` with an id means the message was refused and nothing was started
(or resumed) for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from gateway.auth import KeyChecker
from gateway.metrics import GatewayMetrics
from gateway.request_core import RequestCore
from gateway.request_state import Phase, RequestState
from gateway.requests import RequestTable
from gateway.resume import ResumeBudget
from gateway.sender import Sender
from gateway.settings import GatewaySettings
from gateway.ws.socket import FrameSocket
from gateway.ws.socket_caps import SocketClaim
from gateway.writer import CLOSE_POLICY
from shared.errors import ErrorCode, ProtocolError
from shared.structured import tool_mode
from shared.protocol import (
    Accepted, Auth, Cancel, Generate, Ping, Pong, Resume, decode_frame, error_message, parse_client_message,
)

log = logging.getLogger("gateway.connection")


class MessageHandler:
    def __init__(self, socket: FrameSocket, sender: Sender, requests: RequestTable, *, settings: GatewaySettings,
                 metrics: GatewayMetrics, key_checker: KeyChecker, core: RequestCore, key_id: str | None,
                 claim: SocketClaim):
        self.s = settings
        self.metrics = metrics
        self.key_checker = key_checker
        self.core = core
        self.socket = socket
        self.sender = sender
        self.requests = requests
        self.key_id = key_id                 # None until authenticated
        self.claim = claim                   # this socket in the per-key / per-address socket counts
        self.resume_budget = ResumeBudget(self.s.resume_rate_per_min)
        self.disconnect_code: int | None = None   # the close code the client's side ended with

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
                self.disconnect_code = message.get("code")
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
                    self._identify(msg.api_key)
                    continue
                await self._handle(msg)
            except ProtocolError as exc:
                if self.key_id is None or exc.code == ErrorCode.UNAUTHORIZED:
                    await self._refuse(exc)     # not (or no longer) authenticated: say why, close
                    return
                self.reject(exc)
            except (RedisError, OSError) as exc:
                log.warning("backend error: %s", exc)
                rid = getattr(msg, "id", None)
                self.reject(ProtocolError(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable", rid))
            except Exception:   # a bug handling one message must not take the socket's other requests down
                log.exception("handling %s failed", type(msg).__name__)
                self.reject(ProtocolError(ErrorCode.INTERNAL, "the gateway failed to handle this message",
                                          getattr(msg, "id", None)))
            if self.sender.closing is not None:
                return
            if not self.sender.drained.is_set():
                # replies are piling up: read no further until the sender catches up, so a client
                # that pipelines fast is slowed by TCP instead of cut off, and one that does not
                # read at all ends up with a blocked send (the slow-consumer watchdog's case)
                await self.sender.drained.wait()
                if self.sender.closing is not None:
                    return

    async def _refuse(self, exc: ProtocolError) -> None:
        """Unauthenticated: say why, then close (policy violation)."""
        self.metrics.rejections.labels(exc.code.value).inc()
        self.sender.push_final(error_message(exc))
        self.sender.close_after_flush(CLOSE_POLICY, exc.code.value)
        await self.sender.wait(5.0)

    def reject(self, exc: ProtocolError) -> None:
        self.metrics.rejections.labels(exc.code.value).inc()
        self.sender.queue(error_message(exc))

    # ------------------------------------------------------------------ messages

    async def _handle(self, msg) -> None:
        if isinstance(msg, Generate):
            await self._generate(msg)
        elif isinstance(msg, Cancel):
            await self._cancel(msg)
        elif isinstance(msg, Resume):
            await self._resume(msg)
        elif isinstance(msg, Ping):
            self.sender.queue(Pong(nonce=msg.nonce, ts=time.time()))
        elif isinstance(msg, Auth):
            # an `auth` before any request may (re)identify the socket, e.g. a browser sending
            # its key to a server where keys are optional
            if len(self.requests):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "authenticate before starting requests")
            self._identify(msg.api_key)

    def _identify(self, api_key: str) -> None:
        key_id = self.key_checker.identify(api_key)
        self.claim.identify(key_id)
        self.key_id = key_id

    def check_new_id(self, client_id: str) -> None:
        self.core.check_open(client_id)
        if client_id in self.requests:
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"request {client_id!r} is still running on this socket",
                                client_id)
        if len(self.requests) >= self.s.max_requests_per_socket:
            raise ProtocolError(ErrorCode.TOO_MANY_REQUESTS_ON_SOCKET,
                                f"at most {self.s.max_requests_per_socket} concurrent requests per socket", client_id)

    def accept(self, req: RequestState, tool_mode: str | None = None, after_seq: int = 0) -> None:
        """Tell the client; a request with tools also gets its calls as typed frames from here on."""
        if self.socket.tools is not None:
            self.socket.tools.track(req.client_id, req.rid, tool_mode, after_seq=after_seq)
        self.sender.queue(Accepted(id=req.client_id, request_id=req.rid))
        req.advance(Phase.STREAMING)

    async def _generate(self, msg: Generate) -> None:
        self.check_new_id(msg.id)
        mode = tool_mode(msg.tools, msg.tool_choice)
        # a re-sent idempotency key attaches this id to the request it started, from the first token
        await self.core.start_or_attach(self.requests, self.key_id, msg, accept=lambda req: self.accept(req, mode))

    async def _resume(self, msg: Resume) -> None:
        def check() -> None:
            self.resume_budget.take(msg.id)
            self.check_new_id(msg.id)

        await self.core.resume(self.requests, self.key_id, msg, check=check,
                               accept=lambda req: self.accept(req, req.tool_mode, msg.last_seq))

    async def _cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.id)
        if req is None:
            raise ProtocolError(ErrorCode.UNKNOWN_ID, f"no running request {msg.id!r} on this socket", msg.id)
        if req.cancel_requested or req.final is not None:
            return       # a second cancel, or one that crossed the request's end: nothing to do
        await self.core.cancel(self.requests, req, "client")

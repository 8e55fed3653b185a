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
from typing import Callable

from redis.exceptions import RedisError

from gateway.auth import KeyChecker
from gateway.metrics import GatewayMetrics
from gateway.new_request import AlreadyStarted, RequestStarter
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.resume import Resumer, ResumeBudget
from gateway.sender import Sender
from gateway.settings import GatewaySettings
from gateway.socket_caps import SocketClaim
from gateway.socket_io import CLOSE_POLICY, SHUTDOWN_REASON, FrameSocket
from gateway.submit import Submitter
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import (
    Accepted, Auth, Cancel, Generate, Ping, Pong, Resume, decode_frame, error_message, parse_client_message,
)

log = logging.getLogger("gateway.connection")


class MessageHandler:
    def __init__(self, socket: FrameSocket, sender: Sender, requests: RequestTable, *, settings: GatewaySettings,
                 metrics: GatewayMetrics, key_checker: KeyChecker, starter: RequestStarter, resumer: Resumer,
                 submitter: Submitter, draining: Callable[[], bool], key_id: str | None, claim: SocketClaim):
        self.s = settings
        self.metrics = metrics
        self.key_checker = key_checker
        self.starter = starter
        self.resumer = resumer
        self.submitter = submitter
        self.draining = draining
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
        if self.draining():
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
        self.check_new_id(msg.id)
        try:
            req = await self.starter.start(self.requests, self.key_id, msg)
        except AlreadyStarted as first:
            # its idempotency key already started a request: attach to it, from the first token
            running = next((r.client_id for r in self.requests.values() if r.rid == first.rid), None)
            if running is not None:
                raise ProtocolError(ErrorCode.DUPLICATE_ID, f"idempotency_key already names request {running!r} "
                                                            "on this socket", msg.id) from None
            await self.resumer.reattach(self.requests, self.key_id,
                                        Resume(id=msg.id, last_seq=0, request_id=first.rid), self.accept)
            return
        self.accept(req)

    async def _resume(self, msg: Resume) -> None:
        outcome = "attached"
        try:
            self.resume_budget.take(msg.id)
            self.check_new_id(msg.id)
            await self.resumer.reattach(self.requests, self.key_id, msg, self.accept)
        except ProtocolError as exc:
            outcome = exc.code.value
            raise
        except (RedisError, OSError):
            outcome = ErrorCode.BACKEND_UNAVAILABLE.value
            raise
        finally:
            self.metrics.resumes.labels(outcome).inc()

    async def _cancel(self, msg: Cancel) -> None:
        req = self.requests.get(msg.id)
        if req is None:
            raise ProtocolError(ErrorCode.UNKNOWN_ID, f"no running request {msg.id!r} on this socket", msg.id)
        if req.cancel_requested or req.final is not None:
            return
        req.cancelling("client")
        self.metrics.cancels.labels("client").inc()
        owner = await self.submitter.cancel(req.rid)
        if owner is None:
            # still in the queue: no worker holds it, and the flag (set first) keeps any from
            # starting it, so it ends now instead of when a batch slot frees up
            self.requests.end_cancelled(req)
        else:
            self.requests.start_cancel_fallback(req)

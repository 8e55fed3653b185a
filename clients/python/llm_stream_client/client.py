"""An asyncio client for the llm-stream WebSocket protocol (docs/protocol.md) that resumes by itself.

One `StreamClient` owns one socket and multiplexes any number of concurrent requests on it.
The caller iterates a request's chunks; when the socket drops (network loss, a gateway killed
or restarting, a slow-consumer close) the client reconnects with exponential backoff and full
jitter (at once after a 1012 "server restarting"), sends `resume` with the last `seq` it
delivered and the server's `request_id` from `accepted` for every unfinished request, and drops
any chunk it has already delivered — so the iterator simply continues, with exactly the text an
uninterrupted stream would have given. A request whose `accepted` never arrived is sent again,
with the same `idempotency_key` (a random 128-bit one per request unless the caller gives one),
so a request whose `accepted` was lost with its gateway is attached to, not run twice.

Only the public protocol is used; the client needs nothing but `websockets` (and `msgpack`
when `binary=True`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from llm_stream_client.errors import (ConnectionLost, GenerationFailed, LLMStreamError, RequestRefused,
                                      ResumeExpired, Unauthorized)

log = logging.getLogger("llm_stream_client")

JSON_SUBPROTOCOL = "llm-stream.json"
MSGPACK_SUBPROTOCOL = "llm-stream.msgpack"
CLOSE_POLICY = 1008          # unauthorized / origin not allowed: do not retry
CLOSE_SERVICE_RESTART = 1012  # the server asked us to reconnect now
FATAL_CODES = frozenset({"unauthorized", "origin_not_allowed"})


@dataclass(frozen=True)
class Chunk:
    """New text of one request; `seq` counts the token events delivered so far, this chunk's included."""
    text: str
    seq: int
    tokens: int


@dataclass(frozen=True)
class Result:
    """How a request ended: `finish_reason` is stop, length or cancelled; `usage` as the server sent it."""
    finish_reason: str
    usage: dict
    seq: int


@dataclass
class _Request:
    id: str
    body: dict                           # the `generate` message
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: str | None = None        # from `accepted`; needed to resume
    last_seq: int = 0                    # seq of the last chunk handed to the caller
    sent_on: int | None = None           # connection number the generate/resume went out on
    cancel_requested: bool = False
    cancel_sent_on: int | None = None
    resume_failures: int = 0
    finished: bool = False


class Generation:
    """One request: `async for chunk in generation` yields `Chunk`s; it ends after `done`.

    Iteration raises `GenerationFailed`, `RequestRefused`, `ResumeExpired`, `Unauthorized` or
    `ConnectionLost` (all `LLMStreamError`) instead of ending normally when the request fails.
    """

    def __init__(self, client: "StreamClient", req: _Request):
        self._client = client
        self._req = req
        self.text = ""                       # everything yielded so far
        self.result: Result | None = None    # set when the request has ended normally

    @property
    def id(self) -> str:
        return self._req.id

    @property
    def request_id(self) -> str | None:
        return self._req.request_id

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Chunk:
        if self.result is not None:
            raise StopAsyncIteration
        item = await self._req.queue.get()
        if isinstance(item, Chunk):
            self.text += item.text
            return item
        if isinstance(item, Result):
            self.result = item
            raise StopAsyncIteration
        raise item

    async def collect(self) -> str:
        """Iterate to the end and return the whole text."""
        async for _ in self:
            pass
        return self.text

    async def cancel(self) -> None:
        """Stop the request; iteration then ends with `result.finish_reason == "cancelled"`."""
        await self._client.cancel(self.id)


class StreamClient:
    """A resuming client. Use as `async with StreamClient(url) as client: ...`.

    `url` may be one URL (normally a load balancer in front of the gateways) or several: after
    a failed connection attempt the next one is tried. `api_key` goes in an `Authorization:
    Bearer` header. `max_reconnect_attempts` failed attempts in a row fail every open request
    with `ConnectionLost`; `idle_timeout_s` without any frame (the server sends a heartbeat
    every 12 s) counts as a dead connection.
    """

    def __init__(self, url: str | Sequence[str], *, api_key: str | None = None, binary: bool = False,
                 backoff_base_s: float = 0.25, backoff_max_s: float = 30.0, max_reconnect_attempts: int = 10,
                 idle_timeout_s: float = 40.0, open_timeout_s: float = 10.0, origin: str | None = None):
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise ValueError("need at least one URL")
        self.api_key = api_key
        self.binary = binary
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_reconnect_attempts = max_reconnect_attempts
        self.idle_timeout_s = idle_timeout_s
        self.open_timeout_s = open_timeout_s
        self.origin = origin
        self.reconnects = 0                   # sockets opened after the first one
        self._requests: dict[str, _Request] = {}
        self._ws: ClientConnection | None = None
        self._conn = 0                        # number of the current connection
        self._url_index = 0
        self._attempt = 0                     # failed attempts since the last sign of life
        self._run_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connected = asyncio.Event()
        self._wanted = asyncio.Event()        # set when there is work for a connection to do
        self._gave_up = asyncio.Event()       # set when max_reconnect_attempts ran out
        self._fatal: LLMStreamError | None = None
        self._closed = False
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:8]

    # ------------------------------------------------------------------ public API

    async def __aenter__(self) -> "StreamClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def connect(self) -> None:
        """Open the socket (retrying with backoff); raises `Unauthorized` or `ConnectionLost`."""
        self._start()
        self._gave_up.clear()
        self._wanted.set()
        waiters = [asyncio.ensure_future(self._connected.wait()), asyncio.ensure_future(self._gave_up.wait())]
        try:
            await asyncio.wait([*waiters, self._run_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not self._connected.is_set():
            raise self._fatal or ConnectionLost("connection_lost", "could not connect")

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None, id: str | None = None,
                 **params: Any) -> Generation:
        """Start a request. `params` are the protocol's generate fields: max_tokens, temperature,
        top_p, top_k, seed, stop, priority, idempotency_key (a random one by default). Returns at
        once; the request is sent in the background."""
        if self._closed:
            raise ConnectionLost("closed", "the client is closed")
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        cid = id or f"c{self._id_prefix}-{next(self._ids)}"
        if cid in self._requests:
            raise ValueError(f"request {cid!r} is still running on this client")
        body: dict[str, Any] = {"type": "generate", "id": cid}
        body.update({"prompt": prompt} if prompt is not None else {"messages": messages})
        body.update({k: v for k, v in params.items() if v is not None})
        body.setdefault("idempotency_key", uuid.uuid4().hex)   # 128 random bits: sent again, unchanged
        req = _Request(cid, body)
        self._requests[cid] = req
        gen = Generation(self, req)
        if self._fatal is not None:
            self._finish(req, self._fatal)
            return gen
        self._start()
        self._wanted.set()
        self._spawn(self._sync(req))
        return gen

    async def cancel(self, id: str) -> None:
        """Cancel a running request (no-op if it has already ended)."""
        req = self._requests.get(id)
        if req is None or req.finished:
            return
        req.cancel_requested = True
        if req.request_id is None and req.sent_on is None:
            self._finish(req, Result("cancelled", {}, req.last_seq))   # never left this process
            return
        await self._sync(req)

    async def close(self) -> None:
        """Close the socket; unfinished requests end with `ConnectionLost` (the server cancels them)."""
        self._closed = True
        if self._run_task is not None:
            self._run_task.cancel()
            await asyncio.gather(self._run_task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        self._fail_all(ConnectionLost("closed", "the client was closed"))

    # ------------------------------------------------------------------ connection loop

    def _start(self) -> None:
        if self._run_task is None or self._run_task.done():
            self._run_task = asyncio.get_running_loop().create_task(self._run())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _backoff(self) -> float:
        """Full jitter: random(0, min(max, base * 2^attempt))."""
        return random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** self._attempt))

    async def _run(self) -> None:
        first = True
        while not self._closed:
            await self._wanted.wait()
            url = self.urls[self._url_index % len(self.urls)]
            try:
                subprotocol = MSGPACK_SUBPROTOCOL if self.binary else JSON_SUBPROTOCOL
                ws = await websockets.connect(url, subprotocols=[subprotocol],
                                              additional_headers=self._headers(), origin=self.origin,
                                              open_timeout=self.open_timeout_s, max_size=None)
            except InvalidStatus as exc:
                if exc.response.status_code in (401, 403):
                    self._give_up(Unauthorized("unauthorized", f"handshake refused with {exc.response.status_code}"))
                    return
                await self._failed_attempt(exc)
                continue
            except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
                await self._failed_attempt(exc)
                continue
            if not first:
                self.reconnects += 1
            first = False
            self._ws, self._conn = ws, self._conn + 1
            self._gave_up.clear()
            try:   # the pong proves the socket is usable (auth passed); `connect()` waits for it
                await ws.send(self._encode({"type": "ping", "nonce": self._conn}))
            except ConnectionClosed:
                pass
            for req in list(self._requests.values()):
                await self._sync(req)
            restart, progressed = await self._read(ws)
            self._ws = None
            self._connected.clear()
            if self._fatal is not None:
                self._give_up(self._fatal)
                return
            if restart and progressed:
                self._attempt = 0             # the server asked: reconnect now (the balancer picks a replica)
                continue
            await self._failed_attempt(None)

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _failed_attempt(self, exc: BaseException | None) -> None:
        self._url_index += 1
        self._attempt += 1
        if self._attempt > self.max_reconnect_attempts:
            log.warning("giving up after %d attempts: %r", self._attempt - 1, exc)
            self._fail_all(ConnectionLost("connection_lost", f"gave up reconnecting: {exc!r}", retryable=True))
            self._attempt = 0
            self._wanted.clear()              # wait for the next generate() before trying again
            self._gave_up.set()
            return
        delay = self._backoff()
        log.info("reconnecting in %.2fs (attempt %d): %r", delay, self._attempt, exc)
        await asyncio.sleep(delay)

    def _give_up(self, exc: LLMStreamError) -> None:
        self._fatal = exc
        self._fail_all(exc)

    async def _read(self, ws: ClientConnection) -> tuple[bool, bool]:
        """Handle frames until the socket ends; returns (server asked to restart, any sign of life)."""
        restart = progressed = False
        try:
            while True:
                raw = await asyncio.wait_for(ws.recv(), self.idle_timeout_s)
                msg = self._decode(raw)
                if msg is None:
                    continue
                kind = msg.get("type")
                if kind != "error" and not progressed:
                    progressed = True
                    self._attempt = 0
                    self._connected.set()
                if kind == "error" and msg.get("id") is None:
                    code = msg.get("code")
                    if code in FATAL_CODES:
                        self._fatal = Unauthorized(code, msg.get("message", ""))
                    elif code == "shutting_down":
                        restart = True
                    else:
                        log.warning("socket error from server: %s", msg)
                    continue
                self._dispatch(msg)
        except asyncio.TimeoutError:
            log.info("no frame for %.0fs: treating the connection as dead", self.idle_timeout_s)
            self._spawn(ws.close())
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            if code == CLOSE_POLICY and self._fatal is None:
                self._fatal = Unauthorized("unauthorized", exc.rcvd.reason or "policy violation")
            restart = restart or code == CLOSE_SERVICE_RESTART
        return restart, progressed

    def _decode(self, raw: str | bytes) -> dict | None:
        try:
            if isinstance(raw, bytes):
                import msgpack
                msg = msgpack.unpackb(raw, raw=False)
            else:
                msg = json.loads(raw)
        except Exception:
            log.warning("undecodable frame from server")
            return None
        return msg if isinstance(msg, dict) else None

    def _encode(self, msg: dict) -> str | bytes:
        if self.binary:
            import msgpack
            return msgpack.packb(msg, use_bin_type=True)
        return json.dumps(msg)

    # ------------------------------------------------------------------ per request

    async def _sync(self, req: _Request) -> None:
        """Send whatever this connection still lacks for `req`: its generate (or, once it was
        accepted, a resume from the last seq) and a requested cancel. Idempotent per connection."""
        ws, conn = self._ws, self._conn
        if ws is None or req.finished:
            return
        out = []
        if req.sent_on != conn:
            req.sent_on = conn
            if req.request_id is None:
                out.append(req.body)
            else:
                out.append({"type": "resume", "id": req.id, "last_seq": req.last_seq, "request_id": req.request_id})
        if req.cancel_requested and req.cancel_sent_on != conn:
            req.cancel_sent_on = conn
            out.append({"type": "cancel", "id": req.id})
        try:
            for msg in out:
                await ws.send(self._encode(msg))
        except ConnectionClosed:
            pass   # the read loop sees the close; the next connection syncs again

    def _dispatch(self, msg: dict) -> None:
        req = self._requests.get(msg.get("id"))
        if req is None or req.finished:
            return
        kind = msg.get("type")
        if kind == "accepted":
            req.request_id = msg.get("request_id") or req.request_id
            req.resume_failures = 0
        elif kind == "chunk":
            seq = int(msg.get("seq", 0))
            if seq <= req.last_seq:
                return                        # already delivered before a reconnect
            req.last_seq = seq
            req.queue.put_nowait(Chunk(msg.get("text", ""), seq, int(msg.get("tokens", 0))))
        elif kind == "done":
            if msg.get("finish_reason") == "error":
                err = msg.get("error") or {}
                self._finish(req, GenerationFailed(err.get("code", "internal"), err.get("message", ""),
                                                   retryable=bool(err.get("retryable")), id=req.id))
            else:
                self._finish(req, Result(msg.get("finish_reason", "stop"), msg.get("usage") or {},
                                         int(msg.get("seq", req.last_seq))))
        elif kind == "error":
            self._refused(req, msg)

    def _refused(self, req: _Request, msg: dict) -> None:
        code, text, retryable = msg.get("code", "internal"), msg.get("message", ""), bool(msg.get("retryable"))
        if code == "unknown_id" and req.cancel_requested:
            return                            # the cancel crossed the request's end; `done` follows or came
        if code == "shutting_down":
            req.sent_on = None                # this replica is draining: the next connection sends it again
            return
        if code == "resume_expired":
            self._finish(req, ResumeExpired(code, text, id=req.id))
            return
        if retryable and req.request_id is not None and req.resume_failures < self.max_reconnect_attempts:
            req.resume_failures += 1          # e.g. a limit still counting the old socket: try the resume again
            req.sent_on = None
            delay = random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** req.resume_failures))
            self._spawn(self._sync_later(req, delay))
            return
        self._finish(req, RequestRefused(code, text, retryable=retryable, id=req.id))

    async def _sync_later(self, req: _Request, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._sync(req)

    def _finish(self, req: _Request, outcome: Result | LLMStreamError) -> None:
        req.finished = True
        self._requests.pop(req.id, None)
        req.queue.put_nowait(outcome)

    def _fail_all(self, exc: LLMStreamError) -> None:
        for req in list(self._requests.values()):
            self._finish(req, type(exc)(exc.code, exc.message, retryable=exc.retryable, id=req.id))

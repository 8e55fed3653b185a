"""OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, and a
resumable server-sent-event stream `/v1/streams/{id}` (docs/clients.md).

This module only translates. A request goes through the very lifecycle of a WebSocket one:
the `RequestStarter` (caps, per-key rate and concurrency, admission, submit), a `RequestTable`
(output events through the history/live join, chunk buffer, concurrency slot, the one `done`),
the `Sender` loop (flush policy, heartbeats, slow-consumer watchdog, drain) and the `Resumer`
for a resume; the response is a session like a socket (gateway.sessions). What differs is the
"socket": `OpenAIResponse` plays `FrameSocket`'s part and writes each frame the Sender emits as
an OpenAI chunk event (`stream: true`) or gathers them into one JSON body (`stream: false`).

* Every SSE event carries `id: <seq>`; reconnecting to `GET /v1/streams/{id}` (any replica,
  same API key) with `Last-Event-ID: <seq>` continues exactly after it, as a WebSocket `resume`.
  The response `id` is `chatcmpl-<request_id>` / `cmpl-<request_id>`: the server request id a
  resume must present is in it.
* A client that disconnects cancels its request at once — unless it asked for `"resumable":
  true`, in which case the request waits `RESUME_GRACE_S` for a reconnect, as a dropped socket.
* Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; `code` is the
  gateway's error code (docs/protocol.md). Unsupported parameters are refused, never ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.auth import bearer_token
from gateway.hub import Hub
from gateway.new_request import AlreadyStarted
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.sender import Sender, WakeEvent
from gateway.sessions import Sessions, StreamingSession
from gateway.socket_io import SHUTDOWN_REASON
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Accepted, Chunk, Done, Error, Heartbeat, Resume, parse_client_message

log = logging.getLogger("gateway.openai")

CHAT_PREFIX, TEXT_PREFIX = "chatcmpl-", "cmpl-"

# HTTP status and OpenAI error `type` for each gateway error code
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.ORIGIN_NOT_ALLOWED: (403, "permission_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.CONCURRENCY_LIMIT: (429, "rate_limit_error"),
    ErrorCode.OVERLOADED: (503, "overloaded_error"),
    ErrorCode.BACKEND_UNAVAILABLE: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.WORKER_LOST: (503, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.RESUME_EXPIRED: (404, "not_found_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    @classmethod
    def from_code(cls, code: ErrorCode | str, message: str) -> "APIError":
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INTERNAL
        status, kind = _STATUS.get(code, (400, "invalid_request_error"))
        return cls(status, message, type=kind, code=code.value)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ---------------------------------------------------------------- request bodies

class _Body(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (extra="forbid")."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = None
    user: str | None = None                 # accepted: an end-user tag; this server keeps no per-user state
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    # extensions (documented in docs/clients.md)
    priority: Literal["interactive", "batch"] | None = None
    resumable: bool = False


class ChatBody(_Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", code="unsupported_parameter", param=name)


def _check_common(body: _Body) -> None:
    if body.n not in (None, 1):
        raise _unsupported("n", "> 1 is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise _unsupported(name)
    if body.logit_bias:
        raise _unsupported("logit_bias")
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        extra = set(body.stream_options) - {"include_usage"}
        if extra:
            raise _unsupported(f"stream_options.{sorted(extra)[0]}")


def _chat_messages(raw: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _unsupported(f"messages[{i}].{sorted(extra)[0]}")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role {m.get('role')!r} is not supported (system, developer, user, "
                                "assistant)", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):   # content parts: only text
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"messages[{i}].content", "parts other than text are not supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": role, "content": content})
    return out


def parse_body(raw: bytes, chat: bool) -> tuple[_Body, dict]:
    """JSON body -> (validated OpenAI body, the protocol's `generate` fields)."""
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise _unsupported(param, "is not a recognized or supported parameter") from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None
    _check_common(body)
    fields: dict[str, Any] = {}
    if isinstance(body, ChatBody):
        for name in ("tools", "functions", "function_call", "response_format", "top_logprobs"):
            if getattr(body, name) not in (None, {"type": "text"}):
                raise _unsupported(name)
        if body.tool_choice not in (None, "none"):
            raise _unsupported("tool_choice")
        if body.logprobs:
            raise _unsupported("logprobs")
        fields["messages"] = _chat_messages(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        if body.logprobs is not None:
            raise _unsupported("logprobs")
        if body.echo:
            raise _unsupported("echo")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of")
        if body.suffix:
            raise _unsupported("suffix")
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _unsupported("prompt", "must be one string (batched prompts are not supported)")
            prompt = prompt[0]
        fields["prompt"] = prompt
        max_tokens = body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("seed", body.seed), ("stop", stop), ("priority", body.priority)):
        if value is not None:
            fields[name] = value
    return body, fields


# ---------------------------------------------------------------- the response ("socket")

class OpenAIResponse:
    """Plays `FrameSocket` for the `Sender`: frames in, OpenAI chunk events (or one JSON body) out."""

    def __init__(self, send: Send, *, oai_id: str, model: str, stream: bool, include_usage: bool,
                 role_chunk: bool):
        self._send = send
        self.oai_id = oai_id
        self.chat = oai_id.startswith(CHAT_PREFIX)
        self.model = model
        self.created = int(time.time())
        self.stream = stream
        self.include_usage = include_usage
        self.role_chunk = role_chunk and self.chat
        self.send_started: float | None = None
        self.last_send = time.monotonic()
        self.ended = asyncio.Event()
        self.broken = False                  # a write failed: the client is gone
        self.parts: list[str] = []           # stream: false
        self.done: Done | None = None
        self.error: Error | None = None

    # the Sender's interface ------------------------------------------------

    def encode(self, msg: BaseModel) -> str:
        """A control frame as the text it becomes here (the Sender queues it and counts its bytes)."""
        if isinstance(msg, Accepted):
            return self._event_text(self._chunk(None, None, role=True), 0) if self.stream and self.role_chunk else ""
        if isinstance(msg, Error):           # e.g. the closing explanation of a drain
            self.error = msg
            return f"data: {json.dumps(APIError.from_code(msg.code, msg.message).body())}\n\n" if self.stream else ""
        return ""                            # pong and the like have no HTTP counterpart

    async def send_payload(self, payload: str) -> None:
        self.last_send = time.monotonic()
        if payload:
            await self._write(payload)

    async def send(self, msg: BaseModel) -> None:
        # counts as a send even when nothing is written (a heartbeat of a non-streamed answer),
        # so the Sender's heartbeat clock advances instead of firing again at once
        self.last_send = time.monotonic()
        if isinstance(msg, Chunk):
            if self.stream:
                await self._event(self._chunk(msg.text, None), msg.seq)
            else:
                self.parts.append(msg.text)
        elif isinstance(msg, Done):
            self.done = msg
            if self.stream:
                await self._finish_stream(msg)
            self.ended.set()
        elif isinstance(msg, Heartbeat):
            if self.stream:
                await self._write(": keep-alive\n\n")   # proxies see traffic; SSE clients ignore comments
        else:
            await self.send_payload(self.encode(msg))

    async def close(self, code: int, reason: str, *, last: BaseModel | None = None) -> None:
        if last is not None:
            await self.send(last)
        self.ended.set()

    def abort(self) -> None:
        self.broken = True
        self.ended.set()

    # building events -------------------------------------------------------

    def _chunk(self, text: str | None, finish: str | None, *, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    async def _finish_stream(self, done: Done) -> None:
        if done.finish_reason == "error":
            err = done.error or {}
            body = APIError.from_code(err.get("code", "internal"), err.get("message", "")).body()
            await self._event(body, done.seq)
        else:
            await self._event(self._chunk(None, done.finish_reason), done.seq)
            if self.include_usage:
                usage = usage_of(done)
                await self._event({**self._chunk(None, None), "choices": [], "usage": usage}, done.seq)
        await self._write("data: [DONE]\n\n")

    def body(self) -> tuple[int, dict]:
        """stream: false — the status and JSON of the whole answer."""
        if self.done is None or self.done.finish_reason == "error":
            if self.done is not None:
                err = self.done.error or {}
                api = APIError.from_code(err.get("code", "internal"), err.get("message", ""))
            else:
                msg = self.error
                api = APIError.from_code(msg.code if msg else ErrorCode.SHUTTING_DOWN,
                                         msg.message if msg else SHUTDOWN_REASON)
            return api.status, api.body()
        text = "".join(self.parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.done.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.done.finish_reason}
            obj = "text_completion"
        return 200, {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model,
                     "choices": [choice], "usage": usage_of(self.done)}

    # writing ----------------------------------------------------------------

    @staticmethod
    def _event_text(data: dict, seq: int) -> str:
        return f"id: {seq}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def _event(self, data: dict, seq: int) -> None:
        await self._write(self._event_text(data, seq))

    async def _write(self, text: str) -> None:
        if self.broken:
            return
        self.send_started = time.monotonic()
        try:
            await self._send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except (OSError, RuntimeError) as exc:   # the client went away mid-write
            log.debug("SSE write failed: %r", exc)
            self.broken = True
            self.ended.set()
        finally:
            self.send_started = None
        self.last_send = time.monotonic()


def usage_of(done: Done) -> dict:
    p, c = done.usage.prompt_tokens, done.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class HttpSession(StreamingSession):
    """One HTTP response as a session: drained, watched and heartbeaten like a socket."""

    def __init__(self, out: OpenAIResponse, requests: RequestTable, sender: Sender, sessions: Sessions):
        super().__init__(out, requests, sender, sessions)
        self.drained = False

    def shut_down(self) -> None:
        self.drained = True
        super().shut_down()


class RunRequest(Response):
    """Drives one accepted request to its end over HTTP, with the WebSocket path's Sender."""

    def __init__(self, hub: Hub, requests: RequestTable, wake: WakeEvent, req: RequestState, *, model: str,
                 stream: bool, include_usage: bool, resumable: bool):
        self.hub, self.requests, self.wake, self.req = hub, requests, wake, req
        self.model, self.stream, self.include_usage, self.resumable = model, stream, include_usage, resumable
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub, req = self.hub, self.req
        out = OpenAIResponse(send, oai_id=req.client_id, model=self.model, stream=self.stream,
                             include_usage=self.include_usage, role_chunk=req.seq == 0)
        sender = Sender(out, self.requests, self.wake, hub.settings, hub.metrics)
        conn = HttpSession(out, self.requests, sender, hub.sessions)
        # keep-alive comments on a quiet stream, from the process-wide wheel
        hub.sessions.open(conn, heartbeats=self.stream)
        disconnect = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        ended = asyncio.get_running_loop().create_task(out.ended.wait())
        gone = False
        try:
            if self.stream:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"), (b"x-request-id", req.rid.encode())]})
            sender.queue(Accepted(id=req.client_id, request_id=req.rid))
            req.accepted = True      # (a resumed request's history is buffered already, flushed from here)
            self.wake.set()          # starts the sender task
            await asyncio.wait([disconnect, ended], return_when=asyncio.FIRST_COMPLETED)
            gone = disconnect.done() or out.broken
            if gone and out.done is None and not conn.drained and not self.resumable:
                await self._cancel()             # nobody is listening and nobody will come back
        finally:
            disconnect.cancel()
            ended.cancel()
            await conn.end()      # a resumable or drained request is parked for a resume
        if gone:
            return
        if self.stream:
            await _end_body(send)
        else:
            status, body = out.body()
            await JSONResponse(body, status_code=status)(scope, receive, send)

    async def _cancel(self) -> None:
        req = self.req
        req.cancel_requested = True
        try:
            await self.hub.submitter.cancel(req.rid)    # flag + owner's control stream: a queued one never starts
        except (RedisError, OSError) as exc:
            log.warning("could not cancel %s after a client disconnect: %s", req.rid, exc)


async def _wait_disconnect(receive: Receive) -> bool:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True


async def _end_body(send: Send) -> None:
    try:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (OSError, RuntimeError):
        pass


# ---------------------------------------------------------------- endpoints

def _key_id(hub: Hub, request: Request) -> str:
    try:
        return hub.key_checker.identify(bearer_token(request.headers.get("authorization")))
    except ProtocolError as exc:
        raise APIError.from_code(exc.code, exc.message) from None


def _served(hub: Hub, model: str) -> str:
    name = hub.settings.served_model_name
    if model != name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{name}'", code="model_not_found",
                       param="model")
    return name


async def _generate(request: Request, chat: bool) -> Response:
    hub: Hub = request.app.state.hub
    try:
        key_id = _key_id(hub, request)
        if hub.draining:
            raise APIError.from_code(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON)
        body, fields = parse_body(await request.body(), chat)
        model = _served(hub, body.model)
        # the response id names the server request id, which a resume must present
        rid = secrets.token_hex(16)
        prefix = CHAT_PREFIX if chat else TEXT_PREFIX
        idempotency_key = request.headers.get("idempotency-key")
        if idempotency_key is not None:
            fields["idempotency_key"] = idempotency_key
        try:
            msg = parse_client_message({"type": "generate", "id": prefix + rid, **fields})
        except ProtocolError as exc:
            param = "Idempotency-Key" if "idempotency_key" in exc.message else None
            raise APIError(400, exc.message, code=exc.code.value, param=param) from None
        wake = WakeEvent()
        requests = hub.request_table(wake)
        try:
            try:
                req = await hub.starter.start(requests, key_id, msg, rid=rid)
            except AlreadyStarted as first:   # the same Idempotency-Key started it: the same answer
                req = await hub.resumer.reattach(requests, key_id, Resume(id=prefix + first.rid, last_seq=0,
                                                                          request_id=first.rid),
                                                 accept=lambda r: None)
        except ProtocolError as exc:
            hub.metrics.rejections.labels(exc.code.value).inc()
            raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
    except APIError as exc:
        return exc.response()
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return RunRequest(hub, requests, wake, req, model=model, stream=body.stream, include_usage=include_usage,
                      resumable=body.resumable)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def resume_stream(request: Request) -> Response:
    """`GET /v1/streams/{id}` with `Last-Event-ID: <seq>`: the rest of a stream, after that seq."""
    hub: Hub = request.app.state.hub
    oai_id = request.path_params["id"]
    try:
        key_id = _key_id(hub, request)
        if hub.draining:
            raise APIError.from_code(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON)
        if not oai_id.startswith((CHAT_PREFIX, TEXT_PREFIX)):
            raise APIError(404, f"no stream {oai_id!r}", code=ErrorCode.RESUME_EXPIRED.value)
        raw_seq = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not raw_seq.isdigit():
            raise APIError(400, f"Last-Event-ID {raw_seq!r} is not a seq (a non-negative integer)",
                           param="Last-Event-ID")
        try:
            msg = Resume(id=oai_id, last_seq=int(raw_seq), request_id=oai_id.split("-", 1)[1])
        except ValidationError:   # not even shaped like a request id: the same answer as an unknown one
            raise APIError.from_code(ErrorCode.RESUME_EXPIRED, f"no retained output for {oai_id!r}") from None
        wake = WakeEvent()
        requests = hub.request_table(wake)
        try:
            req = await hub.resumer.reattach(requests, key_id, msg, accept=lambda r: None)   # accepted by RunRequest
        except ProtocolError as exc:
            raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
    except APIError as exc:
        return exc.response()
    include_usage = request.query_params.get("include_usage", "").lower() in ("1", "true")
    return RunRequest(hub, requests, wake, req, model=hub.settings.served_model_name, stream=True,
                      include_usage=include_usage, resumable=True)


async def models(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    try:
        _key_id(hub, request)
    except APIError as exc:
        return exc.response()
    return JSONResponse({"object": "list", "data": [
        {"id": hub.settings.served_model_name, "object": "model", "created": 0, "owned_by": "llm-stream"}]})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/streams/{id}", resume_stream, methods=["GET"]),
]

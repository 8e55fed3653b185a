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
  gateway's error code (docs/protocol.md), also for unknown routes and wrong methods under /v1.
  A parameter is used, accepted and ignored (it cannot change the answer), or refused with 400
  unless it has its neutral value (it would change the answer): `IGNORED` and the `_*_NEUTRAL`
  tables below, listed in docs/clients.md's compatibility table, which a test walks.
* A stream's headers wait for its first event, so a refusal by the worker before any token
  (`context_too_long`) is an HTTP status, not an error event in a 200 (`OpenAIResponse`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.auth import bearer_token
from gateway.hub import Hub
from gateway.new_request import AlreadyStarted
from gateway.openai_logprobs import CHAT_TOP_MAX, COMPLETIONS_TOP_MAX, chat_logprobs, completion_logprobs
from gateway.request_state import RequestState
from gateway.requests import RequestTable
from gateway.sender import Sender, WakeEvent
from gateway.sessions import Sessions, StreamingSession
from gateway.socket_io import SHUTDOWN_REASON
from gateway import openai_structured as structured
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Accepted, Chunk, Done, Error, Heartbeat, Resume, parse_client_message
from shared.logs import rid_of

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
    # retryable failures on the server's side: a 5xx, which the SDKs retry (with a stream's held
    # headers they can arrive before the first token, as the response status)
    ErrorCode.STALLED: (503, "server_error"),
    ErrorCode.OUTPUT_LOST: (503, "server_error"),
    ErrorCode.OUTPUT_WRITE_FAILED: (503, "server_error"),
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
#
# What a field does here is one of three things, and docs/clients.md's compatibility table says
# which for each (tests/test_openai_compat_table.py walks that table against this code):
#   * used: it does what OpenAI documents;
#   * accepted and ignored: it cannot change the answer (`IGNORED` below) — vLLM's stance, so
#     that what SDKs and frameworks send by default works;
#   * refused unless neutral: a value that would change the answer and that this server cannot
#     honour (`n > 1`, penalties, ...) is a 400 `unsupported_parameter` naming
#     it; the value that changes nothing (`n: 1`, `tools: []`, penalties 0, ...) is accepted.
# A field this list does not know is refused too (extra="forbid"): nothing unknown is ignored.

# accepted and ignored: name -> why ignoring it changes no answer (quoted in docs/clients.md)
IGNORED: dict[str, str] = {
    "user": "an end-user tag; this server keeps no per-user state",
    "safety_identifier": "an end-user tag for OpenAI's abuse monitoring",
    "store": "this server stores no completions",
    "metadata": "tags for stored completions; nothing is stored",
    "service_tier": "this server has one tier (the `priority` extension picks a lane)",
    "prompt_cache_retention": "a cache-retention hint",
    "verbosity": "a style hint to OpenAI's GPT-5 models; the served model has no such control",
    "reasoning_effort": "the served model does not reason",
    "parallel_tool_calls": "the calls the model writes are all returned; a forced call is one call",
    "prediction": "predicted output only speeds OpenAI up; the answer is the same",
}


B = TypeVar("B", bound=BaseModel)


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    # accepted and ignored (IGNORED)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    # extensions (documented in docs/clients.md)
    priority: Literal["interactive", "batch"] | None = None
    resumable: bool = False
    ignore_eos: bool | None = None        # vLLM's: run to max_tokens (benchmarks such as guidellm send it)


class ChatBody(_Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    parallel_tool_calls: bool | None = None        # IGNORED
    prediction: dict | None = None                 # IGNORED


class CompletionBody(_Body):
    prompt: str | list[str]
    response_format: dict | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", code="unsupported_parameter", param=name)


# refused unless neutral: name -> the test of a value that changes nothing
_COMMON_NEUTRAL: dict[str, Any] = {
    "n": lambda v: v in (None, 1),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,                              # null or {}
}
_CHAT_NEUTRAL: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
_COMPLETION_NEUTRAL: dict[str, Any] = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,                                  # null or ""
}
# include_obfuscation is ignored (no obfuscation padding here); continuous_usage_stats is vLLM's:
# with include_usage, every chunk carries the usage so far
STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}


def _check_neutral(body: _Body, neutral: dict[str, Any]) -> None:
    for name, is_neutral in neutral.items():
        if not is_neutral(getattr(body, name)):
            why = "> 1 is not supported by this server" if name == "n" else "is not supported by this server"
            raise _unsupported(name, why)


def _check_common(body: _Body) -> None:
    _check_neutral(body, _COMMON_NEUTRAL)
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        extra = set(body.stream_options) - STREAM_OPTIONS
        if extra:
            raise _unsupported(f"stream_options.{sorted(extra)[0]}")


# What an assistant message carries besides its text when an answer is appended back to the
# conversation (`messages.append(resp.choices[0].message.model_dump())`): accepted when empty;
# refused when they hold something the model would have to see and cannot be shown here.
# `annotations` (citations of the content) are kept out of the prompt by OpenAI too: any list.
_MESSAGE_ECHO_EMPTY: dict[str, Any] = {
    "refusal": lambda v: v is None,
    "audio": lambda v: v is None,
    "function_call": lambda v: v is None,
    "annotations": lambda v: v is None or isinstance(v, list),
}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", *_MESSAGE_ECHO_EMPTY}


def _chat_messages(raw: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        extra = set(m) - _MESSAGE_KEYS
        if extra:
            raise _unsupported(f"messages[{i}].{sorted(extra)[0]}")
        for name, is_empty in _MESSAGE_ECHO_EMPTY.items():
            if not is_empty(m.get(name)):
                raise _unsupported(f"messages[{i}].{name}", "must be null or empty: this server takes text "
                                                            "and tool calls only (no audio or refusals)")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant", "tool"):
            raise _unsupported(f"messages[{i}].role", f"{m.get('role')!r} is not supported (system, developer, "
                                                      "user, assistant, tool)")
        content = m.get("content")
        calls = m.get("tool_calls") or None
        if content is None and role == "assistant" and calls:    # a message that only called tools
            content = ""
        if isinstance(content, list):   # content parts: only text
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"messages[{i}].content", "parts other than text are not supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": role, "content": content, **structured.tool_fields(m, role, calls, i, APIError)})
    return out


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object."""
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def validated(kind: type[B], data: dict) -> B:
    """`data` as a `kind` body; a 400 naming the first field that is wrong (an unknown one:
    `unsupported_parameter`)."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise _unsupported(param, "is not a recognized or supported parameter") from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None


def parse_body(raw: bytes, chat: bool) -> tuple[_Body, dict]:
    """JSON body -> (validated OpenAI body, the protocol's `generate` fields)."""
    body = validated(ChatBody if chat else CompletionBody, json_object(raw))
    _check_common(body)
    fields: dict[str, Any] = structured.structured_fields(body, APIError)
    if isinstance(body, ChatBody):
        _check_neutral(body, _CHAT_NEUTRAL)
        fields["messages"] = _chat_messages(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        _check_neutral(body, _COMPLETION_NEUTRAL)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _unsupported("prompt", "must be one string (batched prompts are not supported)")
            prompt = prompt[0]
        fields["prompt"] = prompt
        max_tokens = body.max_tokens
    fields.update(_logprob_fields(body))
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("seed", body.seed), ("stop", stop), ("priority", body.priority),
                        ("prompt_cache_key", body.prompt_cache_key),   # routes it to the worker holding its cache
                        ("ignore_eos", body.ignore_eos or None)):
        if value is not None:
            fields[name] = value
    return body, fields


_INVALID = ErrorCode.INVALID_REQUEST.value


def _logprob_fields(body: _Body) -> dict:
    """Chat `logprobs: true` + `top_logprobs` (0-20), completions `logprobs` (0-5 alternatives)
    -> the protocol's `logprobs` / `top_logprobs`."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code=_INVALID)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= CHAT_TOP_MAX:
            raise APIError(400, f"'top_logprobs' must be 0 to {CHAT_TOP_MAX}", param="top_logprobs", code=_INVALID)
        return {"logprobs": True, "top_logprobs": body.top_logprobs or 0} if body.logprobs else {}
    if body.logprobs is None:
        return {}
    if not 0 <= body.logprobs <= COMPLETIONS_TOP_MAX:
        raise APIError(400, f"'logprobs' must be 0 to {COMPLETIONS_TOP_MAX}", param="logprobs", code=_INVALID)
    return {"logprobs": True, "top_logprobs": body.logprobs}


# ---------------------------------------------------------------- the response ("socket")

CANCELLED_CODE = "request_cancelled"     # the end of a cancelled request, as an OpenAI error (410)


def done_error(done: Done) -> APIError | None:
    """The OpenAI error a `done` stands for, or None for an answer (stop, length).

    `cancelled` is no OpenAI finish_reason (stop, length, tool_calls, content_filter,
    function_call), and a client that sees one of those takes the answer for complete. The only
    client that can receive the end of a cancelled request is one that comes back to it (a
    `GET /v1/streams/{id}` resume, an Idempotency-Key retry): it gets what was generated, then
    an error, `code: "request_cancelled"`, which the SDKs raise (openai-python and openai-node
    raise `APIError` on a stream's `{"error": ...}` event), so the truncation is never silent."""
    if done.finish_reason == "error":
        err = done.error or {}
        error = APIError.from_code(err.get("code", "internal"), err.get("message", ""))
        error.param = err.get("param")
        return error
    if done.finish_reason == "cancelled":
        return APIError(410, f"the request was cancelled (its client disconnected or cancelled it) after "
                             f"{done.usage.completion_tokens} tokens; its output ends here, incomplete",
                        code=CANCELLED_CODE)
    return None


class OpenAIResponse:
    """Plays `FrameSocket` for the `Sender`: frames in, OpenAI chunk events (or one JSON body) out.

    A stream's response headers are held until its first event from the worker (a token, or the
    end), or its first heartbeat (HEARTBEAT_S), or a close (drain). So a refusal the worker makes
    before any token — a prompt over MAX_PROMPT_TOKENS (`context_too_long`: only the worker's
    tokenizer can count it; the gateway has none), a request that can never fit the KV cache —
    is an HTTP status (400), which the SDKs raise as `BadRequestError`, not a `200` stream with an
    error inside. It costs no time to first token: the headers and the role chunk go out in the
    same write as the first token (tests/test_openai_compat.py measures it)."""

    HOLD_HEADERS = True      # False: the 200 goes out at the request's acceptance (a test compares the two)

    def __init__(self, send: Send, *, oai_id: str, model: str, stream: bool, include_usage: bool,
                 role_chunk: bool, headers: list[tuple[bytes, bytes]] | None = None, tools=None,
                 prompt_tokens: Callable[[], int] | None = None):
        self._send = send
        # continuous usage (vLLM's stream_options.continuous_usage_stats): every chunk carries the
        # usage so far; the prompt's size is what the worker's token events said
        self.prompt_tokens = prompt_tokens
        self.tools = tools                   # a gateway.tool_calls parser when the request has tools
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
        self.logprobs: list | None = None     # stream: false, when the chunks carry logprobs
        self.done: Done | None = None
        self.error: Error | None = None
        # stream: true — the 200's headers and what was written before the first event, held
        self._start = {"type": "http.response.start", "status": 200, "headers": headers or []}
        self._held: list[str] = []
        self.committed = False               # the 200 went out: a later failure can only be an event in it

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
            if self.stream and self.tools is not None:    # text and tool call deltas
                await self._event(self._usage_so_far(self._chunk(
                    None, None, delta=structured.delta(*self.tools.feed(msg.text)), logprobs=msg.logprobs), msg.seq),
                    msg.seq, commit=True)
            elif self.stream:
                await self._event(self._usage_so_far(self._chunk(msg.text, None, logprobs=msg.logprobs), msg.seq),
                                  msg.seq, commit=True)
            else:
                self.parts.append(msg.text)
                if msg.logprobs is not None:
                    if self.logprobs is None:
                        self.logprobs = []
                    self.logprobs.extend(msg.logprobs)
        elif isinstance(msg, Done):
            self.done = msg
            if self.stream and (self.committed or done_error(msg) is None):
                await self._finish_stream(msg)
            # else: a stream refused before its first event: RunRequest answers with the status
            self.ended.set()
        elif isinstance(msg, Heartbeat):
            if self.stream:   # proxies see traffic; SSE clients ignore comments
                await self._write(": keep-alive\n\n", commit=True)
        else:
            await self.send_payload(self.encode(msg))

    async def close(self, code: int, reason: str, *, last: BaseModel | None = None) -> None:
        if last is not None:
            await self.send(last)
        if self.stream and not self.committed and self._held:
            await self._write("", commit=True)     # e.g. a drain's error event: the id to resume with
        self.ended.set()

    def abort(self) -> None:
        self.broken = True
        self.ended.set()

    # building events -------------------------------------------------------

    def _chunk(self, text: str | None, finish: str | None, *, role: bool = False, logprobs: list | None = None,
               delta: dict | None = None) -> dict:
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "",
                      "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
                      "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _usage_so_far(self, chunk: dict, completion_tokens: int) -> dict:
        if self.prompt_tokens is not None:
            prompt = self.prompt_tokens()
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                              "total_tokens": prompt + completion_tokens}
        return chunk

    async def _finish_stream(self, done: Done) -> None:
        error = done_error(done)
        if error is not None:
            await self._event(error.body(), done.seq, commit=True)
        else:
            if self.tools is not None:
                rest = structured.delta(*self.tools.finish())
                if rest:
                    await self._event(self._chunk(None, None, delta=rest), done.seq, commit=True)
            last = self._chunk(None, structured.finish_reason(self.tools, done.finish_reason))
            if self.prompt_tokens is not None:
                last["usage"] = usage_of(done)
            await self._event(last, done.seq, commit=True)
            if self.include_usage:
                usage = usage_of(done)
                await self._event({**self._chunk(None, None), "choices": [], "usage": usage}, done.seq)
        await self._write("data: [DONE]\n\n")

    def api_error(self) -> APIError | None:
        """The error the request ended with (None for an answer)."""
        if self.done is not None:
            return done_error(self.done)
        msg = self.error
        return APIError.from_code(msg.code if msg else ErrorCode.SHUTTING_DOWN, msg.message if msg else SHUTDOWN_REASON)

    def body(self) -> tuple[int, dict]:
        """stream: false — the status and JSON of the whole answer."""
        error = self.api_error()
        if error is not None:
            return error.status, error.body()
        text = "".join(self.parts)
        if self.chat:
            lp = chat_logprobs(self.logprobs) if self.logprobs is not None else None
            choice = {"index": 0, "message": structured.message(self.tools, text), "logprobs": lp,
                      "finish_reason": structured.finish_reason(self.tools, self.done.finish_reason)}
            obj = "chat.completion"
        else:
            lp = completion_logprobs(self.logprobs) if self.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.done.finish_reason}
            obj = "text_completion"
        return 200, {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model,
                     "choices": [choice], "usage": usage_of(self.done)}

    # writing ----------------------------------------------------------------

    @staticmethod
    def _event_text(data: dict, seq: int) -> str:
        return f"id: {seq}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def _event(self, data: dict, seq: int, *, commit: bool = False) -> None:
        await self._write(self._event_text(data, seq), commit=commit)

    async def _write(self, text: str, *, commit: bool = False) -> None:
        if self.broken:
            return
        start = None
        if not self.committed:
            if not commit and self.HOLD_HEADERS:
                self._held.append(text)          # e.g. the role chunk: it goes with the first event
                return
            text = "".join(self._held) + text
            self._held.clear()
            start, self.committed = self._start, True
        self.send_started = time.monotonic()
        try:
            if start is not None:
                await self._send(start)
            if text:
                await self._send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except (OSError, RuntimeError) as exc:   # the client went away mid-write
            log.debug("SSE write failed: %r", exc)
            self.broken = True
            self.ended.set()
        finally:
            self.send_started = None
        self.last_send = time.monotonic()


def usage_of(done: Done) -> dict:
    """OpenAI's usage, with its own field for the prompt tokens the prefix cache served."""
    p, c = done.usage.prompt_tokens, done.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": done.usage.cached_tokens}}


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
                 stream: bool, include_usage: bool, resumable: bool, tools=None, continuous_usage: bool = False):
        self.hub, self.requests, self.wake, self.req = hub, requests, wake, req
        self.tools = tools
        self.continuous_usage = continuous_usage and include_usage and stream
        self.model, self.stream, self.include_usage, self.resumable = model, stream, include_usage, resumable
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hub, req = self.hub, self.req
        request_id = req.rid.encode()
        out = OpenAIResponse(send, oai_id=req.client_id, model=self.model, stream=self.stream,
                             include_usage=self.include_usage, role_chunk=req.seq == 0, tools=self.tools,
                             prompt_tokens=(lambda: req.prompt_tokens) if self.continuous_usage else None, headers=[
                                 (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                 (b"x-accel-buffering", b"no"), (b"x-request-id", request_id)])
        sender = Sender(out, self.requests, self.wake, hub.settings, hub.metrics)
        conn = HttpSession(out, self.requests, sender, hub.sessions)
        # keep-alive comments on a quiet stream, from the process-wide wheel
        hub.sessions.open(conn, heartbeats=self.stream)
        disconnect = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        ended = asyncio.get_running_loop().create_task(out.ended.wait())
        gone = False
        try:
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
        if out.committed:
            await _end_body(send)
            return
        # stream: false, or a stream that ended before its first event (refused by the worker)
        status, body = out.body()
        headers = {"x-request-id": req.rid}
        if status in (429, 503):
            headers["Retry-After"] = "1"
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)

    async def _cancel(self) -> None:
        req = self.req
        req.cancelling("http_disconnect")    # its final, once the session is gone: request_log.CancelWatch
        # counted here: this session never sees the request's `done` (the WebSocket path counts
        # a cancel when the worker's `done` comes back on the socket)
        self.hub.metrics.requests.labels("cancelled").inc()
        self.hub.metrics.cancels.labels("http_disconnect").inc()
        try:
            if await self.hub.submitter.cancel(req.rid) is None:   # flag + owner's control stream
                req.cancel_at = None     # still queued: it never starts, no slot to free, nothing to time
        except (RedisError, OSError) as exc:
            log.warning("could not cancel %s after a client disconnect: %s", req.rid, exc, extra=rid_of(req.rid))


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
            param = "Idempotency-Key" if exc.param == "idempotency_key" else None
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
    stream_options = body.stream_options or {}
    return RunRequest(hub, requests, wake, req, model=model, stream=body.stream,
                      include_usage=bool(stream_options.get("include_usage")), resumable=body.resumable,
                      tools=structured.parser_for(body),
                      continuous_usage=bool(stream_options.get("continuous_usage_stats")))


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
            hub.metrics.resumes.labels(exc.code.value).inc()
            raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            hub.metrics.resumes.labels(ErrorCode.BACKEND_UNAVAILABLE.value).inc()
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
        hub.metrics.resumes.labels("attached").inc()
    except APIError as exc:
        return exc.response()
    include_usage = request.query_params.get("include_usage", "").lower() in ("1", "true")
    return RunRequest(hub, requests, wake, req, model=hub.settings.served_model_name, stream=True,
                      include_usage=include_usage, resumable=True)


def _model_object(hub: Hub) -> dict:
    return {"id": hub.settings.served_model_name, "object": "model", "created": 0, "owned_by": "llm-stream"}


async def models(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    try:
        _key_id(hub, request)
    except APIError as exc:
        return exc.response()
    return JSONResponse({"object": "list", "data": [_model_object(hub)]})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}` (`client.models.retrieve`): the served model, or 404 model_not_found."""
    hub: Hub = request.app.state.hub
    try:
        _key_id(hub, request)
        _served(hub, request.path_params["model"])
    except APIError as exc:
        return exc.response()
    return JSONResponse(_model_object(hub))


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no route) and 405 (wrong method): OpenAI's error JSON under /v1, so an
    SDK raises `NotFoundError` with a message; Starlette's plain text everywhere else."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if path != "/v1" and not path.startswith("/v1/"):
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({request.method} {path}): no such endpoint (this server serves "
                              "/v1/chat/completions, /v1/completions, /v1/models, /v1/streams/{id}; see "
                              "docs/clients.md)", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = APIError(405, f"Method {request.method} is not allowed on {path} (allowed: {allowed})",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status_code, str(exc.detail), code=None)
    response = error.response()
    response.headers.update(exc.headers or {})
    return response


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
    Route("/v1/streams/{id}", resume_stream, methods=["GET"]),
]

"""Client <-> gateway messages (WebSocket), protocol version 1.

Text frames carry JSON; when the client negotiates the `llm-stream.msgpack` subprotocol, binary
frames carry msgpack of the very same objects. See docs/protocol.md for the client author's view.

`parse_client_message` turns one frame into a typed message or raises `ProtocolError` with a
code the client can act on; it never raises anything else, so one bad frame cannot take down
the socket's other requests.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from shared.errors import ErrorCode, ProtocolError
from shared.sampling import LOGIT_BIAS_MAX, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, PENALTY_MAX
from shared.structured import ResponseFormat, Tool, ToolCall, ToolChoice, check_tools, tool_mode

PROTOCOL_VERSION = 1
MAX_TOP_LOGPROBS = 20     # alternatives per token a request may ask for (OpenAI's chat bound)
JSON_SUBPROTOCOL = "llm-stream.json"
MSGPACK_SUBPROTOCOL = "llm-stream.msgpack"
SUBPROTOCOLS = (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL)

ID_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")   # used with fullmatch: `$` would allow a trailing "\n"
REQUEST_ID_PATTERN = r"^[0-9a-f]{32}$"     # the server's request id: 128 random bits, hex
IDEMPOTENCY_KEY_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
MIN_ANONYMOUS_IDEMPOTENCY_CHARS = 32        # anonymous: the key is the only secret (>= 128 bits)
MAX_NONCE_CHARS = 64
MAX_NONCE_INT = 2**53                       # what every JSON parser represents exactly
_SURROGATE = re.compile("[\ud800-\udfff]")

FinishReason = Literal["stop", "length", "cancelled", "error"]
Priority = Literal["interactive", "batch"]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1


class _ClientMsg(_Msg):
    # strict: a string is not a number and bytes are not text ("10" for max_tokens, a binary
    # msgpack prompt), so a client bug surfaces as invalid_request instead of passing silently
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _check_id(value: str) -> str:
    if not ID_PATTERN.fullmatch(value):
        raise ValueError("id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'")
    return value


# ---------------------------------------------------------------- client -> gateway

class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # tool calling (shared.structured): the calls an assistant message made, and the call a
    # `tool` message answers
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries 'tool_calls'")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a 'tool' message, and only one, names the call it answers in 'tool_call_id'")
        return self


class Generate(_ClientMsg):
    type: Literal["generate"] = "generate"
    id: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1000)     # 0 or -1 (vLLM's "off"): no top-k
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=8)
    priority: Priority = "interactive"
    # the client's name for this piece of work: a second generate with the same key (e.g. sent
    # again because `accepted` was lost with its gateway) attaches to the first request instead
    # of starting another (docs/protocol.md)
    idempotency_key: str | None = Field(None, pattern=IDEMPOTENCY_KEY_PATTERN)
    # requests with the same key go to the same worker while it has room, so the prompt prefix
    # they share is in its KV cache (OpenAI's `prompt_cache_key`; docs/protocol.md)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    # prefix-cache scope (vLLM's `cache_salt`): requests share cached prompt blocks only with
    # requests of the same scope; by default each API key is its own scope, and clients that
    # send the same salt share on purpose, across keys (docs/protocol.md)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # structured output (the tokens follow a JSON grammar) and tool calling (shared.structured)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: ToolChoice | None = None
    # per output token its logprob, and this many most likely alternatives (OpenAI's chat fields)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # never end at an EOS token: run to max_tokens (vLLM's extension; benchmarks force lengths)
    ignore_eos: bool = False
    # vLLM's sampling controls (shared.sampling, docs/protocol.md); logit_bias keys are token ids
    # written in decimal, as OpenAI's JSON has them
    presence_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = \
        Field(None, max_length=MAX_LOGIT_BIAS)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(default_factory=list,
                                                                         max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a prompt given as token ids (vLLM's; lm-evaluation-harness sends them), instead of text
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    # the first chunk carries the prompt as text (`prompt_text`) and, with `prompt_logprobs`, each
    # prompt token's logprob and this many alternatives (completions `echo` + `logprobs`)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    _id = field_validator("id")(_check_id)

    @field_validator("temperature", "top_p", "repetition_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> "Generate":
        if [self.messages, self.prompt, self.prompt_ids].count(None) != 2:
            raise ValueError("give exactly one of 'messages', 'prompt' or 'prompt_ids'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        check_tools(self.tools, self.tool_choice, self.messages is not None)
        if tool_mode(self.tools, self.tool_choice) == "forced" and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("'response_format' and a tool_choice that forces a call cannot be combined")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    def prompt_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        return sum(len(m.content) for m in self.messages or ())


class Cancel(_ClientMsg):
    type: Literal["cancel"] = "cancel"
    id: str
    _id = field_validator("id")(_check_id)


class Resume(_ClientMsg):
    """Re-attach to a request after a reconnect: everything after `last_seq` is sent again.

    `request_id` (from `accepted`) is required: it is the unguessable secret that proves the
    client saw the request start, so nobody can resume another client's stream by its `id`."""
    type: Literal["resume"] = "resume"
    id: str
    last_seq: int = Field(0, ge=0)
    request_id: str = Field(pattern=REQUEST_ID_PATTERN, description="the server id from `accepted`")
    _id = field_validator("id")(_check_id)


class Ping(_ClientMsg):
    type: Literal["ping"] = "ping"
    # bounded: the pong echoes it, so a large nonce would let a client amplify its own memory use
    nonce: Annotated[str, Field(max_length=MAX_NONCE_CHARS)] | Annotated[int, Field(ge=-MAX_NONCE_INT, le=MAX_NONCE_INT)] | None = None


class Auth(_ClientMsg):
    """First message for clients that cannot set an Authorization header (browsers)."""
    type: Literal["auth"] = "auth"
    api_key: str = Field(min_length=1, max_length=256)


ClientMessage = Annotated[Union[Generate, Cancel, Resume, Ping, Auth], Field(discriminator="type")]
_client_adapter: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
CLIENT_TYPES = ("generate", "cancel", "resume", "ping", "auth")


# ---------------------------------------------------------------- gateway -> client

class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0           # of prompt_tokens, those served from the worker's prefix cache
    ttft_ms: float | None = None
    total_ms: float | None = None


class TopLogprob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str
    logprob: float
    bytes: list[int]                 # the token's UTF-8 bytes


class TokenLogprob(TopLogprob):
    """One output token: OpenAI's chat `logprobs.content[i]`, plus where its text starts."""
    top_logprobs: list[TopLogprob]
    text_offset: int                 # the lengths of the output's token strings before it


class PromptLogprob(TokenLogprob):
    """One prompt token (`prompt_logprobs`): the first has no logprob (nothing precedes it)."""
    logprob: float | None


class Accepted(_Msg):
    type: Literal["accepted"] = "accepted"
    id: str
    request_id: str


class Chunk(_Msg):
    """`seq` is the number of token events delivered so far for this request, including this
    chunk's. It is the same on every gateway replica, so it is what `resume` counts from."""
    type: Literal["chunk"] = "chunk"
    id: str
    seq: int
    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None = None    # requests that ask: one per token of this chunk
    # the request's first chunk, when asked: the prompt as text (`echo`) and per prompt token
    # its logprob and alternatives (`prompt_logprobs`)
    prompt_text: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None


class Done(_Msg):
    type: Literal["done"] = "done"
    id: str
    seq: int
    finish_reason: FinishReason
    usage: Usage
    error: dict[str, Any] | None = None


class ToolCallStart(_Msg):
    """A request with tools: the model started calling `name` (gateway.ws.tool_frames). Sent
    before the chunk `seq` whose text made it known."""
    type: Literal["tool_call"] = "tool_call"
    id: str
    seq: int
    index: int                       # the call's position in the answer, from 0
    call_id: str                     # derived from the request id and index: the same on every replica and resume
    name: str


class ToolCallDelta(_Msg):
    """More of call `index`'s arguments (a fragment of the JSON string), before chunk `seq`."""
    type: Literal["tool_call_delta"] = "tool_call_delta"
    id: str
    seq: int
    index: int
    arguments: str


class ToolCallDone(_Msg):
    """Call `index` is complete: its whole `arguments` (before chunk `seq`, or before `done`)."""
    type: Literal["tool_call_done"] = "tool_call_done"
    id: str
    seq: int
    index: int
    call_id: str
    name: str
    arguments: str


class Error(_Msg):
    type: Literal["error"] = "error"
    id: str | None = None
    code: ErrorCode
    message: str
    retryable: bool = False
    param: str | None = None         # the request field the error is about, if one


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    ts: float


class Pong(_Msg):
    type: Literal["pong"] = "pong"
    nonce: str | int | None = None
    ts: float


ServerMessage = Annotated[Union[Accepted, Chunk, Done, ToolCallStart, ToolCallDelta, ToolCallDone, Error, Heartbeat,
                                Pong], Field(discriminator="type")]
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


# ---------------------------------------------------------------- codecs

def decode_frame(frame: str | bytes, *, max_bytes: int) -> dict:
    """Bytes/str of one frame -> dict. Text frames are JSON; binary frames are msgpack."""
    size = len(frame.encode() if isinstance(frame, str) else frame)
    if size > max_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {size} bytes exceeds the limit of {max_bytes}")
    try:
        obj = json.loads(frame) if isinstance(frame, str) else msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, UnicodeDecodeError) as exc:
        kind = "JSON" if isinstance(frame, str) else "msgpack"
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame is not valid {kind}: {exc}") from None
    except Exception as exc:  # msgpack raises a handful of other types on hostile input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame could not be decoded: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame must be an object")
    if isinstance(frame, str) and "\\u" in frame:
        _check_unicode(obj)
    return obj


def _valid_id(obj: dict) -> str | None:
    value = obj.get("id")
    return value if isinstance(value, str) and ID_PATTERN.fullmatch(value) else None


def _check_unicode(frame_obj: dict) -> None:
    """JSON's \\uD800-style escapes can smuggle lone surrogates, which no UTF-8 encoder (Redis
    entry, reply frame) accepts: refuse the frame here, before anything is started or echoed.
    (msgpack strings are decoded as strict UTF-8, which already refuses them.)"""
    stack: list = [frame_obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "a string is not valid Unicode (lone surrogate)",
                                    _valid_id(frame_obj))
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_client_message(obj: dict) -> Generate | Cancel | Resume | Ping | Auth:
    """Validate a decoded frame. Raises ProtocolError with the most specific code it can."""
    # echo the id only when it is a valid one: an error must not carry (amplify) arbitrary input
    rid = _valid_id(obj)
    # strict like every other field: `true` and `1.0` equal 1 in Python but are not the integer 1
    if "v" in obj and (type(obj["v"]) is not int or obj["v"] != PROTOCOL_VERSION):
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {_short(obj['v'])} is not supported; use 1", rid)
    kind = obj.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE,
                            f"unknown message type {_short(kind)}; expected one of {', '.join(CLIENT_TYPES)}", rid)
    if kind in ("generate", "cancel", "resume") and "id" not in obj:
        raise ProtocolError(ErrorCode.MISSING_ID, f"'{kind}' needs an 'id'")
    try:
        return _client_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, _describe(exc), rid, param=_param(exc)) from None


def _param(exc: ValidationError) -> str | None:
    """The field the first error is about (its location's first part after the message type)."""
    errors = exc.errors()
    loc = errors[0]["loc"] if errors else ()
    return str(loc[1]) if len(loc) > 1 else None


def _short(value, limit: int = 64) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p)[:40] for p in err["loc"][1:]) or "message"
        parts.append(f"{loc}: {err['msg'][:200]}")
    return "; ".join(parts)


_json_str = json.encoder.encode_basestring       # what json.dumps(ensure_ascii=False) writes for a str
_CHUNK_JSON = '{"v":1,"type":"chunk","id":%s,"seq":%d,"text":%s,"tokens":%d}'
# a chunk's optional fields (logprobs, the prompt's...): any of them set takes the generic path
_CHUNK_EXTRAS = tuple(f for f in Chunk.model_fields if f not in ("v", "type", "id", "seq", "text", "tokens"))


def encode_server(msg: BaseModel, *, binary: bool) -> str | bytes:
    if type(msg) is Chunk and all(getattr(msg, f) is None for f in _CHUNK_EXTRAS):
        # the hot path (a frame per stream per flush): the very bytes of the generic path below,
        # without its model dump, ~3 µs a frame (tests/test_protocol.py checks they are equal)
        if binary:
            return msgpack.packb({"v": 1, "type": "chunk", "id": msg.id, "seq": msg.seq, "text": msg.text,
                                  "tokens": msg.tokens}, use_bin_type=True)
        return _CHUNK_JSON % (_json_str(msg.id), msg.seq, _json_str(msg.text), msg.tokens)
    data = msg.model_dump(mode="json", exclude_none=True)
    return msgpack.packb(data, use_bin_type=True) if binary else json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def parse_server_message(obj: dict):
    """Used by clients (tests, bench, SDKs) to type what the server sent."""
    return _server_adapter.validate_python(obj)


def error_message(exc: ProtocolError) -> Error:
    return Error(id=exc.request_id, code=exc.code, message=exc.message, retryable=exc.retryable, param=exc.param)

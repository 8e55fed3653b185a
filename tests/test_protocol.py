"""Round-trip and validation of every message type on both hops."""

from __future__ import annotations

import json

import msgpack
import pytest

from shared.errors import ErrorCode, ProtocolError
from shared.protocol import (
    Accepted, Chunk, Done, Error, Heartbeat, Pong, Usage, decode_frame, encode_server,
    parse_client_message, parse_server_message,
)
from shared.sampling import SamplingParams
from shared.events import TokEvent
from shared.streams import Keys, RequestEntry, decode_event

CLIENT_MESSAGES = [
    {"type": "generate", "id": "r1", "prompt": "hi", "max_tokens": 8, "temperature": 0.0, "seed": 3, "stop": ["\n"]},
    {"type": "generate", "id": "r2", "messages": [{"role": "user", "content": "hello"}], "priority": "batch", "top_k": 5, "top_p": 0.9},
    {"type": "cancel", "id": "r1"},
    {"type": "resume", "id": "r1", "last_seq": 7, "request_id": "0123456789abcdef0123456789abcdef"},
    {"type": "ping", "nonce": 42},
    {"type": "auth", "api_key": "sk-test"},
]


CHUNK_TEXTS = ["", " plain", 'quote " and \\ backslash', "tab\tnew\nline\r\x00\x1f\x7f", "héllo ✓ 𝄞 emoji 🎉",
               "\u2028\u2029 separators", "</script>", "a" * 5000]


@pytest.mark.parametrize("text", CHUNK_TEXTS, ids=range(len(CHUNK_TEXTS)))
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_the_chunk_fast_path_writes_the_generic_paths_bytes(text, binary):
    chunks = [Chunk(id="r-1.a:b_c", seq=2 ** 40, text=text, tokens=7)]
    # every optional field set on its own takes the generic path (nothing of it is dropped)
    for name, field in Chunk.model_fields.items():
        if name not in ("v", "type", "id", "seq", "text", "tokens"):
            value = "the prompt" if field.annotation == str | None else []
            chunks.append(Chunk(id="r1", seq=3, text=text, tokens=1, **{name: value}))
    assert len(chunks) >= 4
    for chunk in chunks:
        data = chunk.model_dump(mode="json", exclude_none=True)
        generic = msgpack.packb(data, use_bin_type=True) if binary else json.dumps(data, separators=(",", ":"),
                                                                                   ensure_ascii=False)
        assert encode_server(chunk, binary=binary) == generic


@pytest.mark.parametrize("obj", CLIENT_MESSAGES, ids=lambda o: o["type"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_client_messages_round_trip(obj, binary):
    frame = msgpack.packb(obj) if binary else json.dumps(obj)
    msg = parse_client_message(decode_frame(frame, max_bytes=10_000))
    assert msg.type == obj["type"]
    dumped = msg.model_dump(exclude_none=True)
    for k, value in obj.items():
        got = dumped[k]
        assert got == value, (k, got, value)


SERVER_MESSAGES = [
    Accepted(id="r1", request_id="x1"),
    Chunk(id="r1", seq=3, text="héllo ✓", tokens=3),
    Done(id="r1", seq=9, finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=9, ttft_ms=12.5, total_ms=80.0)),
    Error(id="r1", code=ErrorCode.DUPLICATE_ID, message="dup", retryable=False),
    Error(code=ErrorCode.BAD_FRAME, message="socket-level"),
    Heartbeat(ts=1.5),
    Pong(nonce="n", ts=2.0),
]


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda m: m.type)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_server_messages_round_trip(msg, binary):
    frame = encode_server(msg, binary=binary)
    assert isinstance(frame, bytes if binary else str)
    back = parse_server_message(decode_frame(frame, max_bytes=10_000))
    assert back == msg


@pytest.mark.parametrize(
    "obj, code",
    [
        ({"type": "nope"}, ErrorCode.UNKNOWN_TYPE),
        ({"id": "x"}, ErrorCode.UNKNOWN_TYPE),
        ({"type": "generate", "prompt": "x"}, ErrorCode.MISSING_ID),
        ({"type": "cancel"}, ErrorCode.MISSING_ID),
        ({"type": "generate", "id": "bad id!", "prompt": "x"}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a"}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "temperature": -1}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "temperature": "hot"}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "top_p": 0}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 0}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "stop": [""]}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "surprise": 1}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "messages": [{"role": "wizard", "content": "y"}]}, ErrorCode.INVALID_REQUEST),
        ({"type": "resume", "id": "a", "last_seq": -1}, ErrorCode.INVALID_REQUEST),
        ({"type": "resume", "id": "a", "last_seq": 1}, ErrorCode.INVALID_REQUEST),             # no request_id
        ({"type": "resume", "id": "a", "request_id": "abc"}, ErrorCode.INVALID_REQUEST),      # not a server id
        ({"type": "generate", "id": "a", "prompt": "x", "max_tokens": "10"}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": b"bytes"}, ErrorCode.INVALID_REQUEST),
        ({"type": "ping", "nonce": "n" * 65}, ErrorCode.INVALID_REQUEST),
        ({"type": "ping", "v": 2}, ErrorCode.UNSUPPORTED_VERSION),
        ({"type": "ping", "v": True}, ErrorCode.UNSUPPORTED_VERSION),      # strict: not the integer 1
        ({"type": "ping", "v": 1.0}, ErrorCode.UNSUPPORTED_VERSION),
        ({"type": "ping", "v": "1"}, ErrorCode.UNSUPPORTED_VERSION),
        ({"type": "cancel", "id": "abc\n"}, ErrorCode.INVALID_REQUEST),     # `$` would allow the newline
        ({"type": "generate", "id": "a\n", "prompt": "x"}, ErrorCode.INVALID_REQUEST),
        ({"type": "resume", "id": "a", "request_id": "0" * 32 + "\n"}, ErrorCode.INVALID_REQUEST),
        ({"type": "generate", "id": "a", "prompt": "x", "seed": 2**63}, ErrorCode.INVALID_REQUEST),   # docs: 0..2^63-1
    ],
)
def test_validation_errors_are_typed(obj, code):
    with pytest.raises(ProtocolError) as info:
        parse_client_message(obj)
    assert info.value.code == code
    assert info.value.message


def test_an_invalid_id_is_never_echoed():
    with pytest.raises(ProtocolError) as info:
        parse_client_message({"type": "cancel", "id": "abc\n", "v": 2})
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION and info.value.request_id is None


def test_error_names_the_request_it_concerns():
    with pytest.raises(ProtocolError) as info:
        parse_client_message({"type": "generate", "id": "abc", "prompt": "x", "top_k": -3})
    assert info.value.request_id == "abc"
    assert "top_k" in info.value.message


@pytest.mark.parametrize("frame", ["{not json", "[1,2]", "42", b"\xc1\xff", msgpack.packb([1, 2])])
def test_bad_frames(frame):
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame, max_bytes=1000)
    assert info.value.code == ErrorCode.BAD_FRAME


def test_oversize_frame():
    with pytest.raises(ProtocolError) as info:
        decode_frame("x" * 2000, max_bytes=1000)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_request_entry_round_trip():
    entry = RequestEntry(rid="r-1", params=SamplingParams(max_tokens=5, temperature=0.0, stop=["."]),
                         messages=[{"role": "user", "content": "hi"}], priority="batch", created_ms=5, key_id="k")
    assert RequestEntry.decode(entry.encode()) == entry
    assert entry.params.deterministic


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"v": 9, "rid": "a"}),
        msgpack.packb({"v": 1, "rid": "a", "params": {"max_tokens": 0}, "prompt": "x"}),
        msgpack.packb({"v": 1, "rid": "a", "params": {}, "prompt": "x", "messages": []}),
        msgpack.packb({"v": 1, "rid": "a", "params": {"bogus": 1}, "prompt": "x"}),
        msgpack.packb({"v": 1, "rid": "", "params": {}, "prompt": "x"}),
    ],
)
def test_malformed_request_entries_raise_value_error(raw):
    with pytest.raises(ValueError):
        RequestEntry.decode(raw)


def test_out_events_round_trip_and_keys_are_hash_tagged():
    raw = TokEvent("r", 3, [5, 6], "ab", 2, 1000).encode()
    assert decode_event(raw) == {"v": 2, "k": "tok", "rid": "r", "seq": 3, "n": 2, "ids": [5, 6], "text": "ab",
                                 "ep": 2, "ms": 1000}
    keys = Keys("p")
    assert keys.out("r") == "p:{r:r}:out" and keys.meta("r") == "p:{r:r}:meta" and keys.cancel("r") == "p:{r:r}:cancel"
    assert keys.requests == "p:{q}:requests" and keys.conc("k") == "p:{q}:conc:k" and keys.dead == "p:{q}:dead"
    assert keys.inbox("g") == "p:{g:g}:inbox" and keys.ctl("w") == "p:{w:w}:ctl" and keys.workers == "p:{reg}:workers"
    entry = RequestEntry(rid="a", params=SamplingParams(), prompt="x", gw="g1", key_id="k")
    assert RequestEntry.decode(entry.encode()).gw == "g1"


# ---- structured output and tools on `generate` (shared.structured)

_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": _SCHEMA},
    {"tools": [_TOOL], "tool_choice": "required"},
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]},
])
def test_structured_fields_are_accepted(fields):
    msg = parse_client_message({"type": "generate", "id": "a", "messages": [{"role": "user", "content": "hi"}], **fields})
    entry_params = SamplingParams()
    assert msg.id == "a" and entry_params.grammar is None


@pytest.mark.parametrize("fields", [
    {"response_format": "json"},                                        # strict: an object
    {"response_format": {"type": "json_schema"}},                       # no json_schema
    {"response_format": {"type": "json_object", "json_schema": {"name": "s"}}},
    {"tool_choice": "required"},                                        # no tools
    {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tools": [_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"messages": [{"role": "tool", "content": "sunny"}]},               # which call does it answer?
    {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
])
def test_bad_structured_fields_are_invalid_requests(fields):
    obj = {"type": "generate", "id": "a", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ProtocolError) as info:
        parse_client_message(obj)
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_tools_need_chat_and_grammars_cross_redis():
    with pytest.raises(ProtocolError):
        parse_client_message({"type": "generate", "id": "a", "prompt": "x", "tools": [_TOOL]})
    from shared.structured import grammar_for
    msg = parse_client_message({"type": "generate", "id": "a", "messages": [{"role": "user", "content": "hi"}],
                                "tools": [_TOOL], "tool_choice": "required"})
    grammar = grammar_for(msg.response_format, msg.tools, msg.tool_choice)
    assert grammar["schema"]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    entry = RequestEntry(rid="r", params=SamplingParams(grammar=grammar), messages=[{"role": "user", "content": "hi"}],
                         tools=[_TOOL])
    back = RequestEntry.decode(entry.encode())
    assert back.params.grammar == grammar and back.tools == [_TOOL]
    plain = msgpack.unpackb(RequestEntry(rid="r", params=SamplingParams(), prompt="x").encode())
    assert "grammar" not in plain["params"] and "tools" not in plain    # what older workers read

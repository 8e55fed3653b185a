"""The worker -> gateway event classes and their codec (shared.events): each encodes to exactly
the bytes the dict encoders before it wrote (so replicas of both versions read each other during
a rolling upgrade), decodes back to itself, and ignores what it does not know."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.errors import ErrorCode, ProtocolError
from shared.events import (AttachMarker, DoneEvent, DoneUsage, ErrEvent, Moved, ReplyError, TokEvent, TokenizeReply,
                           decode_event, decode_events, error_code)
from shared.protocol import parse_client_message
from shared.streams import pack_event_list


# ---- the encoders the classes replaced, frozen here as the reference for the wire bytes ----

def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def old_encode_tok(rid, seq, ids, text, ep, ms, lp=None, pt=0) -> bytes:
    event = {"v": 2, "k": "tok", "rid": rid, "seq": seq, "n": len(ids), "ids": ids, "text": text, "ep": ep, "ms": ms}
    if pt:
        event["pt"] = pt
    if lp is not None:
        event["lp"] = lp
    return _pack(event)


def _who(event: dict, worker: str, lane: str) -> dict:
    if worker:
        event["wk"] = worker
    if lane:
        event["lane"] = lane
    return event


def old_encode_done(rid, seq, finish_reason, prompt_tokens, completion_tokens, ep, ms, *, ttft_ms=None,
                    cached_tokens=0, ttfmt_ms=None, ttlt_ms=None, worker="", lane="") -> bytes:
    usage: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    if cached_tokens:
        usage["cached_tokens"] = cached_tokens
    for name, value in (("ttft_ms", ttft_ms), ("ttfmt_ms", ttfmt_ms), ("ttlt_ms", ttlt_ms)):
        if value is not None:
            usage[name] = max(0, value)
    return _pack(_who({"v": 2, "k": "done", "rid": rid, "seq": seq, "finish_reason": finish_reason,
                       "usage": usage, "ep": ep, "ms": ms}, worker, lane))


def old_encode_err(rid, seq, code, message, retryable, ep, ms, *, worker="", lane="") -> bytes:
    return _pack(_who({"v": 2, "k": "err", "rid": rid, "seq": seq, "code": code, "message": message,
                       "retryable": retryable, "ep": ep, "ms": ms}, worker, lane))


def old_with_text(payload: bytes, text: str) -> bytes:
    """How the worker put text without a token id on a final: unpack, add, pack again."""
    obj = msgpack.unpackb(payload, raw=False)
    obj["text"] = text
    return msgpack.packb(obj, use_bin_type=True)


def old_encode_attach_marker(rid, seq, ep, att) -> bytes:
    return _pack({"v": 2, "k": "att", "rid": rid, "seq": seq, "ep": ep, "att": att})


def old_encode_tokenize_reply(reply_id, answer: dict) -> bytes:
    return _pack({"v": 2, "k": "tokr", "rid": reply_id, **answer})


LP = [["a", -0.5, [["a", -0.5], ["b", -1.25]], 0], ["é", -2.0, [], 1]]

# (the event, the old encoder's bytes for the same input)
CASES = [
    (TokEvent("r1", 3, [5, 6], "ab", 2, 1000), old_encode_tok("r1", 3, [5, 6], "ab", 2, 1000)),
    (TokEvent("r1", 1, [7], "", 1, 5, None, 12), old_encode_tok("r1", 1, [7], "", 1, 5, None, 12)),
    (TokEvent("r1", 2, [8, 9], "é!", 1, 5, LP, 40), old_encode_tok("r1", 2, [8, 9], "é!", 1, 5, LP, 40)),
    (DoneEvent("r2", 4, "length", DoneUsage(3, 4), 1, 77), old_encode_done("r2", 4, "length", 3, 4, 1, 77)),
    (DoneEvent("r2", 4, "stop", DoneUsage(3, 4, 16, 120, 130, 900), 2, 77, "w-1", "batch"),
     old_encode_done("r2", 4, "stop", 3, 4, 2, 77, ttft_ms=120, cached_tokens=16, ttfmt_ms=130, ttlt_ms=900,
                     worker="w-1", lane="batch")),
    (DoneEvent("r2", 0, "cancelled", DoneUsage(3, 0, 0, None, None, -5), 1, 77, "w-1"),
     old_encode_done("r2", 0, "cancelled", 3, 0, 1, 77, ttlt_ms=-5, worker="w-1")),
    (DoneEvent("r2", 4, "stop", DoneUsage(3, 4, 0, 1, 2, 3), 1, 77, "w-1", "interactive", "tail"),
     old_with_text(old_encode_done("r2", 4, "stop", 3, 4, 1, 77, ttft_ms=1, ttfmt_ms=2, ttlt_ms=3, worker="w-1",
                                   lane="interactive"), "tail")),
    (ErrEvent("r3", 2, "context_too_long", "too long", False, 1, 9),
     old_encode_err("r3", 2, "context_too_long", "too long", False, 1, 9)),
    (ErrEvent("r3", 2, "internal", "boom", True, 1, 9, "w-2", "batch", None, "xy"),
     old_with_text(old_encode_err("r3", 2, "internal", "boom", True, 1, 9, worker="w-2", lane="batch"), "xy")),
    (AttachMarker("r4", 10, 3, 2), old_encode_attach_marker("r4", 10, 3, 2)),
    (AttachMarker("r4", None, 0, 1), old_encode_attach_marker("r4", None, 0, 1)),
    (TokenizeReply("tok-1", [1, 2], None, 2048), old_encode_tokenize_reply(
        "tok-1", {"tokens": [1, 2], "token_strs": None, "max_model_len": 2048})),
    (TokenizeReply("tok-1", [1, 2], ["a", "b"], 2048), old_encode_tokenize_reply(
        "tok-1", {"tokens": [1, 2], "token_strs": ["a", "b"], "max_model_len": 2048})),
    (TokenizeReply("tok-2", prompt="hello"), old_encode_tokenize_reply("tok-2", {"prompt": "hello"})),
    (TokenizeReply("tok-3", error=ReplyError("invalid_request", "bad", "tokens")), old_encode_tokenize_reply(
        "tok-3", {"error": {"code": "invalid_request", "message": "bad", "param": "tokens"}})),
    (TokenizeReply("tok-3", error=ReplyError("overloaded", "busy")), old_encode_tokenize_reply(
        "tok-3", {"error": {"code": "overloaded", "message": "busy", "param": None}})),
    # new in issue 34 (no older encoder): the map a gateway of the version before skips as unknown
    (Moved("r5", 3), _pack({"v": 2, "k": "moved", "rid": "r5", "att": 3})),
]


@pytest.mark.parametrize("event,old", CASES, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(CASES)])
def test_the_wire_bytes_are_the_old_encoders(event, old):
    assert event.encode() == old


@pytest.mark.parametrize("event,old", CASES, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(CASES)])
def test_round_trip(event, old):
    back = decode_event(event.encode())
    if isinstance(event, DoneEvent) and event.usage.ttlt_ms is not None and event.usage.ttlt_ms < 0:
        # the wire never carries a negative duration
        event = dataclasses.replace(event, usage=dataclasses.replace(event.usage, ttlt_ms=0))
    assert type(back) is type(event) and back == event


def test_an_error_param_travels_and_an_old_reader_ignores_it():
    err = ErrEvent("r", 0, "invalid_request", "response_format: bad schema", False, 1, 2, param="response_format")
    assert decode_event(err.encode()).param == "response_format"
    wire = msgpack.unpackb(err.encode(), raw=False)
    assert wire["param"] == "response_format"
    without = {k: v for k, v in wire.items() if k != "param"}
    assert _pack(without) == old_encode_err("r", 0, "invalid_request", "response_format: bad schema", False, 1, 2)


@pytest.mark.parametrize("event,old", CASES, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(CASES)])
def test_unknown_extra_keys_are_ignored(event, old):
    wire = msgpack.unpackb(old, raw=False)
    wire.update({"zz": [1, 2], "future_field": {"a": 1}})
    assert decode_event(_pack(wire)) == decode_event(old)


def test_an_inbox_entry_decodes_the_events_it_knows_in_order():
    payloads = [e.encode() for e, _ in CASES] + [_pack({"v": 2, "k": "future", "rid": "x"}), _pack(7)]
    events = decode_events(pack_event_list(payloads))
    assert events == [decode_event(e.encode()) for e, _ in CASES]
    assert decode_event(_pack({"v": 2, "k": "future", "rid": "x"})) is None
    assert decode_events(CASES[0][1]) == [CASES[0][0]]       # a lone map, not in a list


def test_a_sparse_map_decodes_with_the_old_readers_defaults():
    tok = decode_event(_pack({"k": "tok", "rid": "r", "seq": 2, "n": 2}))
    assert (tok.seq, tok.ids, tok.text, tok.epoch, tok.logprobs, tok.prompt_tokens) == (2, [], "", 0, None, 0)
    err = decode_event(_pack({"k": "err", "rid": "r", "code": "no_such_code"}))
    assert (err.code, err.message, err.retryable, err.param, err.seq) == ("no_such_code", "internal", True, None, 0)
    assert error_code(err.code) == ErrorCode.INTERNAL
    stalled = decode_event(_pack({"k": "err", "code": "stalled", "message": "m"}))
    assert stalled.retryable is True and stalled.rid == ""
    done = decode_event(_pack({"k": "done", "seq": 1, "finish_reason": "stop", "usage": {}}))
    assert done.usage is None and done.worker == "" and not done.local


def test_kinds_and_finals():
    assert [type(e).KIND for e in (TokEvent("r", 1, [1], "", 0, 0), AttachMarker("r", 0, 0, 0))] == ["tok", "att"]
    assert DoneEvent.is_final and ErrEvent.is_final
    assert not (TokEvent.is_final or AttachMarker.is_final or TokenizeReply.is_final)
    assert TokEvent("r", 5, [3, 4, 5], "", 0, 0).first == 3


def test_the_gateways_own_finals_are_the_same_classes_marked_local():
    cancelled = DoneEvent.here("r", 4, "cancelled")
    assert cancelled.local and cancelled.usage is None and cancelled.seq == 4
    stalled = ErrEvent.here("r", 2, ErrorCode.STALLED, "no output")
    assert stalled.local and stalled.retryable and stalled.code == "stalled"
    elsewhere = ErrEvent.here("r", 2, ErrorCode.RESUMED_ELSEWHERE, "moved")
    assert not elsewhere.retryable


def test_the_worker_writes_the_engines_error_param():
    from shared.streams import RequestEntry, SamplingParams
    from worker.engine import StepOutput
    from worker.events import InFlight, Progress
    entry = RequestEntry(rid="q", params=SamplingParams(), prompt="x")
    st = InFlight.start("q", "1-0", entry, Progress(), epoch=1, gw="g")
    st.add_output(StepOutput("q", "", [], True, "error", 3, 0, ErrorCode.INVALID_REQUEST, "response_format: no",
                             error_param="response_format"))
    final = decode_event(st.unsent[-1].payload)
    assert isinstance(final, ErrEvent) and (final.code, final.param) == ("invalid_request", "response_format")


def test_a_refused_field_is_named_by_the_protocol_error():
    with pytest.raises(ProtocolError) as info:
        parse_client_message({"type": "generate", "id": "a", "prompt": "x", "idempotency_key": "bad key!"})
    assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.param == "idempotency_key"
    with pytest.raises(ProtocolError) as info:
        parse_client_message({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 0})
    assert info.value.param == "max_tokens"


# ---- per-token text lengths: where a resume cuts an event (TokEvent.lens, `tl`) ----

def _out(text, ids, lp=None):
    from worker.engine import StepOutput
    o = StepOutput("q", text, ids, False, None, 3, 0)
    o.logprobs = lp
    return o


def _built(outputs) -> TokEvent:
    ev = TokEvent("q", 0, [], "", 1, 0)
    for o in outputs:
        ev.add_output(o)
    ev.seq = len(ev.ids)
    return ev


def test_an_event_says_how_much_text_each_token_released_and_is_cut_at_any_token():
    outputs = [_out("Hel", [1]), _out("", [2]), _out("lo", [3]), _out("", [4]), _out("", [5]), _out("é", [6]),
               _out("", [7, 8]), _out("!?", [9])]
    ev = _built(outputs)
    assert ev.text == "Helloé!?" and ev.lens == [3, 0, 2, 0, 0, 1, 0, 0, 2]
    back = decode_event(ev.encode())
    assert msgpack.unpackb(ev.encode())["tl"] == bytes(ev.lens)          # one byte a token on the wire
    assert dataclasses.replace(back, lens=list(back.lens)) == ev
    for after in range(1, 9):
        cut = back.tail(after)
        assert cut.ids == ev.ids[after:] and cut.seq == 9 and cut.first == after + 1
        released_after = "".join(o.text for o in outputs if o.token_ids and o.token_ids[-1] > after)
        assert cut.text == released_after and sum(cut.lens) == len(cut.text)


def test_text_that_came_without_an_id_rides_with_a_neighbouring_token():
    ev = _built([_out("a", []), _out("b", [1]), _out("c", [2]), _out("d", [])])
    assert ev.lens == [2, 2] and ev.text == "abcd"
    assert ev.tail(1).text == "cd"


def test_a_token_that_released_256_characters_or_more_sends_the_lengths_as_an_array():
    ev = _built([_out("a" * 300, [1]), _out("b", [2])])
    assert msgpack.unpackb(ev.encode())["tl"] == [300, 1]
    assert decode_event(ev.encode()).tail(1).text == "b"


def test_a_one_token_event_carries_no_lengths_on_the_wire():
    ev = _built([_out("x", [1])])
    assert "tl" not in msgpack.unpackb(ev.encode())
    assert ev.encode() == old_encode_tok("q", 1, [1], "x", 1, 0)


def test_logprobs_are_cut_with_the_tokens():
    lp = [["a", -0.1, [], 0], ["b", -0.2, [], 1], ["c", -0.3, [], 2]]
    ev = _built([_out("a", [1], lp[:1]), _out("b", [2], lp[1:2]), _out("c", [3], lp[2:])])
    cut = decode_event(ev.encode()).tail(1)
    assert cut.logprobs == lp[1:] and cut.text == "bc"


def test_an_event_written_before_the_lengths_is_cut_only_where_it_can_be():
    old = decode_event(old_encode_tok("q", 4, [1, 2, 3, 4], "abcd", 1, 0))
    assert old.lens is None and old.tail(2) is None           # text, nothing says where: refused
    assert decode_event(old_encode_tok("q", 3, [1, 2, 3], "", 1, 0)).tail(1).ids == [2, 3]
    lp = [["a", -0.1, [], 0], ["bc", -0.2, [], 1], ["d", -0.3, [], 3]]
    with_lp = decode_event(old_encode_tok("q", 3, [1, 2, 3], "abcd", 1, 0, lp))
    assert with_lp.tail(1).text == "bcd" and with_lp.tail(2).text == "d"     # its tokens spell the text
    lp_bytes = [["<0xC3>", -0.1, [], 0], ["é", -0.2, [], 6], ["d", -0.3, [], 7]]
    assert decode_event(old_encode_tok("q", 3, [1, 2, 3], "éd", 1, 0, lp_bytes)).tail(1) is None
    bad = TokEvent("q", 2, [1, 2], "abc", 1, 0, None, 0, [1, 1])               # lengths that do not add up
    assert bad.tail(1) is None


def test_a_real_detokenizer_with_multibyte_characters_cuts_at_every_token(tokenizer):
    """The worker's own streaming detokenizer on text whose characters span several byte tokens
    (their text is empty until the last byte comes): cut after any token, an event gives exactly
    the text the detokenizer released after it."""
    from worker.engine.detokenize import IncrementalDetokenizer
    text = "naïve café — 日本語の文字 🎉🚀 ok…"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ([], ["文字 "]):
        detok = IncrementalDetokenizer(tokenizer, [], stop)
        released = [detok.add(t) for t in ids]
        released[-1] += detok.finish()
        assert any(r == "" for r in released)       # some tokens released nothing (held-back bytes)
        ev = _built([_out(r, [t]) for r, t in zip(released, ids)])
        assert ev.text == "".join(released)
        back = decode_event(ev.encode())
        for after in range(1, len(ids)):
            assert back.tail(after).text == "".join(released[after:]), (stop, after)

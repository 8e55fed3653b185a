"""gateway.openai.response_events: the Responses API's events are a pure function of the output
text and its end, whatever pieces the text arrives in, in OpenAI's order and shapes."""

from __future__ import annotations

import json

import pytest

from gateway.openai.response_events import PIECE_CHARS, ResponseEvents, TextPieces

BASE = {"id": "resp_" + "ab" * 16, "object": "response", "created_at": 1, "model": "m", "background": False}
TEXT = "Hello there, this is text with averyveryverylongwordthatgoesonandonandon\nand more."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def run(text: str, cut: int, reason: str = "stop", *, mode: str | None = None, base: dict = BASE,
        **finish) -> list[dict]:
    ev = ResponseEvents(base, tool_mode=mode)
    out = ev.start()
    for i in range(0, len(text), cut):
        out += ev.text(text[i:i + cut])
    return out + ev.finish(reason, **finish)


@pytest.mark.parametrize("cut", [1, 2, 5, 13, 1000])
def test_pieces_depend_on_the_text_only(cut):
    pieces = TextPieces()
    out = []
    for i in range(0, len(TEXT), cut):
        out += pieces.feed(TEXT[i:i + cut])
    out += pieces.finish()
    assert "".join(out) == TEXT
    whole = TextPieces()
    assert out == whole.feed(TEXT) + whole.finish()
    assert all(len(p) <= PIECE_CHARS for p in out)


@pytest.mark.parametrize("mode,text", [(None, TEXT), ("forced", CALL),
                                       ("auto", f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>")])
def test_the_events_are_the_same_for_any_chunking(mode, text):
    runs = [run(text, cut, mode=mode, prompt_tokens=3, completion_tokens=9) for cut in (1, 3, 7, 1000)]
    assert all(r == runs[0] for r in runs)
    assert [e["sequence_number"] for e in runs[0]] == list(range(len(runs[0])))


def test_a_text_answer_in_openais_order():
    events = run("Hi there", 1, prompt_tokens=4, completion_tokens=2, cached_tokens=3)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    msg = events[-1]["response"]["output"][0]
    assert msg == {"id": f"msg_{'ab' * 16}_0", "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}]}
    assert events[-1]["response"]["usage"] == {
        "input_tokens": 4, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    assert [e["delta"] for e in events if "delta" in e] == ["H", "i ", "there"]    # the first token not held


def test_calls_between_text_become_items():
    text = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + \
           '{"name": "get_time", "arguments": {}}\n</tool_call>'
    events = run(text, 4, mode="auto")
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["message", "function_call", "function_call"]
    assert out[0]["content"][0]["text"] == "Let me look.\n"
    assert [(o["name"], json.loads(o["arguments"]), o["call_id"]) for o in out[1:]] == [
        ("get_weather", {"city": "Paris"}, f"call_{'ab' * 16}_0"), ("get_time", {}, f"call_{'ab' * 16}_1")]
    for i, item in enumerate(out[1:], 1):
        args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                       and e["output_index"] == i)
        done = next(e for e in events
                    if e["type"] == "response.function_call_arguments.done" and e["output_index"] == i)
        assert args == done["arguments"] == item["arguments"]


def test_incomplete_cancelled_failed_and_background():
    assert run("abc", 1, "length")[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    last = run("abc", 1, "length")[-1]
    assert last["type"] == "response.incomplete" and last["response"]["output"][0]["status"] == "incomplete"
    last = run("abc", 1, "cancelled")[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled"
    last = run("", 1, "error", error={"code": "output_lost", "message": "gone"})[-1]
    assert last["type"] == "response.failed" and last["response"]["error"] == {"code": "output_lost", "message": "gone"}
    first = run("a", 1, base={**BASE, "background": True})[0]
    assert first["response"]["status"] == "queued"


def test_logprobs_go_with_the_done_text():
    ev = ResponseEvents(BASE, logprobs=True)
    ev.start()
    entries = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    deltas = ev.text("Hi ", entries)
    events = ev.finish("stop")
    assert all(e["logprobs"] == [] for e in deltas if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == entries == events[-1]["response"]["output"][0]["content"][0]["logprobs"]

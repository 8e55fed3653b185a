"""gateway.openai.tool_calls: calls read out of streamed text, however the text is cut into pieces."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_calls import ToolCallParser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 2}, "note": "a}b"}}'
ARGS = '{"city": "Paris", "days": {"n": 2}, "note": "a}b"}'


def run(mode: str, text: str, cut: int) -> tuple[str, list[dict], list[dict]]:
    """Feed `text` in pieces of `cut` characters; returns (content, deltas, calls)."""
    p = ToolCallParser(mode)
    content, deltas = "", []
    for i in range(0, len(text), cut):
        c, d = p.feed(text[i:i + cut])
        content += c
        deltas += d
    c, d = p.finish()
    return content + c, deltas + d, p.tool_calls()


def merged(deltas: list[dict]) -> dict[int, dict]:
    """What a client accumulates from the deltas (the openai SDK's way), checking their order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert "name" not in d["function"] and "id" not in d
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_forced_call(cut):
    content, deltas, calls = run("forced", CALL, cut)
    assert content == "" and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ARGS}
    assert merged(deltas) == {0: {"id": calls[0]["id"], "name": "get_weather", "arguments": ARGS}}
    if cut == 1:
        assert len(deltas) > 5          # the arguments went out in pieces, as they came


@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_hermes_calls_between_text(cut):
    text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" \
           '{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, deltas, calls = run("auto", text, cut)
    assert content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [json.loads(ARGS), {}]
    assert {i: c["arguments"] for i, c in merged(deltas).items()} == {0: ARGS, 1: "{}"}


@pytest.mark.parametrize("cut", [1, 5, 1000])
def test_text_without_calls_is_content(cut):
    text = "Use <b>bold</b> and a <tool_ tag that is not one, or <tool_call>not json</tool_call> at all <tool"
    content, deltas, calls = run("auto", text, cut)
    assert content == text and deltas == [] and calls == []


def test_a_call_cut_short_keeps_what_came():
    content, deltas, calls = run("forced", '{"name": "f", "arguments": {"a": [1, 2', 3)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, 2'}
    content, deltas, calls = run("forced", '{"na', 1)
    assert calls == [] and content == '{"na'

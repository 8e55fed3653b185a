"""Logprobs end to end (issue 28 item 2): the official `openai` package (chat and completions,
streamed and not), raw SSE, the WebSocket `generate` option and its typed errors, and a stream
dropped mid-answer and resumed with Last-Event-ID that gets exactly the same logprobs.

Real Redis, in-process gateways, a tiny-model worker process (SmolLM2's real tokenizer), greedy
decoding so two runs of one request give the same tokens.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.settings import GatewaySettings
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import parse_client_message, parse_server_message
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import gateway_in_process, prefix_with_worker
from tests.test_openai_api import sse_dropped_after, sse_events

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PROMPT = "Once upon a time"
TOL = 1e-5


@pytest.fixture(scope="module")
def lp_stack(redis_server, tiny_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("lp-logs"),
                            name="w-logprobs") as prefix:
        yield prefix


def settings(redis_server, prefix, **kw) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, stream_prefix=prefix, heartbeat_s=0, ping_timeout_s=0,
                           resume_grace_s=10, **kw)


def oai(gw) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=60)


def same(a: list[dict], b: list[dict]) -> bool:
    """Two lists of chat logprob entries: same tokens and bytes, logprobs equal to TOL."""
    def key(e):
        return e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]

    def values(e):
        return [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]
    return len(a) == len(b) and all(key(x) == key(y) and all(abs(p - q) < TOL for p, q in zip(values(x), values(y)))
                                    for x, y in zip(a, b))


def check_chat_entries(content: list[dict], k: int) -> None:
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
        top = e["top_logprobs"]
        assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        if k:   # greedy: the sampled token is the most likely one
            assert top[0]["token"] == e["token"] and top[0]["logprob"] == e["logprob"]


async def test_chat_logprobs_through_the_openai_package_streamed_and_not(redis_server, lp_stack):
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw:
        client = oai(gw)
        args = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        plain = await client.chat.completions.create(**args)
        assert plain.choices[0].logprobs is None
        full = await client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
        assert full.choices[0].message.content == plain.choices[0].message.content
        lp = full.choices[0].logprobs.model_dump()
        assert lp["refusal"] is None and len(lp["content"]) == full.usage.completion_tokens
        check_chat_entries(lp["content"], 3)
        # streamed: the chunks' entries, in order, are the whole answer's
        stream = await client.chat.completions.create(**args, logprobs=True, top_logprobs=3, stream=True,
                                                      stream_options={"include_usage": True})
        streamed, text = [], ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs is not None:
                    streamed += [e.model_dump() for e in choice.logprobs.content]
        assert text == plain.choices[0].message.content
        assert same(streamed, lp["content"])
        # logprobs without alternatives
        bare = await client.chat.completions.create(**args, logprobs=True)
        check_chat_entries(bare.choices[0].logprobs.model_dump()["content"], 0)
        assert [e.logprob for e in bare.choices[0].logprobs.content] == [e["logprob"] for e in lp["content"]]


async def test_completions_logprobs_in_the_legacy_shape_streamed_and_not(redis_server, lp_stack):
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw:
        client = oai(gw)
        args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
        full = await client.completions.create(**args, logprobs=2)
        lp = full.choices[0].logprobs
        n = full.usage.completion_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        offset = 0
        for token, logprob, top, text_offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
            assert text_offset == offset
            offset += len(token)
            assert len(top) in (2, 3) and top[token] == logprob      # the sampled token is always there
            assert max(top.values()) == logprob                      # greedy: the most likely one
        zero = (await client.completions.create(**args, logprobs=0)).choices[0].logprobs
        assert zero.tokens == lp.tokens and all(list(t) == [tok] for t, tok in zip(zero.top_logprobs, zero.tokens))
        stream = await client.completions.create(**args, logprobs=2, stream=True)
        parts = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs is not None]
        assert sum((p.tokens for p in parts), []) == lp.tokens
        assert sum((p.text_offset for p in parts), []) == lp.text_offset
        assert all(abs(a - b) < TOL for a, b in zip(sum((p.token_logprobs for p in parts), []), lp.token_logprobs))


async def test_raw_sse_chunks_carry_logprobs_only_with_tokens(redis_server, lp_stack):
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True,
                "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(gw.base + "/v1/chat/completions", json=body)
        assert resp.status_code == 200
        events = [json.loads(d) for _, d in sse_events(resp.text.split("\n")) if d != "[DONE]"]
        role, *middle, finish, usage = events
        assert role["choices"][0]["delta"]["role"] == "assistant" and role["choices"][0]["logprobs"] is None
        assert finish["choices"][0]["finish_reason"] and finish["choices"][0]["logprobs"] is None
        entries = []
        for ev in middle:
            lp = ev["choices"][0]["logprobs"]
            assert set(lp) == {"content", "refusal"} and lp["refusal"] is None and lp["content"]
            entries += lp["content"]
        assert len(entries) == usage["usage"]["completion_tokens"]
        check_chat_entries(entries, 1)


async def test_openai_refuses_out_of_range_logprobs(redis_server, lp_stack):
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw:
        client = oai(gw)
        chat = client.chat.completions.create
        for call, param in [(chat(model=MODEL, messages=CHAT, top_logprobs=2), "top_logprobs"),
                            (chat(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
                            (client.completions.create(model=MODEL, prompt=PROMPT, logprobs=6), "logprobs")]:
            with pytest.raises(openai.BadRequestError) as info:
                await call
            assert info.value.body["param"] == param and info.value.body["code"] == "invalid_request"


async def test_websocket_generate_logprobs_aligned_with_each_chunks_tokens(redis_server, lp_stack):
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw:
        ws = await GatewayClient.connect(gw.ws_url)
        try:
            await ws.send(type="generate", id="a", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=True,
                          top_logprobs=2)
            await ws.send(type="generate", id="b", prompt=PROMPT, max_tokens=20, temperature=0)
            chunks_a, done_a = await ws.until_done("a")
            chunks_b, _ = await ws.until_done("b")
        finally:
            await ws.close()
        assert done_a["finish_reason"] in ("stop", "length")
        assert all("logprobs" not in c for c in chunks_b)
        assert "".join(c["text"] for c in chunks_a) == "".join(c["text"] for c in chunks_b)
        offset = 0
        for c in chunks_a:
            parse_server_message(c)          # the documented schema
            assert len(c["logprobs"]) == c["tokens"]
            for e in c["logprobs"]:
                assert e["text_offset"] == offset and len(e["top_logprobs"]) == 2
                offset += len(e["token"])
        assert sum(c["tokens"] for c in chunks_a) == done_a["usage"]["completion_tokens"]


@pytest.mark.parametrize("fields,why", [
    ({"top_logprobs": 2}, "needs 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
    ({"logprobs": True, "top_logprobs": -1}, "greater than or equal to 0"),
    ({"logprobs": "yes"}, "valid boolean"),
    ({"logprobs": 1}, "valid boolean"),
    ({"logprobs": True, "top_logprobs": 2.0}, "valid integer"),
])
def test_generate_logprob_fields_are_strict(fields, why):
    with pytest.raises(ProtocolError) as info:
        parse_client_message({"type": "generate", "id": "x", "prompt": "p", **fields})
    assert info.value.code is ErrorCode.INVALID_REQUEST and why in info.value.message, info.value.message


async def test_a_resumed_sse_stream_gets_exactly_the_same_logprobs(redis_server, lp_stack):
    """Dropped mid-answer on one replica, resumed on another with Last-Event-ID: the logprobs of
    what came before and after the drop are the uninterrupted answer's, token for token."""
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw_a, \
            gateway_in_process(settings(redis_server, lp_stack)) as gw_b:
        args = dict(model=MODEL, messages=CHAT, max_tokens=200, temperature=0, logprobs=True, top_logprobs=2)
        reference = (await oai(gw_b).chat.completions.create(**args)).choices[0].logprobs.model_dump()["content"]
        async with httpx.AsyncClient(timeout=60) as http:     # dropped mid-answer
            first = await sse_dropped_after(http, gw_a.base + "/v1/chat/completions",
                                            {**args, "stream": True, "resumable": True}, 5)
        oai_id, last_id = json.loads(first[0][1])["id"], first[-1][0]
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.get(gw_b.base + f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(last_id)})
        assert resp.status_code == 200, resp.text
        rest = sse_events(resp.text.split("\n"))
        assert rest[-1][1] == "[DONE]"

        def entries(events):
            out = []
            for _, data in events:
                if data != "[DONE]":
                    for choice in json.loads(data).get("choices", []):
                        out += (choice.get("logprobs") or {}).get("content") or []
            return out
        before, after = entries(first), entries(rest)
        assert before and after
        assert same(before + after, reference)


async def test_a_websocket_resume_gets_exactly_the_same_logprobs(redis_server, lp_stack):
    """A socket dropped after a few chunks, the request resumed from its last seq on another
    replica: the chunks' entries before and after equal an uninterrupted request's."""
    async with gateway_in_process(settings(redis_server, lp_stack)) as gw_a, \
            gateway_in_process(settings(redis_server, lp_stack)) as gw_b:
        fields = dict(prompt=PROMPT, max_tokens=200, temperature=0, logprobs=True, top_logprobs=2)
        ws = await GatewayClient.connect(gw_b.ws_url)
        try:
            await ws.send(type="generate", id="ref", **fields)
            ref_chunks, _ = await ws.until_done("ref")
        finally:
            await ws.close()
        ws = await GatewayClient.connect(gw_a.ws_url)
        try:
            await ws.send(type="generate", id="r", **fields)
            accepted = await ws.recv("r")
            assert accepted["type"] == "accepted"
            before = [await ws.recv("r") for _ in range(3)]
            assert all(c["type"] == "chunk" for c in before)
        finally:
            await ws.close()                        # dropped mid-answer
        ws = await GatewayClient.connect(gw_b.ws_url)
        try:
            await ws.send(type="resume", id="r", last_seq=before[-1]["seq"], request_id=accepted["request_id"])
            after, done = await ws.until_done("r")
        finally:
            await ws.close()
        assert done["finish_reason"] in ("stop", "length") and after

        def entries(chunks):
            return [e for c in chunks for e in c["logprobs"]]
        assert same(entries(before) + entries(after), entries(ref_chunks))
        assert [e["text_offset"] for e in entries(before) + entries(after)] == \
            [e["text_offset"] for e in entries(ref_chunks)]

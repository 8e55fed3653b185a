"""The OpenAI-compatible HTTP API, driven by the official `openai` package (AsyncOpenAI with
`base_url`) against the real stack: Redis, in-process gateways, a worker process (tiny model).

Streaming and non-streaming chat and completions, stop, seed determinism, typed OpenAI-shaped
errors, limits, a disconnect that cancels (measured: the worker stops stepping) and an SSE
stream dropped mid-answer and resumed on another replica with `Last-Event-ID`, whose text is
exactly the uninterrupted greedy answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.settings import GatewaySettings
from shared.streams import Keys
from llm_stream_client import StreamClient
from tests.gateway_client import eventually
from tests.stack_fixtures import gateway_in_process, prefix_with_worker, start_gateway
from tests.worker_redis import read_events, worker_info

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def oai_stack(redis_server, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    env = {"WORKER_HEARTBEAT_S": 0.5}      # its registry entry (running), which the cancel test watches
    with prefix_with_worker(redis_server.url, tiny_model_dir, logs, name="w-oai", env=env) as prefix:
        yield prefix


def settings(redis_server, prefix, **kw) -> GatewaySettings:
    kw.setdefault("resume_grace_s", 10)
    return GatewaySettings(redis_url=redis_server.url, stream_prefix=prefix, heartbeat_s=5, **kw)


def oai(gw, key: str = "none") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0, timeout=60)


async def test_chat_and_completions_streaming_and_not(redis_server, oai_stack):
    async with gateway_in_process(settings(redis_server, oai_stack)) as gw:
        client = oai(gw)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        async with StreamClient(gw.ws_url) as ws:     # the WebSocket path as the reference
            ref_chat = await ws.generate(messages=CHAT, max_tokens=40, temperature=0).collect()
            ref_text = await ws.generate("Once upon a time", max_tokens=30, temperature=0).collect()

        full = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
        assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
        assert full.choices[0].message.content == ref_chat and full.choices[0].message.role == "assistant"
        assert full.choices[0].finish_reason in ("stop", "length")
        assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=40,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_chat
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [full.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert len({c.id for c in chunks}) == 1

        text = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
        assert text.object == "text_completion" and text.choices[0].text == ref_text
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30,
                                                 temperature=0, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == ref_text


async def test_stop_and_seed(redis_server, oai_stack):
    async with gateway_in_process(settings(redis_server, oai_stack)) as gw:
        client = oai(gw)
        base = (await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40,
                                                temperature=0)).choices[0].text
        stop = base[len(base) // 2:len(base) // 2 + 4]
        assert stop.strip(), base
        stopped = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40,
                                                  temperature=0, stop=stop)
        assert stopped.choices[0].text == base[:base.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"

        async def sample(seed):
            r = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=1.0,
                                                     seed=seed)
            return r.choices[0].message.content

        a, b, c = await sample(7), await sample(7), await sample(8)
        assert a == b and a != c


async def test_errors_have_openai_shape_and_status(redis_server, oai_stack):
    key = "sk-oai-test"
    keys = f"tester:{hashlib.sha256(key.encode()).hexdigest()}"
    async with gateway_in_process(settings(redis_server, oai_stack, api_keys=keys, max_tokens_cap=64,
                                           per_key_concurrency=1)) as gw:
        with pytest.raises(openai.AuthenticationError):
            await oai(gw, "wrong").models.list()
        client = oai(gw, key)
        cases = [
            (dict(n=99), openai.BadRequestError, "invalid_request", "n"),
            (dict(functions=[{"name": "f", "parameters": {}}]),
             openai.BadRequestError, "unsupported_parameter", "functions"),
            (dict(logprobs=True, top_logprobs=21), openai.BadRequestError, "invalid_request", "top_logprobs"),
            (dict(extra_body={"frobnicate": 1}), openai.BadRequestError, "unsupported_parameter", "frobnicate"),
            (dict(max_tokens=65), openai.BadRequestError, "max_tokens_too_large", None),
            (dict(temperature=3.0), openai.BadRequestError, "invalid_request", None),
            (dict(model="gpt-4o"), openai.NotFoundError, "model_not_found", "model"),
        ]
        for extra, exc_type, code, param in cases:
            args = dict(model=MODEL, messages=CHAT, max_tokens=8) | extra
            with pytest.raises(exc_type) as info:
                await client.chat.completions.create(**args)
            err = info.value.body
            assert err["code"] == code and err["type"] and err["message"], (extra, err)
            if param:
                assert err["param"] == param, (extra, err)
        # per-key concurrency (1): a second request while one streams gets 429
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, stream=True)
        first = await stream.__anext__()
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert info.value.body["code"] == "concurrency_limit"
        rest = [c async for c in stream]
        assert first.choices[0].delta.role == "assistant" and rest


async def test_client_disconnect_cancels_and_the_worker_stops(redis_server, redis_client, oai_stack):
    keys = Keys(oai_stack)
    async with gateway_in_process(settings(redis_server, oai_stack)) as gw:
        client = oai(gw)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2000, temperature=0,
                                                      stream=True)
        got = 0
        async for chunk in stream:
            got += 1
            if got >= 5:
                break
        await stream.close()                      # the HTTP connection goes away
        closed_at = time.monotonic()
        # the worker's record of the request ends cancelled, far short of its 2000 tokens ...
        rid = stream.response.headers["x-request-id"]
        events = await read_events(redis_client, keys, rid, timeout=20)
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "cancelled", events[-1]
        assert events[-1]["usage"]["completion_tokens"] < 2000
        # ... and it runs nothing any more (its registry entry, refreshed every heartbeat)
        async def idle() -> bool:
            return (await worker_info(redis_client, keys, "w-oai")).get("running") == "0"
        assert await eventually(idle, timeout=10), "the worker kept generating after the client disconnected"
        settled = time.monotonic() - closed_at
        print(f"disconnect -> worker idle within {settled:.1f}s "
              f"({events[-1]['usage']['completion_tokens']} of 2000 tokens generated)")


def sse_events(lines: list[str]) -> list[tuple[int | None, str]]:
    events, eid, data = [], None, []
    for line in lines:
        if line == "":
            if data:
                events.append((eid, "\n".join(data)))
            eid, data = None, []
        elif line.startswith("id:"):
            eid = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events


async def sse_dropped_after(http, url: str, body: dict, events: int, **kwargs) -> list[tuple[int | None, str]]:
    """POST a streaming request and drop the connection once `events` SSE events have come; those
    events."""
    lines: list[str] = []
    async with http.stream("POST", url, json=body, **kwargs) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            lines.append(line)
            if line == "" and len(sse_events(lines)) >= events:
                break
    return sse_events(lines)


def contents(events: list[tuple[int | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


async def test_sse_dropped_mid_answer_resumes_on_another_replica_with_last_event_id(redis_server, redis_client,
                                                                                     oai_stack):
    owner, other = "sk-oai-owner", "sk-oai-other"
    api_keys = ",".join(f"{name}:{hashlib.sha256(k.encode()).hexdigest()}" for name, k in (("a", owner), ("b", other)))
    auth = {"Authorization": f"Bearer {owner}"}
    async with gateway_in_process(settings(redis_server, oai_stack, api_keys=api_keys)) as gw_a, \
            gateway_in_process(settings(redis_server, oai_stack, api_keys=api_keys)) as gw_b:
        reference = (await oai(gw_b, owner).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300,
                                                                    temperature=0)).choices[0].message.content
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 300, "temperature": 0, "stream": True,
                "resumable": True}
        async with httpx.AsyncClient(timeout=60) as http:            # dropped mid-answer
            first = await sse_dropped_after(http, gw_a.base + "/v1/chat/completions", body, 6, headers=auth)
        oai_id = json.loads(first[0][1])["id"]
        last_id = first[-1][0]
        assert 0 < last_id and "[DONE]" not in [d for _, d in first]
        rid = oai_id.split("-", 1)[1]

        async def parked() -> bool:     # gw_a saw the drop and parked the request for a resume
            members = await redis_client.zrange(Keys(oai_stack).orphans, 0, -1)
            return any(m.decode().startswith(rid + "|") for m in members)
        assert await eventually(parked, timeout=10)
        async with httpx.AsyncClient(timeout=60) as http:
            # a stream of another key, or an unknown id, cannot be resumed
            for oai_id_, key in ((oai_id, other), ("chatcmpl-nope", owner)):
                resp = await http.get(gw_b.base + f"/v1/streams/{oai_id_}",
                                      headers={"Last-Event-ID": str(last_id), "Authorization": f"Bearer {key}"})
                assert resp.status_code == 404 and resp.json()["error"]["code"] == "resume_expired", resp.text
            resp = await http.get(gw_b.base + f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(last_id), **auth})
            assert resp.status_code == 200, resp.text
            rest = sse_events(resp.text.split("\n"))
        assert rest[-1][1] == "[DONE]"
        ids = [eid for eid, _ in rest if eid is not None]
        text_ids = [eid for eid, data in rest if contents([(eid, data)])]    # the final chunk repeats the last seq
        assert ids and ids[0] > last_id and ids == sorted(ids), (last_id, ids)
        assert text_ids and text_ids == sorted(set(text_ids)), text_ids       # every seq after last_id once
        head = contents(first)
        assert reference.startswith(head) and contents(rest) == reference[len(head):]   # the whole remainder


async def test_draining_gateway_ends_the_sse_stream_resumably(redis_server, oai_stack):
    """A gateway that drains (SIGTERM) tells an SSE client `shutting_down` in a last error event;
    the client resumes on another replica with Last-Event-ID and gets the exact rest."""
    async with gateway_in_process(settings(redis_server, oai_stack)) as gw_a, \
            gateway_in_process(settings(redis_server, oai_stack)) as gw_b:
        reference = (await oai(gw_b).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300,
                                                        temperature=0)).choices[0].text
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True,
                "priority": "batch"}                  # not resumable: a drain parks it all the same
        lines: list[str] = []
        drain = None
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", gw_a.base + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    lines.append(line)
                    if drain is None and line == "" and len(sse_events(lines)) >= 3:
                        drain = asyncio.create_task(gw_a.probe.drain())
        await drain
        events = sse_events(lines)
        assert json.loads(events[-1][1])["error"]["code"] == "shutting_down", events[-1]
        assert "[DONE]" not in [d for _, d in events]
        texts = [(eid, json.loads(d)["choices"][0]["text"]) for eid, d in events if "choices" in json.loads(d)]
        oai_id = json.loads(events[0][1])["id"]
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.get(gw_b.base + f"/v1/streams/{oai_id}?last_event_id={texts[-1][0]}")
            assert resp.status_code == 200, resp.text
        rest = [json.loads(d)["choices"][0]["text"] for _, d in sse_events(resp.text.split("\n")) if d != "[DONE]"]
        assert "".join(t for _, t in texts) + "".join(rest) == reference


async def test_non_streamed_answer_longer_than_a_heartbeat_keeps_the_gateway_responsive(redis_server, oai_stack,
                                                                                       tmp_path):
    """Regression: the Sender's heartbeat on a non-streamed answer writes nothing; it must still
    count as a send, or the heartbeat fires in a loop that never yields and freezes the gateway.
    (A subprocess gateway, so a frozen one fails this test instead of freezing it.)"""
    gw, base = start_gateway(redis_server.url, oai_stack, tmp_path, name="gw-hb", env={"HEARTBEAT_S": 0.2})
    try:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        answer = asyncio.create_task(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                               max_tokens=400, temperature=0))
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(5):
                await asyncio.sleep(0.3)
                assert (await http.get(base + "/healthz")).status_code == 200
        reply = await asyncio.wait_for(answer, 120)
        assert reply.usage.completion_tokens > 0
    finally:
        gw.stop()

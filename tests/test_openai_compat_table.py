"""docs/clients.md's OpenAI compatibility table is true (issue 28 item 5): this test parses the
table and, for every item in backticks in its first column, sends a request through the real API
(the official `openai` package, or raw HTTP where no SDK method exists) and classifies what
happened — `yes` (it works as OpenAI documents), `ignored` (accepted, the answer unchanged),
`refused` (400 `unsupported_parameter` naming it), `no` (404 `not_found`) — against the row. Every
"accepted: `name: value`" in a refused row's notes is sent too and must be accepted, unchanged.

It also binds the table to the code: each field the gateway ignores (`IGNORED`) must be in an
`ignored` row, each one it refuses unless neutral in a `refused` row; and a table item this file
has no probe for, or a probe no row asks for, fails: the table cannot grow or shrink unchecked.

Real Redis, an in-process gateway, a tiny-model worker (SmolLM2's real tokenizer).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from gateway.openai.schema import _CHAT_NEUTRAL, _COMMON_NEUTRAL, _COMPLETION_NEUTRAL, IGNORED
from shared.streams import Keys
from tests.gateway_client import eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker
from tests.test_openai_api import sse_dropped_after, sse_events
from tests.worker_redis import read_events

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "clients.md"
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PROMPT = "Once upon a time"
MAX_PROMPT_TOKENS = 350   # room for a prompt that lists tools; the context_too_long probe sends 400+
STATUSES = {"yes", "ignored", "refused", "no"}


# ---------------------------------------------------------------- the table

@dataclass
class Row:
    feature: str
    status: str
    notes: str
    items: list[str]
    accepted: list[tuple[str, Any]] = field(default_factory=list)    # (item, value) from "accepted: `x: v`"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def compatibility_table(text: str) -> list[Row]:
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if _cells(line) == ["feature", "supported", "notes"])
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        feature, supported, notes = _cells(line)
        items = re.findall(r"`([^`]+)`", feature)
        assert items, f"a row names what it is about in backticks: {line}"
        status = supported.split()[0].lower()
        assert status in STATUSES, f"supported must be one of {sorted(STATUSES)}: {line}"
        row = Row(feature, status, notes, items)
        if "accepted:" in notes:
            for span in re.findall(r"`([^`]+)`", notes.split("accepted:", 1)[1]):
                name, _, value = span.partition(": ")
                assert name in items and value, f"'accepted: `item: json`' names an item of its row: {line}"
                row.accepted.append((name, json.loads(value)))
        rows.append(row)
    return rows


def test_the_table_parses_and_names_what_the_code_ignores_and_refuses():
    rows = compatibility_table(DOC.read_text())
    by_status = {s: {i for r in rows if r.status == s for i in r.items} for s in STATUSES}
    assert set(IGNORED) <= by_status["ignored"], set(IGNORED) - by_status["ignored"]
    neutral = {*_COMMON_NEUTRAL, *_CHAT_NEUTRAL, *_COMPLETION_NEUTRAL}
    assert neutral <= by_status["refused"], neutral - by_status["refused"]
    items = [i for r in rows for i in r.items]
    assert len(items) == len(set(items)), "each item is in one row"
    assert set(items) == set(PROBES), (f"items without a probe: {set(items) - set(PROBES)}; "
                                       f"probes without a row: {set(PROBES) - set(items)}")
    for row in rows:       # a row probed elsewhere says by which test
        for item in row.items:
            if item in ELSEWHERE:
                assert ELSEWHERE[item] in row.notes, f"the row of `{item}` names its test {ELSEWHERE[item]}"


# ---------------------------------------------------------------- the probes

class Ctx:
    def __init__(self, gw, model_dir=None):
        self.gw = gw
        self.model_dir = model_dir
        self._engine = None
        self.client = AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=60)
        self.http = httpx.AsyncClient(base_url=gw.base, timeout=60)
        self.chat_text = ""
        self.text = ""
        self.memo: dict[Callable, str] = {}

    async def setup(self) -> None:
        self.chat_text = (await self.chat()).choices[0].message.content
        self.text = (await self.completion()).choices[0].text

    async def chat(self, **fields):
        return await self.client.chat.completions.create(
            **{"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, **fields})

    async def completion(self, **fields):
        return await self.client.completions.create(
            **{"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields})

    def engine(self):
        """(engine, tokenizer): the worker's engine on the stack's model, in this process."""
        from tests.test_faults_worker import reference_engine
        if self._engine is None:
            self._engine = reference_engine(self.model_dir)
        return self._engine

    def reference(self, chat: bool = True, **params) -> tuple[str, list[int], str]:
        """(text, token ids, finish_reason) of the worker's own engine, run here on the same tiny
        model, for CHAT (or PROMPT) with these sampling parameters (greedy unless they say)."""
        from shared.sampling import SamplingParams
        from worker.engine import EngineRequest, build_prompt_ids
        engine, tokenizer = self.engine()
        ids = build_prompt_ids(tokenizer, None if chat else PROMPT, CHAT if chat else None)
        engine.add(EngineRequest("ref", ids, SamplingParams(**{"temperature": 0.0, **params})))
        outs = []
        while engine.has_work:
            outs += engine.step()
        return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1].finish_reason


def classify_400(exc: openai.BadRequestError, param: str) -> str:
    body = exc.body or {}
    assert body.get("code") == "unsupported_parameter" and body.get("param") == param, body
    return "refused"


def param(name: str, value: Any, *, endpoint: str = "chat") -> Callable[[Ctx, Any], Awaitable[str]]:
    """A body field: refused (400 naming it), or accepted — `ignored` if the answer is the same."""
    async def probe(ctx: Ctx, v: Any = value) -> str:
        body = {name.split(": ")[0]: v}
        try:
            if endpoint == "chat":
                got = (await ctx.chat(extra_body=body)).choices[0].message.content
                return "ignored" if got == ctx.chat_text else f"changed: {got!r}"
            got = (await ctx.completion(extra_body=body)).choices[0].text
            return "ignored" if got == ctx.text else f"changed: {got!r}"
        except openai.BadRequestError as exc:
            return classify_400(exc, name)
    return probe


ANSWER = {"role": "assistant", "content": "The lighthouse keeper lit the lamp."}


def message_field(name: str, value: Any, *, role: str = "assistant") -> Callable[[Ctx, Any], Awaitable[str]]:
    """A field of a message in the conversation (the assistant's answer, or the user's turn)."""
    async def probe(ctx: Ctx, v: Any = value) -> str:
        def convo(extra: dict) -> list[dict]:
            if role == "assistant":
                return [*CHAT, {**ANSWER, **extra}, {"role": "user", "content": "And then?"}]
            return [{**CHAT[0], **extra}]
        index = 1 if role == "assistant" else 0
        without = (await ctx.chat(messages=convo({}))).choices[0].message.content
        try:
            got = (await ctx.chat(messages=convo({name: v}))).choices[0].message.content
        except openai.BadRequestError as exc:
            return classify_400(exc, f"messages[{index}].{name}")
        return "ignored" if got == without else f"changed: {got!r}"
    return probe


def role(name: str) -> Callable[[Ctx, Any], Awaitable[str]]:
    async def probe(ctx: Ctx, _=None) -> str:
        message = {"role": name, "content": "Be brief."}
        try:
            got = (await ctx.chat(messages=[message, *CHAT] if name != "user" else CHAT)).choices[0].message.content
        except openai.BadRequestError as exc:
            return classify_400(exc, "messages[0].role")
        if name == "developer":     # the same as a system message
            system = (await ctx.chat(messages=[{**message, "role": "system"}, *CHAT])).choices[0].message.content
            assert got == system
        return "yes"
    return probe


def part(kind: str) -> Callable[[Ctx, Any], Awaitable[str]]:
    parts = {"text": {"type": "text", "text": CHAT[0]["content"]},
             "image_url": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
             "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
             "file": {"type": "file", "file": {"file_id": "file-1"}}}

    async def probe(ctx: Ctx, _=None) -> str:
        try:
            got = await ctx.chat(messages=[{"role": "user", "content": [parts[kind]]}])
        except openai.BadRequestError as exc:
            return classify_400(exc, "messages[0].content")
        assert got.choices[0].message.content == ctx.chat_text     # the same text as a plain string
        return "yes"
    return probe


def route(path: str) -> Callable[[Ctx, Any], Awaitable[str]]:
    async def probe(ctx: Ctx, _=None) -> str:
        statuses = set()
        for method in ("GET", "POST"):
            resp = await ctx.http.request(method, path, json={"model": MODEL, "input": "hello"})
            statuses.add(resp.status_code)
            if resp.status_code == 404:
                assert resp.json()["error"]["code"] == "not_found", resp.text
        return "no" if statuses == {404} else f"served: {statuses}"
    return probe


# ---- the "yes" probes: each checks that the feature really does what OpenAI documents

async def p_chat(ctx: Ctx, _=None) -> str:
    r = await ctx.chat()
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    return "yes"


async def p_completions(ctx: Ctx, _=None) -> str:
    r = await ctx.completion()
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens
    return "yes"


async def p_models(ctx: Ctx, _=None) -> str:
    return "yes" if [m.id for m in (await ctx.client.models.list()).data] == [MODEL] else "no"


async def p_model_retrieve(ctx: Ctx, _=None) -> str:
    assert (await ctx.client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        await ctx.client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    return "yes"


async def p_model(ctx: Ctx, _=None) -> str:
    with pytest.raises(openai.NotFoundError) as info:
        await ctx.chat(model="gpt-4o")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    return "yes"


async def p_stream(ctx: Ctx, _=None) -> str:
    stream = await ctx.chat(stream=True)
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ctx.chat_text
    stream = await ctx.completion(stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == ctx.text
    return "yes"


async def p_include_usage(ctx: Ctx, _=None) -> str:
    full = await ctx.chat()
    chunks = [c async for c in await ctx.chat(stream=True, stream_options={"include_usage": True})]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    return "yes"


async def p_continuous_usage(ctx: Ctx, _=None) -> str:
    """vLLM's: with include_usage, every chunk carries the usage so far (guidellm counts by it)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c async for c in await ctx.chat(stream=True, stream_options=options)]
    last = chunks[-1].usage
    assert all(c.usage is not None for c in chunks if c.choices and c.choices[0].delta.content), chunks
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {last.prompt_tokens}
    assert max(c.usage.completion_tokens for c in chunks if c.usage) == last.completion_tokens
    return "yes"


async def p_ignore_eos(ctx: Ctx, _=None) -> str:
    """vLLM's: the answer runs to max_tokens (the engine never samples EOS)."""
    r = await ctx.completion(max_tokens=9, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
    return "yes"


async def p_cache_salt(ctx: Ctx, _=None) -> str:
    """vLLM's: the prefix-cache scope. A fresh salt hits nothing (not even what every other probe
    left cached for this key), the same salt again hits its own blocks, the answer is the same;
    a salt that is not a non-empty string is refused (tests/test_tenant_cache.py: across keys)."""
    salt = uuid.uuid4().hex
    first = await ctx.chat(extra_body={"cache_salt": salt})
    again = await ctx.chat(extra_body={"cache_salt": salt})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == again.choices[0].message.content == ctx.chat_text
    for bad in (7, ""):
        with pytest.raises(openai.BadRequestError) as info:
            await ctx.chat(extra_body={"cache_salt": bad})
        assert info.value.body["param"] == "cache_salt", info.value.body
    return "yes"


async def p_health(ctx: Ctx, _=None) -> str:
    for path in ("/health", "/v1/health"):
        r = await ctx.http.get(path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, (path, r.text)
    return "yes"


async def p_version(ctx: Ctx, _=None) -> str:
    assert isinstance((await ctx.http.get("/version")).json()["version"], str)
    return "yes"


async def p_tokenize(ctx: Ctx, _=None) -> str:
    """vLLM's: a chat's ids are those its chat completion runs (as many as its prompt_tokens)."""
    r = await ctx.http.post("/tokenize", json={"model": MODEL, "messages": CHAT, "return_token_strs": True})
    got = r.json()
    assert r.status_code == 200 and got["count"] == len(got["tokens"]) == len(got["token_strs"]), r.text
    assert got["max_model_len"] > 0 and got["count"] == (await ctx.chat()).usage.prompt_tokens
    plain = (await ctx.http.post("/tokenize", json={"prompt": PROMPT})).json()
    assert plain["token_strs"] is None and plain["count"] == (await ctx.completion()).usage.prompt_tokens
    refused = await ctx.http.post("/tokenize", json={"messages": CHAT, "chat_template": "{{ messages }}"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_parameter", refused.text
    return "yes"


async def p_detokenize(ctx: Ctx, _=None) -> str:
    ids = (await ctx.http.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    r = await ctx.http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}, r.text
    bad = await ctx.http.post("/detokenize", json={"tokens": [ids[0], 10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
    return "yes"


async def p_obfuscation(ctx: Ctx, _=None) -> str:
    try:
        stream = await ctx.chat(stream=True, stream_options={"include_obfuscation": True})
    except openai.BadRequestError as exc:
        return classify_400(exc, "stream_options.include_obfuscation")
    chunks = [c async for c in stream]
    same = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ctx.chat_text
    return "ignored" if same else "changed"


async def p_max_tokens(ctx: Ctx, _=None) -> str:
    r = await ctx.chat(max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", r
    with pytest.raises(openai.BadRequestError) as info:
        await ctx.chat(max_tokens=10 ** 6)
    assert info.value.body["code"] == "max_tokens_too_large"
    return "yes"


async def p_max_completion_tokens(ctx: Ctx, _=None) -> str:
    r = await ctx.chat(max_tokens=5, max_completion_tokens=2)         # the latter wins
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length", r
    return "yes"


async def sampled(ctx: Ctx, **fields) -> str:
    return (await ctx.chat(max_tokens=8, **fields)).choices[0].message.content


async def p_temperature(ctx: Ctx, _=None) -> str:
    greedy = await sampled(ctx, temperature=0)
    assert await sampled(ctx, temperature=0, seed=1) == await sampled(ctx, temperature=0, seed=2) == greedy
    assert await sampled(ctx, temperature=1.5, seed=1) != await sampled(ctx, temperature=1.5, seed=2)
    return "yes"


async def p_top_p(ctx: Ctx, _=None) -> str:
    greedy = await sampled(ctx, temperature=0)
    # a nucleus of one token is greedy whatever the temperature and seed
    assert await sampled(ctx, temperature=1.5, top_p=1e-6, seed=1) == greedy
    assert await sampled(ctx, temperature=1.5, top_p=1e-6, seed=2) == greedy
    return "yes"


async def p_seed(ctx: Ctx, _=None) -> str:
    a, b, c = [await sampled(ctx, temperature=1.0, seed=s) for s in (7, 7, 8)]
    assert a == b and a != c
    return "yes"


async def p_stop(ctx: Ctx, _=None) -> str:
    base = (await ctx.completion(max_tokens=30)).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 4]
    assert stop.strip(), base
    r = await ctx.completion(max_tokens=30, stop=[stop])
    assert r.choices[0].text == base[:base.index(stop)] and r.choices[0].finish_reason == "stop"
    return "yes"


async def p_finish_reason(ctx: Ctx, _=None) -> str:
    assert (await ctx.chat(max_tokens=2)).choices[0].finish_reason == "length"
    base = (await ctx.completion(max_tokens=30)).choices[0].text
    r = await ctx.completion(max_tokens=30, stop=base[10:14])
    assert r.choices[0].finish_reason == "stop"
    # cancelled: a non-resumable stream dropped, then resumed: an error, no finish_reason "cancelled"
    first = await sse_dropped_after(ctx.http, "/v1/chat/completions",
                                    {"model": MODEL, "messages": CHAT, "max_tokens": 2000, "stream": True}, 3)
    oai_id = json.loads(first[0][1])["id"]
    redis = aioredis.from_url(ctx.gw.settings.redis_url)
    try:        # the worker's `done: cancelled` is in the request's history
        await read_events(redis, Keys(ctx.gw.settings.stream_prefix), oai_id.split("-", 1)[1], timeout=10)
    finally:
        await redis.aclose()
    resp = await ctx.http.get(f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(first[-1][0])})
    rest = sse_events(resp.text.split("\n"))
    finishes = {c["finish_reason"] for _, d in rest if d != "[DONE]" for c in json.loads(d).get("choices", [])}
    assert finishes <= {None} and json.loads(rest[-2][1])["error"]["code"] == "request_cancelled", resp.text
    return "yes"


async def p_conversation_loop(ctx: Ctx, _=None) -> str:
    messages = list(CHAT)
    for turn in range(2):
        r = await ctx.chat(messages=messages)
        messages += [r.choices[0].message.model_dump(), {"role": "user", "content": f"More ({turn})"}]
    assert messages[1]["tool_calls"] is None and "annotations" in messages[1]
    stream = await ctx.chat(messages=messages, stream=True)
    assert [c async for c in stream]
    return "yes"


async def p_prompt_cache_key(ctx: Ctx, _=None) -> str:
    """Accepted and used for routing (tests/test_cache_routing.py shows where requests go); the
    answer is the same, and a key that is not a string is refused."""
    assert (await ctx.chat(extra_body={"prompt_cache_key": "conversation-7"})).choices[0].message.content == \
        ctx.chat_text
    with pytest.raises(openai.BadRequestError) as info:
        await ctx.chat(extra_body={"prompt_cache_key": 7})
    assert info.value.body["param"] == "prompt_cache_key"
    return "yes"


async def p_priority(ctx: Ctx, _=None) -> str:
    assert (await ctx.chat(extra_body={"priority": "batch"})).choices[0].message.content == ctx.chat_text
    with pytest.raises(openai.BadRequestError) as info:
        await ctx.chat(extra_body={"priority": "urgent"})
    assert info.value.body["param"] == "priority"
    return "yes"


async def p_resume(ctx: Ctx, _=None) -> str:
    reference = (await ctx.chat(max_tokens=40)).choices[0].message.content
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 40, "temperature": 0, "stream": True, "resumable": True}
    first = await sse_dropped_after(ctx.http, "/v1/chat/completions", body, 3)
    resp = await ctx.http.get(f"/v1/streams/{json.loads(first[0][1])['id']}",
                              headers={"Last-Event-ID": str(first[-1][0])})
    rest = sse_events(resp.text.split("\n"))
    text = "".join(c["delta"].get("content") or "" for _, d in first + rest if d != "[DONE]"
                   for c in json.loads(d)["choices"])
    assert rest[-1][1] == "[DONE]" and text == reference, (text, reference)
    return "yes"


async def p_idempotency(ctx: Ctx, _=None) -> str:
    key = uuid.uuid4().hex             # anonymous: the key is the secret, 128 bits
    a, b = [await ctx.chat(max_tokens=12, temperature=1.0, extra_headers={"Idempotency-Key": key})
            for _ in range(2)]
    assert a.id == b.id and a.choices[0].message.content == b.choices[0].message.content
    return "yes"


async def cancelled(ctx: Ctx) -> float:
    text = (await ctx.http.get("/metrics")).text
    match = re.search(r'^gateway_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def p_abort(ctx: Ctx, _=None) -> str:
    before = await cancelled(ctx)
    stream = await ctx.chat(max_tokens=2000, stream=True)
    await stream.__anext__()
    await stream.close()
    async def counted() -> bool:
        return await cancelled(ctx) == before + 1
    return "yes" if await eventually(counted, timeout=5, interval=0.05) else "not counted"


async def p_request_id(ctx: Ctx, _=None) -> str:
    r = await ctx.chat()
    assert r._request_id and r.id == f"chatcmpl-{r._request_id}"
    raw = await ctx.client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                                     stream=True)
    assert {c.id async for c in raw.parse()} == {f"chatcmpl-{raw.headers['x-request-id']}"}
    return "yes"


async def p_errors(ctx: Ctx, _=None) -> str:
    for call, kind, status in [(ctx.chat(n=99), openai.BadRequestError, 400),
                               (ctx.chat(model="nope"), openai.NotFoundError, 404),
                               (ctx.client.embeddings.create(model=MODEL, input="x"), openai.NotFoundError, 404),
                               (ctx.client.post("/models", cast_to=object, body={}), openai.APIStatusError, 405)]:
        with pytest.raises(kind) as info:
            await call
        assert info.value.status_code == status and set(info.value.body) == {"message", "type", "param", "code"}
    return "yes"


async def p_context_too_long(ctx: Ctx, _=None) -> str:
    prompt = " ".join(["lighthouse"] * 400)
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as info:
            await ctx.chat(messages=[{"role": "user", "content": prompt}], stream=stream)
        assert info.value.body["code"] == "context_too_long"
    return "yes"


async def p_logprobs(ctx: Ctx, _=None) -> str:
    """Chat `logprobs` + `top_logprobs` and completions `logprobs`: one entry per token, the
    answer unchanged (tests/test_logprobs_api.py checks the values)."""
    chat = await ctx.chat(logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == ctx.chat_text
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    text = await ctx.completion(logprobs=2)
    assert text.choices[0].text == ctx.text and len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens
    return "yes"


async def p_n(ctx: Ctx, _=None) -> str:
    """Choices: each is the single request with seed + i (tests/test_openai_choices.py: streamed,
    cancelled, sharing the prompt's cache)."""
    r = await ctx.chat(n=3, temperature=1.0, seed=4)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [(await ctx.chat(temperature=1.0, seed=4 + i)).choices[0].message.content for i in range(3)]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == (await ctx.chat()).usage.prompt_tokens
    ends = [c.choices[0].index async for c in await ctx.completion(n=2, stream=True) if c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1]
    with pytest.raises(openai.BadRequestError) as info:
        await ctx.chat(n=99)
    assert info.value.body["param"] == "n"
    return "yes"


async def p_echo(ctx: Ctx, _=None) -> str:
    r = await ctx.completion(echo=True)
    assert r.choices[0].text == PROMPT + ctx.text and r.usage.completion_tokens == 6
    alone = await ctx.completion(echo=True, max_tokens=0)
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
    return "yes"


async def p_prompt_logprobs(ctx: Ctx, _=None) -> str:
    """The prompt's tokens first, the first null (tests/test_lm_eval.py checks the values against
    transformers through lm-evaluation-harness); a token-id prompt gets the same."""
    r = await ctx.completion(echo=True, logprobs=1)
    lp, n = r.choices[0].logprobs, r.usage.prompt_tokens
    assert len(lp.tokens) == n + 6 and "".join(lp.tokens[:n]) == PROMPT and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(top[tok] == p for tok, p, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    ids = (await ctx.http.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    by_ids = await ctx.completion(prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert by_ids.choices[0].logprobs.tokens == lp.tokens[:n] and by_ids.choices[0].text == PROMPT
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    return "yes"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"]}}}


async def p_tools(ctx: Ctx, _=None) -> str:
    r = await ctx.chat(tools=[TOOL, WEATHER], tool_choice="required", max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls, r
    r = await ctx.chat(tools=[TOOL, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    none = await ctx.chat(tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == ctx.chat_text and none.choices[0].message.tool_calls is None
    return "yes"


async def p_tool_messages(ctx: Ctx, _=None) -> str:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    r = await ctx.chat(messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[WEATHER])
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    return "yes"


async def p_response_format(ctx: Ctx, _=None) -> str:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"]}
    r = await ctx.chat(max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    got = json.loads(r.choices[0].message.content)
    assert got["answer"] in ("yes", "no") and 0 <= got["n"] <= 9 and set(got) == {"answer", "n"}
    with pytest.raises(openai.BadRequestError) as info:
        await ctx.chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}})
    assert info.value.body["param"] == "response_format"
    return "yes"

# ---- sampling controls (OpenAI's penalties and logit_bias, vLLM's extensions): each answer
# equals the worker's own engine run here with the same control (tests/test_engine_penalties.py
# checks that engine against transformers' processors) and differs from the answer without it;
# a bad value is a 400 naming the field

async def refused_400(call, param: str) -> None:
    try:
        await call
    except openai.BadRequestError as exc:
        assert exc.body["param"] == param and exc.body["type"] == "invalid_request_error", exc.body
    else:
        raise AssertionError(f"a bad {param} was accepted")


def control(name: str, value: Any, bad: Any) -> Callable[[Ctx, Any], Awaitable[str]]:
    """Greedy with the control on both routes equals the reference, which it changed."""
    async def probe(ctx: Ctx, _=None) -> str:
        for chat in (True, False):
            call = ctx.chat if chat else ctx.completion
            r = await call(max_tokens=12, extra_body={name: value})
            got = r.choices[0].message.content if chat else r.choices[0].text
            want, plain = ctx.reference(chat, max_tokens=12, **{name: value})[0], ctx.reference(chat, max_tokens=12)[0]
            assert got == want != plain, (name, chat, got, want, plain)
        await refused_400(ctx.chat(extra_body={name: bad}), name)
        return "yes"
    return probe


async def p_logit_bias(ctx: Ctx, _=None) -> str:
    """Forbids the greedy first token, forces another; an id outside the vocabulary (the worker
    refuses it before any token) or a bias over 100: 400 naming it."""
    _, plain, _ = ctx.reference(max_tokens=6)
    bias = {plain[0]: -100.0, 4321: 5.0}
    r = await ctx.chat(max_tokens=6, logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].message.content == ctx.reference(max_tokens=6, logit_bias=bias)[0]
    forced = await ctx.completion(max_tokens=4, temperature=1.0, logit_bias={"4321": 100})
    assert forced.choices[0].text == ctx.reference(False, max_tokens=4, logit_bias={4321: 100.0})[0]
    assert ctx.reference(False, max_tokens=4, logit_bias={4321: 100.0})[1] == [4321] * 4
    await refused_400(ctx.chat(logit_bias={"999999": 1}), "logit_bias")
    await refused_400(ctx.chat(logit_bias={"5": 101}), "logit_bias")
    return "yes"


def narrowing(name: str, greedy_value: Any, off: Any, bad: Any) -> Callable[[Ctx, Any], Awaitable[str]]:
    """A control that keeps only the most likely token at `greedy_value` (top_k 1, min_p 1):
    greedy at any temperature and seed; at `off` the same draw as without it."""
    async def probe(ctx: Ctx, _=None) -> str:
        greedy = await sampled(ctx, temperature=0)
        for seed in (1, 2):
            assert await sampled(ctx, temperature=1.5, seed=seed, extra_body={name: greedy_value}) == greedy
        plain = await sampled(ctx, temperature=1.5, seed=3)
        assert await sampled(ctx, temperature=1.5, seed=3, extra_body={name: off}) == plain != greedy
        await refused_400(ctx.chat(extra_body={name: bad}), name)
        return "yes"
    return probe


async def p_min_tokens(ctx: Ctx, _=None) -> str:
    """EOS all but forced: the answer ends at once, or after min_tokens tokens."""
    eos = min(ctx.engine()[0].eos_ids)
    for m in (0, 4):
        r = await ctx.chat(max_tokens=10, logit_bias={str(eos): 100}, extra_body={"min_tokens": m})
        assert r.usage.completion_tokens == m + 1 and r.choices[0].finish_reason == "stop", r
    await refused_400(ctx.chat(max_tokens=3, extra_body={"min_tokens": 4}), "min_tokens")
    return "yes"


async def p_stop_token_ids(ctx: Ctx, _=None) -> str:
    """The answer ends at the first of the ids, finish_reason stop, its text left out unless
    include_stop_str_in_output."""
    _, plain, _ = ctx.reference(False, max_tokens=12)
    stop_id = plain[3]
    first = plain.index(stop_id)
    for include in (False, True):
        body = {"stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        r = await ctx.completion(max_tokens=12, extra_body=body)
        text, ids, reason = ctx.reference(False, max_tokens=12, stop_token_ids=[stop_id],
                                          include_stop_str_in_output=include)
        assert r.choices[0].text == text and ids == plain[:first + 1] and reason == "stop"
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    await refused_400(ctx.chat(extra_body={"stop_token_ids": [-1]}), "stop_token_ids")
    return "yes"


async def p_include_stop_str(ctx: Ctx, _=None) -> str:
    """The stop string stays at the end of the text (p_stop_token_ids: the stop token's text)."""
    base = (await ctx.completion(max_tokens=30)).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 4]
    r = await ctx.completion(max_tokens=30, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == base[:base.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"
    await refused_400(ctx.chat(extra_body={"include_stop_str_in_output": "maybe"}), "include_stop_str_in_output")
    return "yes"


async def p_skip_special_tokens(ctx: Ctx, _=None) -> str:
    """A special token (forced by logit_bias) is shown only with skip_special_tokens: false."""
    special = ctx.engine()[1].convert_tokens_to_ids("<|im_start|>")
    for skip, want in ((False, "<|im_start|>" * 3), (True, "")):
        r = await ctx.chat(max_tokens=3, logit_bias={str(special): 100}, extra_body={"skip_special_tokens": skip})
        assert r.choices[0].message.content == want, r
    await refused_400(ctx.chat(extra_body={"skip_special_tokens": "maybe"}), "skip_special_tokens")
    return "yes"


# ---- the Responses API (docs/clients.md, "Responses API")

async def responses_finished(ctx: Ctx, resp_id: str):
    polls = []

    async def ended():
        polls.append(await ctx.client.responses.retrieve(resp_id))
        return polls[-1].status not in ("queued", "in_progress")
    assert await eventually(ended, timeout=60, interval=0.1), polls[-1].status
    return polls[-1]


async def p_responses_create(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.output_text == ctx.chat_text and r.usage.output_tokens == 6
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = [e async for e in await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=6,
                                                                  temperature=0, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ctx.chat_text
    return "yes"


async def p_responses_retrieve(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=6, temperature=0)
    assert (await ctx.client.responses.retrieve(r.id)).model_dump() == r.model_dump()
    return "yes"


async def p_responses_background(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=6, temperature=0,
                                          background=True)
    assert r.status == "queued"
    assert (await responses_finished(ctx, r.id)).output_text == ctx.chat_text
    every = [e async for e in await ctx.client.responses.retrieve(r.id, stream=True)]
    rest = [e async for e in await ctx.client.responses.retrieve(r.id, stream=True, starting_after=3)]
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in every[4:]] and rest
    return "yes"


async def p_responses_cancel(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=2000, background=True)
    assert (await ctx.client.responses.cancel(r.id)).status == "cancelled"
    assert (await responses_finished(ctx, r.id)).status == "cancelled"
    return "yes"


async def p_responses_delete(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=2)
    await ctx.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await ctx.client.responses.retrieve(r.id)
    return "yes"


async def p_responses_input_items(ctx: Ctx, _=None) -> str:
    r = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=2)
    items = await ctx.client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == [CHAT[0]["content"]]
    return "yes"


async def p_previous_response_id(ctx: Ctx, _=None) -> str:
    first = await ctx.client.responses.create(model=MODEL, input=CHAT, max_output_tokens=6, temperature=0)
    more = {"role": "user", "content": "And then?"}
    second = await ctx.client.responses.create(model=MODEL, input=[more], previous_response_id=first.id,
                                               max_output_tokens=6, temperature=0)
    whole = await ctx.chat(messages=[*CHAT, {"role": "assistant", "content": first.output_text}, more])
    assert second.output_text == whole.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0
    return "yes"


ROUTES = ["/v1/embeddings", "/v1/moderations", "/v1/images/generations", "/v1/audio/speech"]


async def p_batch(ctx: Ctx, _=None) -> str:
    """The Batch API end to end through the SDK: upload (and a malformed upload refused per line),
    create, poll, the output file, list, retrieve, cancel, delete (tests/test_openai_batch.py
    checks each in depth)."""
    import io
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}}
    try:
        await ctx.client.files.create(file=("bad.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        return "malformed file accepted"
    except openai.BadRequestError as exc:
        assert exc.body["code"] == "invalid_batch_file" and exc.body["lines"][0]["line"] == 1, exc.body
    upload = await ctx.client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")),
                                           purpose="batch")
    assert (await ctx.client.files.retrieve(upload.id)).bytes == upload.bytes
    batch = await ctx.client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")

    async def done() -> bool:
        return (await ctx.client.batches.retrieve(batch.id)).status == "completed"
    assert await eventually(done, timeout=60, interval=0.2)
    batch = await ctx.client.batches.retrieve(batch.id)
    assert batch.request_counts.completed == 1
    (answer,) = [json.loads(x) for x in (await ctx.client.files.content(batch.output_file_id)).text.splitlines()]
    assert answer["custom_id"] == "c0" and answer["response"]["body"]["choices"][0]["message"]["content"] == \
        ctx.chat_text, answer
    assert batch.id in [b.id async for b in ctx.client.batches.list(limit=5)]
    assert upload.id in [f.id async for f in ctx.client.files.list()]
    other = await ctx.client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
    assert (await ctx.client.batches.cancel(other.id)).status in ("cancelling", "cancelled")
    assert (await ctx.client.files.delete(upload.id)).deleted
    try:
        await ctx.client.files.retrieve(upload.id)
        return "a deleted file is still there"
    except openai.NotFoundError:
        return "yes"


def probed_by(test: str) -> Callable[[Ctx, Any], Awaitable[str]]:
    """A row about a whole client (an agent framework, another language's SDK) or a long run:
    probed by its own test elsewhere in the suite, on the stack it needs (the tool-template
    model, node), not by this walk. Here: that test exists (and the row names it)."""
    async def probe(ctx: Ctx, _=None) -> str:
        path, name = test.split("::")
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        return "yes" if name in defined else f"no test {test}"
    return probe


ELSEWHERE = {
    "Agent": "tests/test_responses_api.py::test_openai_agents_sdk_tool_round_trip",
    "function_tool": "tests/test_responses_api.py::test_openai_agents_sdk_tool_round_trip",
    "ChatOpenAI(use_responses_api=True)": "tests/test_responses_api.py::test_langchain_chat_openai_on_the_responses_api",
    "responses.retrieve(id, {stream: true, starting_after})":
        "tests/test_responses_api.py::test_node_sdk_background_stream_dropped_and_resumed",
    "/v1/responses": "tests/test_openai_batch.py::test_responses_lines",
}

PROBES: dict[str, Callable[[Ctx, Any], Awaitable[str]]] = {
    **{item: probed_by(test) for item, test in ELSEWHERE.items()},
    "POST /v1/chat/completions": p_chat,
    "POST /v1/completions": p_completions,
    "GET /v1/models": p_models,
    "GET /v1/models/{model}": p_model_retrieve,
    **{path: route(path) for path in ROUTES},
    **{path: p_batch for path in ("POST /v1/files", "GET /v1/files", "GET /v1/files/{id}", "GET /v1/files/{id}/content",
                                  "DELETE /v1/files/{id}", "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{id}",
                                  "POST /v1/batches/{id}/cancel")},
    "model": p_model,
    "stream": p_stream,
    "stream_options.include_usage": p_include_usage,
    "stream_options.include_obfuscation": p_obfuscation,
    "stream_options.continuous_usage_stats": p_continuous_usage,
    "ignore_eos": p_ignore_eos,
    "cache_salt": p_cache_salt,
    "GET /health": p_health,
    "GET /v1/health": p_health,
    "GET /version": p_version,
    "POST /tokenize": p_tokenize,
    "POST /detokenize": p_detokenize,
    "max_tokens": p_max_tokens,
    "max_completion_tokens": p_max_completion_tokens,
    "temperature": p_temperature,
    "top_p": p_top_p,
    "seed": p_seed,
    "stop": p_stop,
    "finish_reason": p_finish_reason,
    **{f"role: {r}": role(r) for r in ("system", "developer", "user", "assistant", "function")},
    "role: tool": p_tool_messages,
    **{f'{{"type": "{k}"}}': part(k) for k in ("text", "image_url", "input_audio", "file")},
    "messages.append(message.model_dump())": p_conversation_loop,
    "message.refusal": message_field("refusal", "I can't help with that."),
    "message.audio": message_field("audio", {"id": "audio_1"}),
    "message.function_call": message_field("function_call", {"name": "f", "arguments": "{}"}),
    "message.tool_calls": p_tool_messages,
    "message.annotations": message_field("annotations", [{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "Example", "start_index": 0, "end_index": 3}}]),
    "message.name": message_field("name", "alice", role="user"),
    "n": p_n,
    "presence_penalty": control("presence_penalty", 1.5, 2.5),
    "frequency_penalty": control("frequency_penalty", 1.0, -3),
    "logit_bias": p_logit_bias,
    "logprobs": p_logprobs,
    "top_logprobs": p_logprobs,
    "tools": p_tools,
    "tool_choice": p_tools,
    "functions": param("functions", [TOOL["function"]]),
    "function_call": param("function_call", "auto"),
    "response_format": p_response_format,
    "modalities": param("modalities", ["text", "audio"]),
    "audio": param("audio", {"voice": "alloy", "format": "wav"}),
    "web_search_options": param("web_search_options", {}),
    "echo": p_echo,
    "echo: true": p_prompt_logprobs,
    "logprobs: k": p_prompt_logprobs,
    "best_of": param("best_of", 2, endpoint="completions"),
    "suffix": param("suffix", " The end.", endpoint="completions"),
    "prompt": param("prompt", [PROMPT, "Far away"], endpoint="completions"),
    "top_k": narrowing("top_k", 1, -1, 1001),         # -1: vLLM's "off"
    "min_p": narrowing("min_p", 1.0, 0.0, 1.5),
    "repetition_penalty": control("repetition_penalty", 5.0, 0),
    "min_tokens": p_min_tokens,
    "stop_token_ids": p_stop_token_ids,
    "include_stop_str_in_output": p_include_stop_str,
    "skip_special_tokens": p_skip_special_tokens,
    "user": param("user", "user-1234"),
    "safety_identifier": param("safety_identifier", "hash-of-user"),
    "store": param("store", True),
    "metadata": param("metadata", {"app": "compat"}),
    "service_tier": param("service_tier", "auto"),
    "prompt_cache_key": p_prompt_cache_key,
    "prompt_cache_retention": param("prompt_cache_retention", "24h"),
    "verbosity": param("verbosity", "low"),
    "reasoning_effort": param("reasoning_effort", "minimal"),
    "parallel_tool_calls": param("parallel_tool_calls", False),
    "prediction": param("prediction", {"type": "content", "content": "The lighthouse"}),
    "priority": p_priority,
    "Last-Event-ID": p_resume,
    "resumable": p_resume,
    "Idempotency-Key": p_idempotency,
    "stream.close()": p_abort,
    "x-request-id": p_request_id,
    "error": p_errors,
    "context_too_long": p_context_too_long,
    "POST /v1/responses": p_responses_create,
    "GET /v1/responses/{id}": p_responses_retrieve,
    "GET /v1/responses/{id}?stream=true&starting_after=N": p_responses_background,
    "background": p_responses_background,
    "POST /v1/responses/{id}/cancel": p_responses_cancel,
    "DELETE /v1/responses/{id}": p_responses_delete,
    "GET /v1/responses/{id}/input_items": p_responses_input_items,
    "previous_response_id": p_previous_response_id,
}


# ---------------------------------------------------------------- the walk

@pytest.fixture(scope="module")
def table_stack(redis_server, tiny_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("table-logs"),
                            name="w-table", env={"MAX_PROMPT_TOKENS": MAX_PROMPT_TOKENS}) as prefix:
        yield prefix


async def test_every_row_of_the_compatibility_table_is_true(redis_server, table_stack, tiny_model_dir):
    rows = compatibility_table(DOC.read_text())
    wrong: list[str] = []
    async with gateway_in_process(gateway_settings(redis_server.url, table_stack, resume_grace_s=10)) as gw:
        ctx = Ctx(gw, tiny_model_dir)
        await ctx.setup()
        try:
            for row in rows:
                for item in row.items:
                    probe = PROBES[item]
                    if probe not in ctx.memo:
                        try:
                            ctx.memo[probe] = await probe(ctx)
                        except AssertionError as exc:
                            ctx.memo[probe] = f"failed: {exc}"
                    if ctx.memo[probe] != row.status:
                        wrong.append(f"`{item}`: the table says {row.status}, the API: {ctx.memo[probe]}")
                for item, value in row.accepted:
                    got = await PROBES[item](ctx, value)
                    if got != "ignored":
                        wrong.append(f"`{item}: {json.dumps(value)}`: the table says accepted, the API: {got}")
        finally:
            await ctx.http.aclose()
    print(f"{len(rows)} rows, {sum(len(r.items) for r in rows)} items, "
          f"{sum(len(r.accepted) for r in rows)} accepted values checked")
    assert not wrong, "docs/clients.md's compatibility table is wrong:\n" + "\n".join(wrong)

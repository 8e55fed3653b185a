"""Protocol fuzzer: hypothesis generates JSON and msgpack frames (valid, mistyped, oversized,
deeply nested, odd Unicode) against a live gateway. Every frame gets a typed answer (or none,
for a successful `auth`), and the socket still answers a ping after it.

The gateway runs in a thread with its own event loop (hypothesis drives plain functions); no
worker is registered, so a valid `generate` is answered `overloaded` and nothing runs. Bounded
for CI: a few hundred examples in all, frames of at most 2 x MAX_FRAME_BYTES (2 KiB here).

The surfaces of structured output, tools, logprobs and resume are fuzzed against a live worker
too (the module's `stack`: the tiny model), seeded and bounded (6 rounds of 6 requests, a few
tokens each, then 14 resumes): random schemas and tool definitions (tests/fuzz_cases.py), a
sentinel stream that must keep moving and complete exactly, and no key left without an expiry.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.settings import GatewaySettings
from shared.errors import ErrorCode
from shared.streams import as_str
from tests import fuzz_cases
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import StackSpec, gateway_in_process

MAX_FRAME = 2048
CODES = {c.value for c in ErrorCode}
SERVER_TYPES = {"accepted", "chunk", "done", "error", "heartbeat", "pong"}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class ThreadedGateway:
    """An in-process gateway on its own loop in a daemon thread."""

    def __init__(self, gw_settings: GatewaySettings):
        self.settings = gw_settings
        self.ready = threading.Event()
        self.stop = None
        self.url = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self.stop = asyncio.Event()
        async with gateway_in_process(self.settings) as gw:
            self.url, self.loop = gw.ws_url, asyncio.get_running_loop()
            self.ready.set()
            await self.stop.wait()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30), "gateway did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


class Probe:
    """One client socket (re-opened if the server closes it) that sends a frame and collects
    everything the server answers before the pong of a follow-up ping."""

    def __init__(self, url: str, binary: bool):
        self.url, self.binary = url, binary
        self.nonces = itertools.count()
        self.ws = None

    def _open(self):
        proto = "llm-stream.msgpack" if self.binary else "llm-stream.json"
        self.ws = connect(self.url, subprotocols=[proto], max_size=None, open_timeout=10).__enter__()

    def _decode(self, raw):
        return msgpack.unpackb(raw) if isinstance(raw, bytes) else json.loads(raw)

    def exchange(self, frame: str | bytes) -> list[dict]:
        if self.ws is None:
            self._open()
        nonce = next(self.nonces)
        ping = {"type": "ping", "nonce": nonce}
        self.ws.send(frame)
        self.ws.send(msgpack.packb(ping) if self.binary else json.dumps(ping))
        replies = []
        while True:
            try:
                msg = self._decode(self.ws.recv(timeout=10))
            except TimeoutError:
                raise AssertionError(f"no pong after {frame[:80]!r}: the socket went silent") from None
            except ConnectionClosed as exc:
                self.ws = None
                raise AssertionError(f"socket closed after {frame[:80]!r}: {exc}") from None
            assert isinstance(msg, dict) and msg.get("type") in SERVER_TYPES, msg
            if msg["type"] == "pong" and msg.get("nonce") == nonce:
                return replies
            replies.append(msg)

    def close(self):
        if self.ws is not None:
            self.ws.close()


@pytest.fixture(scope="module")
def gateway(redis_server):
    import uuid
    gw_settings = GatewaySettings(redis_url=redis_server.url, stream_prefix=f"fz{uuid.uuid4().hex[:8]}",
                                  heartbeat_s=0, ping_timeout_s=0, max_frame_bytes=MAX_FRAME,
                                  send_queue_max=10_000, send_queue_max_bytes=10_000_000, resume_rate_per_min=0)
    with ThreadedGateway(gw_settings) as gw:
        yield gw


@pytest.fixture(scope="module")
def probes(gateway):
    made = {False: Probe(gateway.url, False), True: Probe(gateway.url, True)}
    yield made
    for p in made.values():
        p.close()


def check_typed(frame_obj, replies: list[dict]) -> None:
    """Each reply is a well-formed server message; an error carries a known code; only a
    successful `auth` may go unanswered."""
    for msg in replies:
        if msg["type"] == "error":
            assert msg["code"] in CODES and isinstance(msg["message"], str) and isinstance(msg["retryable"], bool), msg
    is_auth = isinstance(frame_obj, dict) and frame_obj.get("type") == "auth"
    assert replies or is_auth, f"no answer to {str(frame_obj)[:120]}"


# ---------------------------------------------------------------- strategies

IDS = st.from_regex(r"[A-Za-z0-9_.:\-]{1,64}", fullmatch=True)
ODD_TEXT = st.text(st.characters(codec=None), max_size=40)      # includes lone surrogates, NUL, RTL, emoji
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), ODD_TEXT)
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(ODD_TEXT, inner, max_size=4)), max_leaves=12)

VALID = st.one_of(
    st.fixed_dictionaries({"type": st.just("generate"), "id": IDS, "prompt": st.text(max_size=50)},
                          optional={"max_tokens": st.integers(1, 64), "temperature": st.floats(0, 2),
                                    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 1000),
                                    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=8),
                                                                                       max_size=8),
                                    "priority": st.sampled_from(["interactive", "batch"]), "v": st.just(1)}),
    st.fixed_dictionaries({"type": st.just("generate"), "id": IDS,
                           "messages": st.lists(st.fixed_dictionaries({
                               "role": st.sampled_from(["system", "user", "assistant"]),
                               "content": st.text(max_size=30)}), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"type": st.just("cancel"), "id": IDS}),
    st.fixed_dictionaries({"type": st.just("resume"), "id": IDS, "last_seq": st.integers(0, 10**6),
                           "request_id": st.from_regex(r"[0-9a-f]{32}", fullmatch=True)}),
    st.fixed_dictionaries({"type": st.just("auth"), "api_key": st.text(min_size=1, max_size=40)}),
    st.fixed_dictionaries({"type": st.just("ping")}, optional={"nonce": st.one_of(st.integers(-2**53, 2**53),
                                                                                 st.text(max_size=64))}),
)
FIELDS = ["type", "id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "priority", "last_seq", "request_id", "nonce", "api_key", "v"]
MISTYPED = st.builds(lambda base, field, value: {**base, field: value},
                     VALID, st.sampled_from(FIELDS), JSONISH)


@st.composite
def deep(draw):
    depth = draw(st.integers(1, 5000))
    inner = draw(st.sampled_from(["[", '{"a":']))
    close = "]" if inner == "[" else "}"
    return '{"type":"ping","nonce":' + inner * depth + "1" + close * depth + "}"


# ---------------------------------------------------------------- the properties

@FUZZ
@given(obj=st.one_of(VALID, MISTYPED, JSONISH))
def test_json_frames_get_typed_answers(probes, obj):
    frame = json.dumps(obj, ensure_ascii=True)     # lone surrogates travel as \\udxxx escapes
    replies = probes[False].exchange(frame)
    if len(frame) > MAX_FRAME:
        assert any(r.get("code") == "frame_too_large" for r in replies), replies
    check_typed(obj, replies)


@FUZZ
@given(obj=st.one_of(VALID, MISTYPED, JSONISH))
def test_msgpack_frames_get_typed_answers(probes, obj):
    try:
        frame = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")   # invalid UTF-8 possible
    except OverflowError:       # an integer beyond 64 bits: no msgpack client can send it
        assume(False)
    check_typed(obj, probes[True].exchange(frame))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(frame=deep())
def test_deeply_nested_frames_get_typed_answers(probes, frame):
    if len(frame.encode()) > 2 * MAX_FRAME:
        frame = frame[:2 * MAX_FRAME]             # truncated: no longer JSON, still must be answered
    replies = probes[False].exchange(frame)
    check_typed(None, replies)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(blob=st.binary(max_size=2 * MAX_FRAME), text=st.text(st.characters(codec="utf-8"), max_size=2 * MAX_FRAME))
def test_random_bytes_and_text_get_typed_answers(probes, blob, text):
    check_typed(None, probes[True].exchange(blob))
    check_typed(None, probes[False].exchange(text))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(size=st.integers(MAX_FRAME - 64, 2 * MAX_FRAME), binary=st.booleans())
def test_oversized_frames_get_frame_too_large(probes, size, binary):
    obj = {"type": "generate", "id": "big", "prompt": "x" * size}
    frame = msgpack.packb(obj) if binary else json.dumps(obj)
    replies = probes[binary].exchange(frame)
    check_typed(obj, replies)
    if len(frame) > MAX_FRAME:
        assert [r["code"] for r in replies] == ["frame_too_large"], replies


# ---------------------------------------------------------------- resume points (issue 34 item 7)

async def test_random_resume_points_are_exact_and_harm_no_other_client(redis_server, redis_client):
    """A finished request's history of multi-token events (multi-byte text, held-back bytes, an
    event written before per-token lengths existed with no text), resumed at random points —
    inside events, at their boundaries, past the end, with wrong ids — on fresh sockets and on
    one reused socket: each answer is typed, a resume within the output gets exactly the rest,
    a bystander socket keeps answering, and no Redis key is left behind by the resumes."""
    import random
    import uuid

    from shared.events import DoneEvent, DoneUsage, TokEvent
    from shared.streams import ENTRY_FIELD, Keys, history_id
    from tests.gateway_client import GatewayClient
    from tests.stack_fixtures import gateway_settings
    from tests.worker_redis import silent_worker

    rng = random.Random(34)
    keys = Keys(f"fzr{uuid.uuid4().hex[:8]}")
    await silent_worker(redis_client, keys)
    async with gateway_in_process(gateway_settings(redis_server.url, keys.prefix, resume_rate_per_min=0,
                                                   resume_grace_s=30)) as gw:
        owner = await GatewayClient.connect(gw.ws_url)
        rid = await owner.generate("g", prompt="x", max_tokens=64)
        pieces = ["Zü", "", "rich", " 東", "", "京", " ", "🎉", "", "", "ok", "…", "e\u0301", "!"]
        per_token, events, seq = [], [], 0
        while seq < 48:
            n = rng.randint(1, 7)
            texts = [rng.choice(pieces) for _ in range(n)]
            old = not any(texts) and rng.random() < 0.5        # an old event: no lengths (and no text)
            seq += n
            ev = TokEvent(rid, seq, list(range(seq - n + 1, seq + 1)), "".join(texts), 1, 0, None, 0,
                          None if old else [len(t) for t in texts])
            events.append(ev)
            per_token += texts
            await redis_client.xadd(keys.out(rid), {ENTRY_FIELD: ev.encode()}, id=history_id(seq, False))
        await redis_client.xadd(keys.out(rid), {ENTRY_FIELD: DoneEvent(rid, seq, "stop", DoneUsage(1, seq), 1, 0).encode()},
                                id=history_id(seq, True))
        bystander = await GatewayClient.connect(gw.ws_url)
        reused = await GatewayClient.connect(gw.ws_url)
        before = None
        for i in range(80):
            last = rng.choice([rng.randint(0, seq), rng.randint(0, seq), seq + rng.randint(1, 5), 10**6])
            wrong = rng.random() < 0.1
            c = reused if i % 3 == 0 else await GatewayClient.connect(gw.ws_url)
            cid = f"r{i}"
            await c.send(type="resume", id=cid, last_seq=last, request_id=uuid.uuid4().hex if wrong else rid)
            first = await c.recv(cid, timeout=30)
            if wrong:
                assert first["type"] == "error" and first["code"] == "resume_expired", first
            else:
                assert first["type"] == "accepted", first
                rest, fin = await c.until_done(cid, timeout=30)
                assert fin["type"] in ("done", "error"), fin
                if last <= seq:
                    assert fin["type"] == "done" and fin["seq"] == seq and "error" not in fin, (last, fin)
                    assert "".join(ch["text"] for ch in rest) == "".join(per_token[last:]), (last, rest)
                    assert sum(ch["tokens"] for ch in rest) == seq - last
                else:                   # more tokens than the request ever had: a typed refusal
                    assert not rest and (fin.get("error") or {}).get("code") == "invalid_request", (last, seq, fin)
            if c is not reused:
                await c.close()
            await bystander.send(type="ping", nonce=i)
            pong = await bystander.recv(timeout=10)
            assert (pong["type"], pong["nonce"]) == ("pong", i), pong
            if before is None:
                before = set(await redis_client.keys(keys.prefix + "*"))
        after = set(await redis_client.keys(keys.prefix + "*"))
        assert after <= before, f"keys the resumes left behind: {sorted(after - before)}"
        await reused.close()
        await bystander.close()
        await owner.close()


# ---------------------------------------------------------------- live: schemas, tools, logprobs, resumes (issue 34 item 7)

FUZZ_SCHEMA_BYTES = 1024        # the fuzz worker's GRAMMAR_MAX_SCHEMA_BYTES: random schemas cross it
STACK = StackSpec("w-fuzz", env={"GRAMMAR_MAX_SCHEMA_BYTES": FUZZ_SCHEMA_BYTES, "GRAMMAR_COMPILE_TIMEOUT_S": 3})
SENTINEL_TOKENS = 160
ROUNDS, PER_ROUND = 6, 6
# documented keys that live as long as the deployment (shared/streams.py); every other key of a
# request, a gateway or a worker carries a TTL once its request has ended
PERSISTENT = (":{q}:requests", ":{q}:dead", ":{reg}:", "}:inbox", "}:ctl")


class Sentinel:
    """Greedy streams of SENTINEL_TOKENS tokens (ignore_eos), one after another on a socket of
    their own: each must keep flowing through the fuzz and complete exactly."""

    def __init__(self, url: str):
        self.url, self.count, self.finished = url, 0, []

    async def start(self) -> None:
        self.ws = await GatewayClient.connect(self.url)
        await self._next()

    async def _next(self) -> None:
        self.count += 1
        self.cid, self.chunks, self.final = f"sentinel{self.count}", [], None
        self.rid = await self.ws.generate(self.cid, prompt="Once upon a time", max_tokens=SENTINEL_TOKENS,
                                          ignore_eos=True, temperature=0.0)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while self.final is None:
            msg = await self.ws.recv(self.cid, timeout=300)
            if msg["type"] == "chunk":
                self.chunks.append(msg)
            else:
                self.final = msg

    def mark(self) -> tuple[int, int]:
        return self.count, sum(ch["tokens"] for ch in self.chunks)

    async def rotate(self, wait: bool = False) -> None:
        """A finished sentinel is checked (every token once, in order, all of them) and the next starts."""
        if wait:
            await asyncio.wait_for(asyncio.shield(self.task), 300)
        if not self.task.done():
            return
        self.task.result()
        seq = 0
        for ch in self.chunks:
            assert ch["seq"] == seq + ch["tokens"], (self.cid, ch, seq)
            seq = ch["seq"]
        fin = self.final
        assert fin["type"] == "done" and "error" not in fin, fin
        assert fin["finish_reason"] == "length" and fin["seq"] == seq == SENTINEL_TOKENS, fin
        assert fin["usage"]["completion_tokens"] == SENTINEL_TOKENS, fin
        self.finished.append((self.rid, "".join(ch["text"] for ch in self.chunks)))
        if not wait:
            await self._next()


def check_error(msg: dict) -> dict:
    error = msg if msg["type"] == "error" else msg["error"]
    assert error["code"] in CODES and isinstance(error["message"], str), msg
    return error


async def ws_case(url: str, cid: str, fields: dict) -> dict | None:
    """One `generate` on a fresh socket: a typed refusal, or accepted, every token once and a
    typed `done`; logprobs, when asked and accepted, one entry a token. The finished request
    (rid, text, seq), or None when refused."""
    c = await GatewayClient.connect(url)
    try:
        await c.send(type="generate", id=cid, **fields)
        first = await c.recv(cid, timeout=120)
        if first["type"] == "error":
            check_error(first)
            return None
        assert first["type"] == "accepted", first
        chunks, fin = await c.until_done(cid, timeout=300)
        assert fin["type"] == "done" and fin["seq"] == sum(ch["tokens"] for ch in chunks), (fields, fin)
        if fin["finish_reason"] == "error":
            check_error(fin)
        else:
            assert fin["finish_reason"] in ("stop", "length") and "error" not in fin, fin
        if fields.get("logprobs") is True:
            top = fields.get("top_logprobs") or 0
            for ch in chunks:
                assert len(ch["logprobs"]) == ch["tokens"], ch
                assert all(len(e["top_logprobs"]) == top for e in ch["logprobs"]), ch
        return {"rid": first["request_id"], "text": "".join(ch["text"] for ch in chunks), "seq": fin["seq"]}
    finally:
        await c.close()


async def http_case(http, base: str, body: dict) -> None:
    """One chat completion over the OpenAI API: an answer or a typed 4xx, never a 5xx."""
    r = await http.post(base + "/v1/chat/completions", json=body)
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        assert {"message", "type", "param", "code"} <= set(r.json()["error"]), r.text[:300]
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), r.text[:300]


def random_fields(rng, i: int) -> dict:
    """A chat request with 1-3 of the new surfaces; in about a third of them one is malformed."""
    fields = {"messages": [{"role": "user", "content": rng.choice(fuzz_cases.ODD_STRINGS) or "hi"}],
              "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0.0, 1.0]), "seed": i}
    parts = rng.sample(["response_format", "tools", "logprobs"], rng.randint(1, 3))
    bad = rng.choice(parts) if rng.random() < 0.35 else None
    if "response_format" in parts and "tools" in parts and bad is None:
        parts.remove(rng.choice(["response_format", "tools"]))     # valid requests: one grammar at most
    for part in parts:
        if part == "response_format":
            fields["response_format"] = fuzz_cases.response_format(rng, big_bytes=2 * FUZZ_SCHEMA_BYTES,
                                                                   valid=part != bad)
        elif part == "tools":
            fields.update(fuzz_cases.tools(rng, big_bytes=2 * FUZZ_SCHEMA_BYTES, valid=part != bad))
        else:
            fields.update(fuzz_cases.logprobs(rng, valid=part != bad))
    return fields


async def resume_case(url: str, cid: str, done: dict, last) -> None:
    """A finished request resumed at `last`: the rest exactly (a suffix of its text, its token
    count), or a typed refusal for a point it never reached or a mistyped one."""
    c = await GatewayClient.connect(url)
    try:
        await c.send(type="resume", id=cid, last_seq=last, request_id=done["rid"])
        first = await c.recv(cid, timeout=60)
        valid = isinstance(last, int) and not isinstance(last, bool) and 0 <= last <= done["seq"]
        if first["type"] == "error":
            assert not valid and check_error(first)["code"] == "invalid_request", (last, done["seq"], first)
            return
        assert first["type"] == "accepted", first
        chunks, fin = await c.until_done(cid, timeout=60)
        if not valid:
            assert not chunks and check_error(fin)["code"] == "invalid_request", (last, done["seq"], fin)
            return
        text = "".join(ch["text"] for ch in chunks)
        assert fin["seq"] == done["seq"] and sum(ch["tokens"] for ch in chunks) == done["seq"] - last, (last, fin)
        assert done["text"].endswith(text) and (last or text == done["text"]), (last, text, done)
    finally:
        await c.close()


async def test_random_schemas_tools_logprobs_and_resumes_harm_no_other_stream(stack, redis_client):
    """Seeded random `response_format` schemas (odd, broken, too large, one slow to compile),
    tool definitions, logprobs fields, over the WebSocket and the OpenAI API, in rounds beside a
    sentinel stream; then resumes of the finished requests at random points (in range, past the
    end, mistyped). Every answer is typed; the sentinel moves on in every round and each of its
    streams completes exactly; the worker lives; no request key is left without an expiry."""
    import random

    import httpx

    rng = random.Random(3407)
    async with gateway_in_process(stack.settings(resume_rate_per_min=0)) as gw:
        sentinel = Sentinel(gw.ws_url)
        await sentinel.start()
        finished: list[dict] = []
        async with httpx.AsyncClient(timeout=300) as http:
            for rnd in range(ROUNDS):
                mark = sentinel.mark()
                jobs, ws_jobs = [], []
                for k in range(PER_ROUND):
                    i = rnd * PER_ROUND + k
                    fields = random_fields(rng, i)
                    if i == 0:      # the documented slow kind: seconds of compiling, or the 3 s timeout
                        fields["response_format"] = {"type": "json_schema", "json_schema": {
                            "name": "slow", "schema": fuzz_cases.slow_schema(rng)}}
                    if rng.random() < 0.3:
                        body = {"model": gw.settings.served_model_name, **fields, "stream": rng.random() < 0.5}
                        jobs.append(http_case(http, gw.base, body))
                    else:
                        ws_jobs.append(ws_case(gw.ws_url, f"f{i}", fields))
                results = await asyncio.gather(*ws_jobs, *jobs)
                finished += [r for r in results[:len(ws_jobs)] if r]
                assert await eventually(lambda: sentinel.mark() != mark or sentinel.task.done(), timeout=60), \
                    f"the sentinel made no progress in round {rnd}"
                await sentinel.rotate()
        await sentinel.rotate(wait=True)
        assert finished and sentinel.finished
        for rid, text in sentinel.finished[:2]:         # its history holds exactly what it streamed
            await resume_case(gw.ws_url, f"rs{rid[:6]}", {"rid": rid, "text": text, "seq": SENTINEL_TOKENS}, 0)
        for j in range(12):
            done = rng.choice(finished + [{"rid": r, "text": t, "seq": SENTINEL_TOKENS} for r, t in sentinel.finished])
            last = rng.choice([0, rng.randint(0, done["seq"]), done["seq"], done["seq"] + 1, 10**6, -1, "2", 2.5])
            await resume_case(gw.ws_url, f"r{j}", done, last)
        await sentinel.ws.close()
        assert stack.worker.alive(), stack.worker.log()[-3000:]
        assert "Traceback" not in stack.worker.log(), stack.worker.log()[-3000:]
        untimed, requests_seen = [], 0
        async for key in redis_client.scan_iter(match=f"{stack.prefix}:*"):
            name = as_str(key)
            requests_seen += ":{r:" in name
            if ":conc:" in name:
                assert await redis_client.zcard(key) == 0, name          # no concurrency lease held
            if await redis_client.ttl(key) == -1 and not any(p in name for p in PERSISTENT):
                untimed.append(name)
        assert requests_seen > len(finished) and not untimed, f"keys left without an expiry: {sorted(untimed)}"

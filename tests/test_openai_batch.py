"""The Batch API through the official `openai` package against the real stack (Redis, an
in-process gateway, a worker process on the tiny model): `files.create` + `batches.create`,
polling `batches.retrieve`, `files.content` in OpenAI's line format, listing with pagination,
cancel, malformed lines reported per line, and another API key that sees nothing (404).

Every answer is checked against the worker's record: each line's `request_id` names a request
whose output stream in Redis holds exactly the text the output file carries, on the batch lane.
"""

from __future__ import annotations

import hashlib
import io
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from shared.streams import Keys
from tests.gateway_client import eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker
from tests.worker_redis import read_events, text_of

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-alice-batch", "bob": "sk-bob-batch"}
API_KEYS = ",".join(f"{n}:{hashlib.sha256(k.encode()).hexdigest()}" for n, k in KEYS.items())


@pytest.fixture(scope="module")
def batch_stack(redis_server, tiny_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("batch-logs"),
                            name="w-batch") as prefix:
        yield prefix


def client(gw, who: str = "alice") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key=KEYS[who], max_retries=0, timeout=60)


def settings(redis_server, prefix, **kw):
    return gateway_settings(redis_server.url, prefix, api_keys=API_KEYS, resume_grace_s=10, **kw)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Story number {i}:"}],
                     "max_tokens": 5 + i % 4, "temperature": 0, **body}}


async def finished(oai: AsyncOpenAI, batch_id: str, timeout: float = 120):
    seen: list[str] = []

    async def done() -> bool:
        batch = await oai.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        return batch.status in ("completed", "failed", "cancelled", "expired")
    assert await eventually(done, timeout=timeout, interval=0.2), seen
    return await oai.batches.retrieve(batch_id), seen


async def check_against_redis(redis_client, prefix: str, answer: dict) -> None:
    """The output line's text is what the worker wrote for its request, on the batch lane."""
    events = await read_events(redis_client, Keys(prefix), answer["response"]["request_id"])
    text = text_of(events)
    final = events[-1]
    assert final["k"] == "done" and final.get("lane") == "batch", final
    assert answer["response"]["body"]["choices"][0]["message"]["content"] == text


async def test_batch_through_the_sdk_every_line_answered_once(redis_server, redis_client, batch_stack):
    lines = [chat_line(i) for i in range(12)]
    lines.append({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}})
    lines.append({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}})
    async with gateway_in_process(settings(redis_server, batch_stack, batch_concurrency=3)) as gw:
        oai = client(gw)
        chat_only = lines[:-1]
        uploaded = await oai.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_only))), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(chat_only))
        assert (await oai.files.retrieve(uploaded.id)).filename == "in.jsonl"
        batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        batch, seen = await finished(oai, batch.id)
        assert batch.status == "completed", (batch, seen)
        assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
        assert batch.request_counts.total == 13
        assert batch.request_counts.completed == 12 and batch.request_counts.failed == 1
        out = [json.loads(x) for x in (await oai.files.content(batch.output_file_id)).text.splitlines()]
        err = [json.loads(x) for x in (await oai.files.content(batch.error_file_id)).text.splitlines()]
        assert [a["custom_id"] for a in out] == [f"req-{i}" for i in range(12)]      # line order, once each
        for answer in out:
            assert answer["error"] is None and answer["response"]["status_code"] == 200
            await check_against_redis(redis_client, batch_stack, answer)
        assert len({a["response"]["request_id"] for a in out}) == 12
        (bad,) = err
        assert bad["custom_id"] == "bad-body" and bad["response"]["status_code"] == 400
        assert bad["response"]["body"]["error"]["param"] == "n"
        # the same request alone answers the same (greedy): the batch lane changes no answer
        alone = await oai.chat.completions.create(**lines[3]["body"])
        assert alone.choices[0].message.content == out[3]["response"]["body"]["choices"][0]["message"]["content"]
        # a mismatched endpoint fails the batch at validation, naming the line
        mixed = await oai.files.create(file=("mixed.jsonl", io.BytesIO(jsonl(lines[:2] + lines[-1:]))),
                                       purpose="batch")
        failed = await oai.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
        failed, _ = await finished(oai, failed.id)
        assert failed.status == "failed" and failed.errors.data[0].line == 3, failed
        # listing: newest first, paginated
        first = await oai.batches.list(limit=1)
        assert [b.id for b in first.data] == [failed.id] and first.has_more
        assert [b.id for b in (await oai.batches.list(limit=5, after=failed.id)).data] == [batch.id]
        ids = [f.id async for f in oai.files.list()]
        assert uploaded.id in ids and batch.output_file_id in ids
        assert (await oai.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await oai.files.retrieve(uploaded.id)


def response_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "max_output_tokens": 6, "temperature": 0, **body}}


async def test_responses_lines(redis_server, redis_client, batch_stack):
    """`/v1/responses` lines run as the route runs them (the same body, `previous_response_id`
    chains from the stored responses), on the batch lane; each answer is the response object,
    stored unless `store: false`, and the same as the route's answer to the same request."""
    async with gateway_in_process(settings(redis_server, batch_stack, batch_concurrency=2)) as gw:
        oai = client(gw)
        first = await oai.responses.create(model=MODEL, input="Story number 1:", max_output_tokens=6, temperature=0)
        more = {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}
        lines = [response_line("plain", input="Story number 2:"),
                 response_line("instructed", input="Story number 3:", instructions="Be brief.", metadata={"k": "v"}),
                 response_line("chained", input=[more], previous_response_id=first.id),
                 response_line("unstored", input="Story number 4:", store=False),
                 response_line("streamed", input="x", stream=True),
                 response_line("background", input="x", background=True),
                 response_line("unknown-previous", input="x", previous_response_id="resp_" + "0" * 32)]
        uploaded = await oai.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
        batch, seen = await finished(oai, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 4, (batch, seen)
        out = [json.loads(x) for x in (await oai.files.content(batch.output_file_id)).text.splitlines()]
        err = [json.loads(x) for x in (await oai.files.content(batch.error_file_id)).text.splitlines()]
        assert [a["custom_id"] for a in out] == ["plain", "instructed", "chained", "unstored"]
        for line, answer in zip(lines, out):
            r = answer["response"]
            body = r["body"]
            assert r["status_code"] == 200 and body["object"] == "response" and body["id"] == "resp_" + r["request_id"]
            assert body["status"] in ("completed", "incomplete") and body["usage"]["output_tokens"] > 0
            events = await read_events(redis_client, Keys(batch_stack), r["request_id"])
            assert events[-1].get("lane") == "batch"
            text = "".join(p["text"] for item in body["output"] for p in item["content"])
            assert text == text_of(events)
            fields = {k: v for k, v in line["body"].items() if k != "store"}
            alone = await oai.responses.create(**fields)       # the route, the same request: the same answer
            assert alone.output_text == text and alone.previous_response_id == body["previous_response_id"]
            if line["body"].get("store", True):
                assert (await oai.responses.with_raw_response.retrieve(body["id"])).http_response.json() == body
            else:
                with pytest.raises(openai.NotFoundError):
                    await oai.responses.retrieve(body["id"])
        assert out[1]["response"]["body"]["metadata"] == {"k": "v"}
        assert [(a["custom_id"], a["response"]["status_code"], a["response"]["body"]["error"]["param"]) for a in err] \
            == [("streamed", 400, "stream"), ("background", 400, "background"),
                ("unknown-previous", 404, "previous_response_id")]


async def test_cancel_answers_every_line_once(redis_server, redis_client, batch_stack):
    lines = [chat_line(i, max_tokens=64, ignore_eos=True) for i in range(30)]
    async with gateway_in_process(settings(redis_server, batch_stack, batch_concurrency=2)) as gw:
        oai = client(gw)
        uploaded = await oai.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")

        async def some_done() -> bool:
            return (await oai.batches.retrieve(batch.id)).request_counts.completed >= 2
        assert await eventually(some_done, timeout=120, interval=0.2)
        cancelling = await oai.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch, _ = await finished(oai, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at
        out = [json.loads(x) for x in (await oai.files.content(batch.output_file_id)).text.splitlines()]
        err = [json.loads(x) for x in (await oai.files.content(batch.error_file_id)).text.splitlines()]
        ids = [a["custom_id"] for a in out + err]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(30)) and len(out) >= 2
        assert any(a["error"] and a["error"]["code"] == "batch_cancelled" for a in err)
        assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)
        with pytest.raises(openai.ConflictError):
            await oai.batches.cancel(batch.id)


async def test_malformed_lines_and_limits_are_reported(redis_server, batch_stack):
    async with gateway_in_process(settings(redis_server, batch_stack, batch_file_max_bytes=4096)) as gw:
        oai = client(gw)
        bad = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
               b'not json\n'
               b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
               b'{"custom_id": "b", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n'
               b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
               b'{"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": []}\n')
        with pytest.raises(openai.BadRequestError) as caught:
            await oai.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
        body = caught.value.body
        assert body["code"] == "invalid_batch_file" and body["param"] == "file"
        assert [e["line"] for e in body["lines"]] == [2, 3, 4, 5, 6]
        assert [e["param"] for e in body["lines"][1:]] == ["custom_id", "method", "url", "body"]
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.files.create(file=("big.jsonl", io.BytesIO(jsonl([chat_line(i) for i in range(40)]))),
                                   purpose="batch")
        assert caught.value.status_code == 413 and caught.value.body["code"] == "file_too_large"
        with pytest.raises(openai.BadRequestError) as caught:
            await oai.files.create(file=("x.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="fine-tune")
        assert caught.value.body["param"] == "purpose"
        good = await oai.files.create(file=("ok.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        for kwargs, param in ((dict(endpoint="/v1/embeddings"), "endpoint"),
                              (dict(completion_window="1h"), "completion_window")):
            with pytest.raises(openai.BadRequestError) as caught:
                await oai.batches.create(**{"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h", **kwargs})
            assert caught.value.body["param"] == param, caught.value.body


async def test_another_key_gets_404(redis_server, batch_stack):
    async with gateway_in_process(settings(redis_server, batch_stack)) as gw:
        alice, bob = client(gw, "alice"), client(gw, "bob")
        uploaded = await alice.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        batch = await alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
        for call in (lambda: bob.files.retrieve(uploaded.id), lambda: bob.files.content(uploaded.id),
                     lambda: bob.files.delete(uploaded.id), lambda: bob.batches.retrieve(batch.id),
                     lambda: bob.batches.cancel(batch.id),
                     lambda: bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call()
        assert [b async for b in bob.batches.list()] == [] and [f async for f in bob.files.list()] == []
        done, _ = await finished(alice, batch.id)
        assert done.status == "completed"
        with pytest.raises(openai.NotFoundError):
            await bob.files.content(done.output_file_id)
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/v1/batches")).status_code == 401      # no key at all

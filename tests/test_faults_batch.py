"""A batch survives the death of the process running it, with every line answered exactly once
and no request run twice: the gateway running it SIGKILLed (another replica takes its lease and
re-attaches to the lines in flight), a worker SIGKILLed (its requests continue on another), and
Redis restarted from its AOF. Real processes throughout; the client is the official `openai`
package, and the answers are checked against the worker's record in Redis.
"""

from __future__ import annotations

import asyncio
import io
import json
import signal

import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from shared.streams import Keys
from tests.gateway_client import eventually
from tests.stack_fixtures import start_gateway, start_workers
from tests.worker_redis import read_events, text_of

MODEL = "SmolLM2-135M-Instruct"
# RESUME_GRACE_S and GATEWAY_TTL_S at their defaults (5 s each): the replica that takes a dead
# runner's batch over re-attaches to its lines in flight before they would be cancelled as orphans
GW_ENV = {"PER_KEY_CONCURRENCY": 64, "PER_KEY_RATE_PER_MIN": 100000, "BATCH_CONCURRENCY": 4}
FAST_CLAIM = {"CLAIM_IDLE_MS": 1500, "WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2}
LINES = 32


def batch_file(n: int) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story {i}."}], "max_tokens": 24,
                 "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n)).encode()


def client(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=3, timeout=60)


async def start_batch(base: str) -> str:
    oai = client(base)
    uploaded = await oai.files.create(file=("faults.jsonl", io.BytesIO(batch_file(LINES))), purpose="batch")
    return (await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")).id


async def progress_reaches(base: str, batch_id: str, count: int) -> None:
    async def reached() -> bool:
        return (await client(base).batches.retrieve(batch_id)).request_counts.completed >= count
    assert await eventually(reached, timeout=120, interval=0.2)


async def check_exactly_once(redis, prefix: str, base: str, batch_id: str, *, one_request_per_line: bool) -> None:
    oai = client(base)

    async def done() -> bool:
        return (await oai.batches.retrieve(batch_id)).status in ("completed", "failed", "cancelled", "expired")
    assert await eventually(done, timeout=180, interval=0.25)
    batch = await oai.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts.total == batch.request_counts.completed == LINES, batch.request_counts
    out = [json.loads(x) for x in (await oai.files.content(batch.output_file_id)).text.splitlines()]
    assert [a["custom_id"] for a in out] == [f"line-{i}" for i in range(LINES)]          # each once, in order
    for answer in out:
        events = await read_events(redis, Keys(prefix), answer["response"]["request_id"])
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "length", events[-1]
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == text_of(events)
        assert answer["response"]["body"]["usage"]["completion_tokens"] == 24
    if one_request_per_line:      # no line was run twice: one request each, and only those
        metas = [k async for k in redis.scan_iter(match=f"{prefix}:{{r:*}}:meta", count=1000)]
        assert len(metas) == LINES, len(metas)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_gateway_running_a_batch_dies_another_finishes_it(redis_server, redis_client, stream_prefix,
                                                                tiny_model_dir, tmp_path, sig):
    """SIGKILL: liveness declares it dead and the survivor takes the lease; SIGTERM: its drain
    releases the lease and parks the lines in flight. Either way the survivor re-attaches."""
    workers = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ["w0"])
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=GW_ENV)
    gw_b = None
    try:
        batch_id = await start_batch(base_a)
        await progress_reaches(base_a, batch_id, 3)       # gw-a (the only replica) runs it
        gw_a.signal(sig)                                    # mid-batch, lines in flight
        gw_a.popen.wait(30)
        # the survivor starts only now: started before the kill, it took seconds on a loaded box,
        # and gw-a could finish every line meanwhile (no takeover to see)
        gw_b, base_b = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=GW_ENV)
        await check_exactly_once(redis_client, stream_prefix, base_b, batch_id, one_request_per_line=True)
        if sig == signal.SIGKILL:
            assert "taken over from gateway" in gw_b.log()
    finally:
        for p in [gw_a, gw_b, *workers]:
            if p is not None:
                p.stop()


async def test_worker_sigkilled_mid_batch(redis_server, redis_client, stream_prefix, tiny_model_dir, tmp_path):
    workers = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ["w0", "w1"], env=FAST_CLAIM)
    gw, base = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw", env=GW_ENV)
    try:
        batch_id = await start_batch(base)
        await progress_reaches(base, batch_id, 3)
        workers[0].signal(signal.SIGKILL)
        await check_exactly_once(redis_client, stream_prefix, base, batch_id, one_request_per_line=True)
    finally:
        for p in [gw, *workers]:
            p.stop()


async def test_redis_restarted_mid_batch(tiny_model_dir, tmp_path):
    """Redis (AOF) restarts under a running batch: it still completes with each line answered
    once (a line whose request failed for the outage runs again under its next attempt)."""
    from shared.localredis import LocalRedis
    server = LocalRedis(appendonly=True).start()
    redis = aioredis.from_url(server.url)
    workers = start_workers(server.url, "rb", tiny_model_dir, tmp_path, ["w0"], env={"CLAIM_IDLE_MS": 3000})
    gw, base = start_gateway(server.url, "rb", tmp_path, name="gw-rr", env=GW_ENV)
    try:
        batch_id = await start_batch(base)
        await progress_reaches(base, batch_id, 3)
        await asyncio.to_thread(server.restart, down_for=1.0)
        await check_exactly_once(redis, "rb", base, batch_id, one_request_per_line=False)
    finally:
        gw.stop()
        for p in workers:
            p.stop()
        await redis.aclose()
        server.stop()

"""Background responses (issue 35 item 3) across process deaths, with real processes: the gateway
that started a background response is SIGKILLed while a client streams it (the client re-attaches
on another gateway with `starting_after` and misses nothing, sees nothing twice; the survivor's
orphan sweep leaves the response running), and the worker running one is SIGKILLed (another
worker continues it; the stream and the poll end with every token exact).

Exactness is checked against the request's own history in Redis (the worker's record) through
the official `openai` SDK."""

from __future__ import annotations

import signal

import pytest
from openai import AsyncOpenAI

from shared.streams import Keys
from tests.gateway_client import eventually
from tests.stack_fixtures import start_gateway, start_workers
from tests.worker_redis import history, owner_of, text_of, wait_for_tokens

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Tell me a long story about a lighthouse."
GW_ENV = {"RESUME_GRACE_S": 0.5, "GATEWAY_TTL_S": 1, "GATEWAY_HEARTBEAT_S": 0.2, "SWEEP_INTERVAL_S": 0.1,
          "FLUSH_INTERVAL_MS": 30}
FAST_CLAIM = {"CLAIM_IDLE_MS": 1500, "WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2, "MAX_SEQ_LEN": 2048}


def client(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


async def finished(c: AsyncOpenAI, resp_id: str):
    polls = []

    async def ended():
        polls.append(await c.responses.retrieve(resp_id))
        return polls[-1].status not in ("queued", "in_progress")
    assert await eventually(ended, timeout=120, interval=0.1), polls[-1].status
    return polls[-1]


def deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def check_exact(seen: list, final, events: list[dict], max_tokens: int) -> None:
    """The events a client holds continue each other exactly, carry the whole output and end the
    way the worker ended the request (its final in the history, `events`). The tiny random model
    at temperature 1.0 samples its end-of-sequence token before `max_tokens` in about 2% of such
    runs: then the response is `completed` with fewer tokens, which is not a fault. Anything else
    (a cancel, an error such as output_lost) is."""
    end = events[-1]
    assert end["k"] == "done" and end["finish_reason"] in ("length", "stop"), end
    tokens = end["usage"]["completion_tokens"]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    if end["finish_reason"] == "length":
        assert tokens == max_tokens
        assert seen[-1].type == "response.incomplete" and seen[-1].response.status == "incomplete"
        assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    else:
        assert tokens < max_tokens
        assert seen[-1].type == "response.completed" and seen[-1].response.status == "completed"
        assert final.status == "completed" and final.incomplete_details is None
    assert deltas(seen) == text_of(events) == final.output_text
    assert final.usage.output_tokens == tokens


async def test_background_response_survives_its_gateways_death(redis_server, redis_client, stream_prefix,
                                                               tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    workers = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ["w0"],
                            env={"MAX_SEQ_LEN": 2048})
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=GW_ENV)
    gw_b, base_b = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=GW_ENV)
    try:
        a, b = client(base_a), client(base_b)
        stream = await a.responses.create(model=MODEL, input=PROMPT, max_output_tokens=1200, temperature=1.0,
                                          background=True, stream=True)
        seen = []
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 30:
                break
        resp_id = seen[0].response.id
        rid = resp_id.removeprefix("resp_")
        gw_a.signal(signal.SIGKILL)                     # the gateway vanishes, no goodbye
        gw_a.popen.wait(10)
        try:
            async for event in stream:                  # what was in flight still counts
                seen.append(event)
        except Exception:
            pass
        # gw-b finds gw-a dead and parks its requests as orphans; its sweep must leave this one be
        assert await eventually(lambda: redis_client.zscore(keys.orphans, f"{rid}|0"), timeout=30, interval=0.05)
        assert await eventually(lambda: _gone(redis_client, keys, rid), timeout=30, interval=0.05)
        # still running, or already ended: at max_output_tokens (incomplete), or by the model's own
        # end-of-sequence token (completed; see check_exact), never cancelled or failed
        assert (await b.responses.retrieve(resp_id)).status in ("in_progress", "incomplete", "completed")
        rest = [e async for e in await b.responses.retrieve(resp_id, stream=True,
                                                            starting_after=seen[-1].sequence_number)]
        final = await finished(b, resp_id)
        events = await history(redis_client, keys, rid)
        check_exact(seen + rest, final, events, 1200)
        assert not await redis_client.exists(keys.cancel(rid)), "no sweep or takeover cancelled it"
    finally:
        for p in [gw_a, gw_b, *workers]:
            p.stop()


async def _gone(redis, keys: Keys, rid: str) -> bool:
    return await redis.zscore(keys.orphans, f"{rid}|0") is None


async def test_background_response_survives_its_workers_death(redis_server, redis_client, stream_prefix,
                                                              tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    procs = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ("wa", "wb"), env=FAST_CLAIM)
    gw, base = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw", env=GW_ENV)
    try:
        c = client(base)
        r = await c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=800, temperature=1.0,
                                     background=True)
        rid = r.id.removeprefix("resp_")
        stream = await c.responses.retrieve(r.id, stream=True)     # a client attached through the kill
        seen = []
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta":
                break
        await wait_for_tokens(redis_client, keys, rid, 20)
        owner = await owner_of(redis_client, keys, rid)
        victim = next(p for p, name in zip(procs, ("wa", "wb")) if name == owner)
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        seen += [e async for e in stream]
        final = await finished(c, r.id)
        events = await history(redis_client, keys, rid)
        assert {e["ep"] for e in events} == {1, 2}, "the survivor continued it"
        check_exact(seen, final, events, 800)
        again = [e async for e in await c.responses.retrieve(r.id, stream=True, starting_after=5)]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in seen[6:]]
    finally:
        for p in [gw, *procs]:
            p.stop()

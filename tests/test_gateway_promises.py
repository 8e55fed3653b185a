"""Promises of docs/protocol.md that need a real worker, checked through the gateway as a client
sees them: a client that stops reading is really closed as `slow_consumer`, worker-side errors
arrive as `done` with `finish_reason: "error"`, stop/seed/priority/DEFAULT_MAX_TOKENS reach the
model, and a cancel of a request still in the queue ends it.

One worker (tiny model, MAX_BATCH 2 so a third request waits in the queue, MAX_PROMPT_TOKENS 64)
serves the module; each test starts its own in-process gateway.
"""

from __future__ import annotations

import asyncio
import json
import time

from tests.gateway_client import GatewayClient, eventually, masked_frame, open_raw_socket, send_until_blocked
from tests.stack_fixtures import StackSpec, gateway_in_process
from tests.worker_redis import worker_info

LONG = 1500


STACK = StackSpec("w-promises", env={"MAX_BATCH": "2", "MAX_PROMPT_TOKENS": "64", "WORKER_HEARTBEAT_S": "0.5"},
                  gateway=dict(resume_grace_s=0, sweep_interval_s=0.1))


async def run(c: GatewayClient, cid: str, **params) -> tuple[str, list[dict], dict]:
    await c.generate(cid, **params)
    chunks, done = await c.until_done(cid, timeout=60)
    return "".join(ch["text"] for ch in chunks), chunks, done


async def test_a_client_that_stops_reading_is_closed_as_slow_consumer(make_settings):
    """Issue 13 item 4: 16 long requests on a socket with a 4 KiB receive buffer that never
    reads. Within SLOW_CONSUMER_S (+ the time to fill the kernel buffers) the server drops the
    TCP connection, counts it, and another client streams meanwhile."""
    settings = make_settings(slow_consumer_s=2.0, flush_interval_ms=0, socket_send_buffer=16384)
    async with gateway_in_process(settings) as gw:
        sock = await asyncio.to_thread(open_raw_socket, "127.0.0.1", gw.port, rcvbuf=4096)
        frames = b"".join(masked_frame(json.dumps({"type": "generate", "id": f"s{i}", "max_tokens": LONG,
                                                   "prompt": "Tell me everything " * 4}).encode())
                          for i in range(16))
        assert await asyncio.to_thread(send_until_blocked, sock, frames) == len(frames)
        other = await GatewayClient.connect(gw.ws_url)
        t0 = time.monotonic()
        _, _, done = await run(other, "fast", max_tokens=50)
        assert done["type"] == "done" and done["finish_reason"] in ("length", "stop")
        assert await eventually(lambda: gw.probe.metric("gateway_slow_consumer_closes_total") >= 1, timeout=90, interval=0.1), \
            "the non-reading client was never closed"
        assert gw.probe.metric("gateway_slow_consumer_closes_total") == 1
        assert await eventually(lambda: gw.probe.sessions == 1, timeout=5)   # only the reading client remains
        print(f"non-reading client dropped after {time.monotonic() - t0:.1f}s")
        sock.close()
        await other.close()


async def test_prompt_over_max_prompt_tokens_is_done_with_context_too_long(make_settings):
    async with gateway_in_process(make_settings()) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        text, chunks, done = await run(c, "big", prompt="word " * 300, max_tokens=5)
        assert not chunks and done["type"] == "done" and done["finish_reason"] == "error"
        assert done["error"]["code"] == "context_too_long" and done["error"]["retryable"] is False
        await c.close()


async def test_default_max_tokens_seed_and_stop_reach_the_model(make_settings):
    async with gateway_in_process(make_settings(default_max_tokens=7)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        _, chunks, done = await run(c, "d", temperature=0.0)            # no max_tokens: the server default
        assert done["usage"]["completion_tokens"] == 7 and done["finish_reason"] == "length" or \
            (done["finish_reason"] == "stop" and done["usage"]["completion_tokens"] < 7), done

        a, _, _ = await run(c, "s1", temperature=1.0, seed=11, max_tokens=24)
        b, _, _ = await run(c, "s2", temperature=1.0, seed=11, max_tokens=24)
        other, _, _ = await run(c, "s3", temperature=1.0, seed=12, max_tokens=24)
        assert a == b and a != other                                   # seeded sampling replays exactly

        full, _, _ = await run(c, "g", temperature=0.0, max_tokens=40)
        assert len(full) > 12, full
        stop = full[len(full) // 2:len(full) // 2 + 3]
        cut, _, done = await run(c, "st", temperature=0.0, max_tokens=40, stop=[stop])
        assert done["finish_reason"] == "stop" and cut == full[:full.index(stop)], (full, stop, cut)

        text, _, done = await run(c, "b", temperature=0.0, max_tokens=10, priority="batch")
        assert done["finish_reason"] in ("length", "stop") and text == full[:len(text)]
        await c.close()


async def test_cancel_of_a_request_still_in_the_queue(make_settings, stack, redis_client):
    # the gateway's own fallback (it ends a cancel no worker confirmed) cannot fire within this
    # test: a `cancelled` that comes at all came from the worker
    async with gateway_in_process(make_settings(cancel_fallback_s=3600)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        for cid in ("busy1", "busy2"):                                # MAX_BATCH 2: the worker is full
            await c.generate(cid, prompt="Once", max_tokens=LONG)
            assert (await c.recv(cid))["type"] == "chunk"
        await c.generate("queued", prompt="Once", max_tokens=LONG)

        async def queued_in_the_engine() -> bool:                  # its registry entry, every heartbeat
            return (await worker_info(redis_client, stack.keys, STACK.name)).get("waiting") == "1"
        assert await eventually(queued_in_the_engine, timeout=30)
        await c.send(type="cancel", id="queued")
        chunks, done = await c.until_done("queued", timeout=30)
        assert done["finish_reason"] == "cancelled" and not chunks
        for cid in ("busy1", "busy2"):
            await c.send(type="cancel", id=cid)
            _, done = await c.until_done(cid)
            assert done["finish_reason"] == "cancelled"
        await c.close()

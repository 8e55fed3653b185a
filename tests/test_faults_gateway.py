"""Faults on the gateway side of the backbone, with real processes throughout: a gateway
SIGKILLed mid-stream (the client resumes on another gateway), and 500 concurrent streams
through two gateways and two workers with every token accounted for against the worker's
record (the output streams in Redis)."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest
import websockets

from shared.streams import Keys
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import start_gateway, start_workers
from tests.worker_redis import check_client_stream, history, text_of

GW_ENV = {"PER_KEY_CONCURRENCY": 2000, "PER_KEY_RATE_PER_MIN": 100000, "MAX_QUEUE_DEPTH": 5000,
          "FLUSH_INTERVAL_MS": 30, "RESUME_GRACE_S": 10}


async def test_gateway_killed_mid_stream_client_resumes_elsewhere(redis_server, redis_client, stream_prefix,
                                                                  tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    workers = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ["w0"])
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=GW_ENV)
    gw_b, base_b = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=GW_ENV)
    try:
        a = await GatewayClient.connect(base_a.replace("http", "ws") + "/v1/stream")
        rid = await a.generate("s1", max_tokens=800)
        seen = await a.chunks("s1", 20)
        gw_a.signal(signal.SIGKILL)                      # the gateway vanishes, no goodbye
        gw_a.popen.wait(10)
        with pytest.raises(Exception):
            while True:
                msg = await a.recv("s1", timeout=10)
                seen.append(msg)                          # chunks already in flight still count
        b = await GatewayClient.connect(base_b.replace("http", "ws") + "/v1/stream")
        await b.send(type="resume", id="s1", last_seq=seen[-1]["seq"], request_id=rid)
        assert (await b.recv("s1"))["type"] == "accepted"
        rest, done = await b.until_done("s1", timeout=60)
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        events = await history(redis_client, keys, rid)
        text = text_of(events)
        assert "".join(ch["text"] for ch in seen + rest) == text             # nothing lost, nothing twice
        assert sum(ch["tokens"] for ch in seen + rest) == 800
        assert done["seq"] == sum(e["n"] for e in events if e["k"] == "tok")
        await b.close()
    finally:
        for p in [gw_a, gw_b, *workers]:
            p.stop()


async def test_500_concurrent_streams_two_gateways_two_workers(redis_server, redis_client, stream_prefix,
                                                               tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    workers = start_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, ["w0", "w1"],
                            env={"MAX_BATCH": 64, "MAX_SEQ_LEN": 256})
    gws = [start_gateway(redis_server.url, stream_prefix, tmp_path, name=f"gw{i}", env=GW_ENV) for i in range(2)]
    sockets_per_gw, per_socket = 10, 25                    # 2 x 10 x 25 = 500 streams
    rng = random.Random(5)
    try:
        async def one_socket(base: str, s: int) -> list[tuple[str, str, list[dict], dict, dict]]:
            client = await GatewayClient.connect(base.replace("http", "ws") + "/v1/stream")
            specs = []
            for i in range(per_socket):
                cid = f"s{s}-{i}"
                params = dict(prompt=f"Story {s} {i}:", max_tokens=rng.randint(4, 16),
                              temperature=rng.choice([0.0, 0.8]))
                await client.send(type="generate", id=cid, **params)
                specs.append((cid, params))
            results = []
            for cid, params in specs:
                accepted = await client.recv(cid, timeout=60)
                assert accepted["type"] == "accepted", accepted
                chunks, done = await client.until_done(cid, timeout=120)
                results.append((cid, accepted["request_id"], chunks, done, params))
            await client.close()
            return results

        jobs = [one_socket(base, g * 100 + s) for g, (_, base) in enumerate(gws) for s in range(sockets_per_gw)]
        results = [r for rs in await asyncio.gather(*jobs) for r in rs]
        assert len(results) == 500
        assert len({rid for _, rid, *_ in results}) == 500
        for cid, rid, chunks, done, params in results:
            assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), (cid, done)
            await check_client_stream(redis_client, keys, rid, chunks, done)
            assert done["usage"]["completion_tokens"] <= params["max_tokens"]
        served = [await redis_client.hget(keys.worker(f"w{i}"), "steps") for i in range(2)]
        assert all(int(s) > 0 for s in served), served       # both workers took part
    finally:
        for p, _ in gws:
            p.stop()
        for p in workers:
            p.stop()


async def test_redis_restarted_mid_stream_through_the_gateway(tiny_model_dir, tmp_path):
    """Redis (AOF on) restarts while a client streams through gateway and worker: the client
    gets the whole answer or a clear retryable error it can resume from — never a hang — and
    after resuming, every token the worker recorded."""
    import redis.asyncio as aioredis
    from shared.localredis import LocalRedis

    server = LocalRedis(appendonly=True).start()
    client_redis = aioredis.from_url(server.url)
    keys = Keys("rg")
    workers = start_workers(server.url, "rg", tiny_model_dir, tmp_path, ["w0"], env={"CLAIM_IDLE_MS": 3000})
    gw, base = start_gateway(server.url, "rg", tmp_path, name="gw-rr", env=GW_ENV)
    url = base.replace("http", "ws") + "/v1/stream"
    try:
        a = await GatewayClient.connect(url)
        rid = await a.generate("r1", max_tokens=600)
        seen = await a.chunks("r1", 20)
        await asyncio.to_thread(server.restart, down_for=1.0)
        final = None
        try:
            while final is None:
                msg = await a.recv("r1", timeout=30)   # a hang is a TimeoutError and fails the test
                if msg["type"] == "chunk":
                    seen.append(msg)
                else:
                    final = msg
        except websockets.ConnectionClosed as exc:  # the gateway may close the socket: an outcome, not a hang
            final = {"type": "closed", "exc": repr(exc)}
        if final["type"] != "done":
            assert final["type"] == "closed" or final.get("retryable") or final.get("error", {}).get("retryable"), final
            b = await GatewayClient.connect(url)
            await b.send(type="resume", id="r1", last_seq=seen[-1]["seq"] if seen else 0, request_id=rid)
            assert (await b.recv("r1", timeout=30))["type"] == "accepted"
            rest, final = await b.until_done("r1", timeout=60)
            seen += rest
            await b.close()
        assert final["type"] == "done" and final["finish_reason"] == "length", final
        events = await history(client_redis, keys, rid)
        text = text_of(events)
        assert "".join(ch["text"] for ch in seen) == text
        assert sum(ch["tokens"] for ch in seen) == 600
    finally:
        gw.stop()
        for p in workers:
            p.stop()
        await client_redis.aclose()
        server.stop()

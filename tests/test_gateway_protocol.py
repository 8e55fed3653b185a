"""The gateway's edge without a worker: bad frames, floods, auth, Origin, health, admission.

Each test runs a real uvicorn server (in this event loop) against the session's real Redis and
talks to it over a real WebSocket.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgpack
import pytest
import websockets

from gateway.auth import hash_key
from gateway.settings import GatewaySettings
from shared.errors import ErrorCode, ProtocolError
from shared.localredis import free_port
from shared.streams import Keys
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings


async def test_garbage_oversize_and_invalid_frames_get_typed_errors_and_the_socket_survives(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, max_frame_bytes=1024)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        cases = [
            ("not json at all", "bad_frame"),
            ("[1, 2, 3]", "bad_frame"),
            (json.dumps({"type": "fly"}), "unknown_type"),
            (json.dumps({"type": "generate", "prompt": "x"}), "missing_id"),
            (json.dumps({"type": "generate", "id": "a", "prompt": "x", "temperature": 9}), "invalid_request"),
            (json.dumps({"type": "generate", "id": "bad id!", "prompt": "x"}), "invalid_request"),
            (json.dumps({"type": "generate", "id": "a"}), "invalid_request"),
            (json.dumps({"v": 7, "type": "ping"}), "unsupported_version"),
            (json.dumps({"type": "ping", "pad": "x" * 2000}), "frame_too_large"),
            (json.dumps({"type": "generate", "id": "big", "prompt": "x" * 3000}), "frame_too_large"),
            (json.dumps({"type": "cancel", "id": "nope"}), "unknown_id"),
            (b"\xc1\xff\x00", "bad_frame"),                       # invalid msgpack on a binary frame
            (msgpack.packb([1, 2]), "bad_frame"),
        ]
        for frame, code in cases:
            await c.ws.send(frame)
            reply = await c.recv_any()
            assert reply["type"] == "error" and reply["code"] == code, (frame[:40], reply)
            assert reply["retryable"] is False
        await c.send(type="ping", nonce="still-alive")
        assert (await c.recv_any())["nonce"] == "still-alive"
        await c.close()


async def test_limits_on_prompt_and_max_tokens(redis_server, stream_prefix):
    settings = gateway_settings(redis_server.url, stream_prefix, max_prompt_chars=100, max_tokens_cap=64)
    async with gateway_in_process(settings) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.send(type="generate", id="p", prompt="y" * 101)
        assert (await c.recv("p"))["code"] == "prompt_too_large"
        await c.send(type="generate", id="m", messages=[{"role": "user", "content": "z" * 60}] * 2)
        assert (await c.recv("m"))["code"] == "prompt_too_large"
        await c.send(type="generate", id="t", prompt="hi", max_tokens=65)
        err = await c.recv("t")
        assert err["code"] == "max_tokens_too_large" and "64" in err["message"]
        await c.close()


async def test_frame_beyond_the_websocket_limit_closes_only_that_socket(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, max_frame_bytes=1024)) as gw:
        other = await GatewayClient.connect(gw.ws_url)
        bad = await GatewayClient.connect(gw.ws_url, max_size=None)
        await bad.ws.send("x" * (gw.settings.ws_max_size_bytes + 10))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await bad.recv_any(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009     # required, not optional
        await other.send(type="ping", nonce=1)
        assert (await other.recv_any())["type"] == "pong"
        await other.close()


async def test_thousands_of_messages_per_second_are_all_answered_in_order(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, send_queue_max=100000, send_queue_max_bytes=2**24)) as gw:
        c = await GatewayClient.connect(gw.ws_url, binary=True)
        n = 4000
        t0 = time.monotonic()

        async def flood():
            for i in range(n):
                if i % 2:
                    await c.ws.send(b"\x93garbage")   # truncated msgpack
                else:
                    await c.send(type="ping", nonce=i)

        sender = asyncio.create_task(flood())
        replies = [await c.recv_any(timeout=30) for _ in range(n)]
        await sender
        elapsed = time.monotonic() - t0
        assert [r["nonce"] for r in replies if r["type"] == "pong"] == list(range(0, n, 2))
        assert sum(r["type"] == "error" and r["code"] == "bad_frame" for r in replies) == n // 2
        print(f"{n} frames answered in {elapsed:.2f}s ({n / elapsed:.0f}/s)")
        await c.close()


async def test_msgpack_subprotocol_is_negotiated(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url, binary=True)
        assert c.ws.subprotocol == "llm-stream.msgpack"
        await c.send(type="ping", nonce=5)
        raw = await c.ws.recv()
        assert isinstance(raw, bytes) and msgpack.unpackb(raw)["type"] == "pong"
        await c.close()


async def test_api_keys_header_query_first_message_and_rejections(redis_server, stream_prefix):
    keys = f"alice:{hash_key('sk-alice')},bob:{hash_key('sk-bob')}"
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, api_keys=keys, auth_timeout_s=0.5)) as gw:
        for kwargs in ({"headers": {"Authorization": "Bearer sk-alice"}}, {"url": gw.ws_url + "?api_key=sk-bob"}):
            c = await GatewayClient.connect(kwargs.get("url", gw.ws_url), headers=kwargs.get("headers"))
            await c.send(type="ping", nonce="ok")
            assert (await c.recv_any())["type"] == "pong"
            await c.close()

        c = await GatewayClient.connect(gw.ws_url)            # browser style: key in the first message
        await c.send(type="auth", api_key="sk-alice")
        await c.send(type="ping", nonce="ok")
        assert (await c.recv_any())["type"] == "pong"
        await c.close()

        for how in ("bad-header", "no-key-then-generate", "silent", "bad-first-message", "bad-key-after-header"):
            headers = {"Authorization": "Bearer sk-wrong"} if how == "bad-header" else \
                {"Authorization": "Bearer sk-alice"} if how == "bad-key-after-header" else None
            c = await GatewayClient.connect(gw.ws_url, headers=headers)
            if how == "no-key-then-generate":
                await c.send(type="generate", id="x", prompt="hi")
            elif how in ("bad-first-message", "bad-key-after-header"):
                await c.send(type="auth", api_key="sk-mallory")
            err = await c.recv_any(timeout=5)
            assert err["type"] == "error" and err["code"] == "unauthorized", (how, err)
            with pytest.raises(websockets.ConnectionClosed) as info:
                await c.recv_any(timeout=5)
            assert info.value.rcvd.code == 1008, how


async def test_origin_allow_list(redis_server, stream_prefix):
    settings = gateway_settings(redis_server.url, stream_prefix, allowed_origins="https://chat.example.com")
    async with gateway_in_process(settings) as gw:
        ok = await GatewayClient.connect(gw.ws_url, origin="https://chat.example.com")
        await ok.send(type="ping")
        assert (await ok.recv_any())["type"] == "pong"
        await ok.close()
        same = await GatewayClient.connect(gw.ws_url, origin=f"http://127.0.0.1:{gw.port}")  # its own page
        await same.send(type="ping")
        assert (await same.recv_any())["type"] == "pong"
        await same.close()
        evil = await GatewayClient.connect(gw.ws_url, origin="https://evil.example.net")
        err = await evil.recv_any()
        assert err["code"] == "origin_not_allowed"


async def test_no_live_worker_means_overloaded_not_a_silent_queue(redis_server, stream_prefix, redis_client):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.send(type="generate", id="g", prompt="hello")
        err = await c.recv("g")
        assert err["type"] == "error" and err["code"] == "overloaded" and err["retryable"] is True
        assert await redis_client.xlen(Keys(stream_prefix).requests) == 0   # nothing was queued
        await c.close()


async def test_healthz_readyz_metrics_and_page(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/healthz")).status_code == 200
            async def ready() -> bool:
                return (await http.get("/readyz")).status_code == 200
            assert await eventually(ready, timeout=5, interval=0.05)
            assert (await http.get("/readyz")).json()["ready"] is True
            c = await GatewayClient.connect(gw.ws_url)
            await c.ws.send("junk")
            await c.recv_any()
            text = (await http.get("/metrics")).text
            assert "gateway_active_sockets 1.0" in text
            assert 'gateway_rejections_total{code="bad_frame"} 1.0' in text
            for name in ("gateway_ttft_seconds_bucket", "gateway_inter_chunk_seconds_bucket", "gateway_flushes_total"):
                assert name in text
            await c.close()
            page = await http.get("/")
            assert page.status_code == 200 and "/static/app.js" in page.text
            assert (await http.get("/static/app.js")).status_code == 200

    # a gateway whose Redis is unreachable is alive but not ready
    dead = GatewaySettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", stream_prefix=stream_prefix)
    async with gateway_in_process(dead) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 503


async def test_backlog_is_read_from_the_consumer_group(redis_client, stream_prefix):
    from shared.backlog import read_backlog
    from shared.streams import CONSUMER_GROUP, Keys

    keys = Keys(stream_prefix)
    assert (await read_backlog(redis_client, keys, 10)).depth == 0             # no stream yet
    for i in range(5):
        await redis_client.xadd(keys.requests, {"d": b"x"})
    assert (await read_backlog(redis_client, keys, 10)).queued == 5            # no group yet: all queued
    await redis_client.xgroup_create(keys.requests, CONSUMER_GROUP, id="0")
    await redis_client.xreadgroup(CONSUMER_GROUP, "w1", {keys.requests: ">"}, count=2)
    await redis_client.zadd(keys.workers, {"w1": int(time.time() * 1000), "stale": 1})
    backlog = await read_backlog(redis_client, keys, 10)
    assert (backlog.queued, backlog.pending, backlog.depth, backlog.live_workers) == (3, 2, 5, 1)


async def test_a_worker_that_missed_a_few_heartbeats_still_admits_work(redis_server, stream_prefix, redis_client):
    """After a Redis restart every worker's last heartbeat is a few seconds old for a moment
    (WORKER_TTL_S is 2 s, for fast failover): admission must not refuse new requests then; a
    worker silent for many TTLs does mean `overloaded`."""
    from gateway.admission import ADMISSION_GRACE_TTLS, Admission
    keys = Keys(stream_prefix)
    admission = Admission(redis_client, keys, max_depth=100, worker_ttl_s=2.0, cache_ms=0)
    now_ms = int(time.time() * 1000)
    await redis_client.zadd(keys.workers, {"w-paused": now_ms - 3_000})      # 1.5 TTLs ago
    await admission.admit()
    await redis_client.zadd(keys.workers, {"w-paused": now_ms - int(2_000 * ADMISSION_GRACE_TTLS) - 1_000})
    with pytest.raises(ProtocolError) as info:
        await admission.admit()
    assert info.value.code == ErrorCode.OVERLOADED


async def test_a_stale_backlog_admits_while_it_refreshes_but_never_refuses(redis_server, stream_prefix,
                                                                           redis_client, monkeypatch):
    """Past ADMISSION_CACHE_MS a snapshot that admits is still used (a user whose requests come
    seconds apart pays no round trip before `accepted`) and one background read, started after
    the request's submit, refreshes it; a snapshot that would refuse is never used past
    ADMISSION_CACHE_MS: admission reads first."""
    import gateway.admission as admission_module
    from gateway.admission import Admission
    from shared.backlog import read_backlog
    keys = Keys(stream_prefix)
    reads, release = [], asyncio.Event()

    async def held_read(*args):
        reads.append(args)
        await release.wait()
        return await read_backlog(*args)

    admission = Admission(redis_client, keys, max_depth=100, worker_ttl_s=2.0, cache_ms=200)
    await redis_client.zadd(keys.workers, {"w": int(time.time() * 1000) + 600_000})
    await admission.admit()                                   # the first read, inline
    monkeypatch.setattr(admission_module, "read_backlog", held_read)
    admission._at -= 1.0                                      # past cache_ms, within ADMISSION_STALE_S
    await asyncio.wait_for(admission.admit(), 5)              # admitted, no read on its path
    assert len(reads) == 0
    admission.refresh_if_due()                                # after its submit: the read starts
    await asyncio.wait_for(admission.admit(), 5)              # admitted while the read is held
    admission.refresh_if_due()                                # still one read in flight, not two
    await asyncio.sleep(0)
    assert len(reads) == 1
    await redis_client.zrem(keys.workers, "w")                # the fleet is gone meanwhile
    release.set()
    await asyncio.wait_for(admission._refresh, 5)             # the refresh lands: no live worker
    with pytest.raises(ProtocolError) as info:
        await admission.admit()
    assert info.value.code == ErrorCode.OVERLOADED
    # a refusing snapshot past cache_ms is read again before it answers: a worker that came up is seen
    await redis_client.zadd(keys.workers, {"w": int(time.time() * 1000) + 600_000})
    admission._at -= 1.0
    await admission.admit()
    assert len(reads) == 2 and admission._snapshot.live_workers == 1
    # past ADMISSION_STALE_S even an admitting snapshot is read inline
    admission._at -= admission_module.ADMISSION_STALE_S
    reads_before = len(reads)
    await admission.admit()
    admission.refresh_if_due()
    assert len(reads) == reads_before + 1
    await admission.stop()

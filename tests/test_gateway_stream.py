"""Gateway end to end: real Redis, a real `python -m worker` on the tiny model, real sockets.

One worker serves the whole module (its start-up dominates); each test starts its own gateway
(in this event loop, or as a `python -m gateway` subprocess for the SIGTERM test) with the
settings it needs.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import httpx
import msgpack
import pytest
import websockets

from gateway.auth import hash_key
from shared.streams import ENTRY_FIELD
from tests.gateway_client import GatewayClient, eventually, masked_frame
from tests.stack_fixtures import Stack, StackSpec, gateway_in_process, start_gateway
from tests.worker_redis import history, read_events, text_of

LONG = 1500   # max_tokens for a request that must still be running when the test acts on it


STACK = StackSpec("w-gateway", env={"MAX_BATCH": "32", "WORKER_HEARTBEAT_S": "0.5"},
                  gateway=dict(resume_grace_s=0, sweep_interval_s=0.1))


async def wait_final(redis_client, stack: Stack, rid: str, timeout: float = 30.0) -> dict:
    return (await read_events(redis_client, stack.keys, rid, timeout=timeout))[-1]


# ---------------------------------------------------------------------------- streaming


async def test_stream_is_chunked_first_token_at_once_and_matches_the_worker_output(make_settings, redis_client,
                                                                                  stack):
    async with gateway_in_process(make_settings(flush_interval_ms=1000, flush_max_tokens=8)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("s1", max_tokens=80)
        chunks, done = await c.until_done("s1")
        events = await history(redis_client, stack.keys, rid)
        n_events = sum(e["k"] == "tok" for e in events)
        n_tokens = sum(e["n"] for e in events if e["k"] == "tok")
        assert done["type"] == "done" and done["finish_reason"] in ("length", "stop")
        # the first event is not held back for the 8-token threshold (the worker sends its first
        # token at once; a second one made before that write joins it)
        first = next(e for e in events if e["k"] == "tok")
        assert chunks[0]["seq"] == first["seq"] < 8
        seqs = [ch["seq"] for ch in chunks]
        assert seqs == sorted(set(seqs)) and seqs[-1] == done["seq"] == n_tokens     # seq = tokens delivered
        # in between, chunks leave by the token threshold (the 1 s timer never fires): at least 8
        # tokens each, a few more when several events arrived while the sender was busy
        assert all(ch["tokens"] >= 8 for ch in chunks[1:-1]), [ch["tokens"] for ch in chunks]
        total = sum(ch["tokens"] for ch in chunks)
        assert len(chunks) <= total // 8 + 2 and len(chunks) <= n_events
        assert "".join(ch["text"] for ch in chunks) == text_of(events)
        assert sum(ch["tokens"] for ch in chunks) == done["usage"]["completion_tokens"]
        assert done["usage"]["ttft_ms"] <= done["usage"]["total_ms"]
        await c.close()


async def test_many_requests_multiplexed_on_one_socket_msgpack(make_settings, redis_client, stack):
    async with gateway_in_process(make_settings(flush_interval_ms=40)) as gw:
        c = await GatewayClient.connect(gw.ws_url, binary=True)
        ids = [f"m{i}" for i in range(12)]
        rids = {}
        for i, id in enumerate(ids):
            await c.send(type="generate", id=id, prompt=f"Story number {i}:", max_tokens=30, temperature=0.8, seed=i)
        for id in ids:
            accepted = await c.recv(id)
            assert accepted["type"] == "accepted", accepted
            rids[id] = accepted["request_id"]
        for id in ids:
            chunks, done = await c.until_done(id)
            assert done["type"] == "done" and done["finish_reason"] in ("length", "stop")
            events = await history(redis_client, stack.keys, rids[id])
            assert "".join(ch["text"] for ch in chunks) == text_of(events)
        await c.generate("m0", prompt="again", max_tokens=2)   # ids are reusable after done
        await c.until_done("m0")
        await c.close()


async def test_duplicate_id_and_per_socket_cap(make_settings):
    async with gateway_in_process(make_settings(max_requests_per_socket=2)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.generate("a", max_tokens=LONG)
        await c.send(type="generate", id="a", prompt="x")
        assert (await c.recv("a", skip=("heartbeat", "chunk")))["code"] == "duplicate_id"
        await c.generate("b", max_tokens=LONG)
        await c.send(type="generate", id="c", prompt="x")
        assert (await c.recv("c"))["code"] == "too_many_requests_on_socket"
        for id in ("a", "b"):
            await c.send(type="cancel", id=id)
            _, done = await c.until_done(id)
            assert done["finish_reason"] == "cancelled"
        await c.close()


async def test_a_first_token_that_beats_accepted_does_not_freeze_the_gateway(make_settings):
    """The worker can write a request's first token before the submit reply is back (a slow
    reply, a fast worker): the socket's sender then holds a request with output that it may not
    send yet, and must wait for `accepted` instead of spinning without yielding (which froze the
    whole gateway: found by bench/fanout.py)."""
    async with gateway_in_process(make_settings(flush_interval_ms=30)) as gw:
        def slow_reply(real_submit):
            async def submit(entry, **kwargs):
                await real_submit(entry, **kwargs)
                await asyncio.sleep(0.5)     # the reply is late: the worker's first tokens arrive first
            return submit

        gw.probe.intercept_submit(slow_reply)
        c = await GatewayClient.connect(gw.ws_url)
        await c.generate("f1", max_tokens=16, timeout=10)
        chunks, done = await c.until_done("f1", timeout=30)
        assert done["type"] == "done" and sum(ch["tokens"] for ch in chunks) == done["usage"]["completion_tokens"]
        await c.close()


# ---------------------------------------------------------------------------- cancel / disconnect


async def test_cancel_stops_the_worker_soon_after_it_lands(make_settings, redis_client, stack):
    async with gateway_in_process(make_settings(flush_interval_ms=0)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("c1", max_tokens=LONG)
        for _ in range(5):
            assert (await c.recv("c1"))["type"] == "chunk"
        await c.send(type="cancel", id="c1")
        chunks, done = await c.until_done("c1")
        assert done["finish_reason"] == "cancelled"
        final = await wait_final(redis_client, stack, rid)
        assert final["k"] == "done" and final["finish_reason"] == "cancelled"
        # where the cancel reached the worker: the entry on its control stream (its id carries
        # Redis' clock in ms); the final event carries the worker's clock in `ms` (same host).
        # How fast a cancel lands is measured by bench/e2e.py (cancel -> done); this test only
        # checks that the generation stopped soon after, with a bound no loaded box can miss.
        ctl = [(eid, f) for eid, f in await redis_client.xrange(stack.keys.ctl("w-gateway"))
               if msgpack.unpackb(f[ENTRY_FIELD])["rid"] == rid]
        assert len(ctl) == 1
        ctl_ms = int(ctl[0][0].split(b"-")[0])
        assert final["ms"] - ctl_ms < 5000, final["ms"] - ctl_ms
        assert done["seq"] < LONG
        n = await redis_client.xlen(stack.keys.out(rid))
        await asyncio.sleep(0.3)
        assert await redis_client.xlen(stack.keys.out(rid)) == n    # nothing after done
        await c.close()


async def test_client_disconnect_mid_stream_cancels_the_generation(make_settings, redis_client, stack):
    async with gateway_in_process(make_settings(resume_grace_s=0)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("d1", max_tokens=LONG)
        assert (await c.recv("d1"))["type"] == "chunk"
        c.ws.transport.abort()                             # connection lost: no close frame
        final = await wait_final(redis_client, stack, rid, timeout=15)
        assert final["k"] == "done" and final["finish_reason"] == "cancelled"
        assert final["seq"] < LONG
        # the socket's concurrency slot and request are gone from this replica
        assert await eventually(lambda: gw.probe.sessions == 0, timeout=2.5)


async def test_disconnect_then_resume_on_another_replica_loses_nothing(make_settings, redis_client, stack):
    settings = make_settings(resume_grace_s=10, flush_interval_ms=30)
    async with gateway_in_process(settings) as gw_a, gateway_in_process(settings) as gw_b:
        a = await GatewayClient.connect(gw_a.ws_url)
        rid = await a.generate("r1", max_tokens=400)
        seen = await a.chunks("r1", 20)
        last_seq = seen[-1]["seq"]
        await a.close()                                    # connection lost mid-stream

        b = await GatewayClient.connect(gw_b.ws_url)
        await b.send(type="resume", id="r1", last_seq=last_seq, request_id=rid)
        accepted = await b.recv("r1")
        assert accepted == {"v": 1, "type": "accepted", "id": "r1", "request_id": rid}
        rest, done = await b.until_done("r1")
        assert done["type"] == "done" and done["finish_reason"] in ("length", "stop"), done
        assert rest[0]["seq"] > last_seq
        events = await history(redis_client, stack.keys, rid)
        assert "".join(ch["text"] for ch in seen + rest) == text_of(events)   # nothing lost, nothing twice
        assert done["seq"] == sum(e["n"] for e in events if e["k"] == "tok")
        await b.close()

        # resuming again from 0 replays everything from Redis, while output is retained
        c = await GatewayClient.connect(gw_a.ws_url)
        await c.send(type="resume", id="r1", last_seq=0, request_id=rid)
        assert (await c.recv("r1"))["type"] == "accepted"
        again, done2 = await c.until_done("r1")
        assert "".join(ch["text"] for ch in again) == text_of(events) and done2["seq"] == done["seq"]
        await c.send(type="resume", id="never-existed", last_seq=0, request_id=uuid.uuid4().hex)
        assert (await c.recv("never-existed"))["code"] == "resume_expired"
        await c.close()


async def test_unresumed_orphan_is_cancelled_after_the_grace(make_settings, redis_client, stack):
    async with gateway_in_process(make_settings(resume_grace_s=0.5)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("o1", max_tokens=LONG)
        assert (await c.recv("o1"))["type"] == "chunk"
        t0 = time.monotonic()
        await c.close()
        final = await wait_final(redis_client, stack, rid, timeout=15)
        assert final["finish_reason"] == "cancelled" and final["seq"] < LONG
        assert time.monotonic() - t0 >= 0.4            # it did wait for a resume first


# ---------------------------------------------------------------------------- backpressure / liveness


async def test_slow_client_is_cut_off_without_slowing_others(make_settings):
    # a small SO_SNDBUF: the non-reader's sends block after ~100 KB, not after the kernel's 4 MiB
    settings = make_settings(send_queue_max=64, slow_consumer_s=1.0, flush_interval_ms=0, socket_send_buffer=16384)
    async with gateway_in_process(settings) as gw:
        # a client that never reads: its TCP window fills, sends block, pongs pile up
        slow = await GatewayClient.connect(gw.ws_url, max_queue=1, ping_interval=None)
        for i in range(3):
            await slow.send(type="generate", id=f"s{i}", prompt="Tell me everything", max_tokens=LONG)
        fast = await GatewayClient.connect(gw.ws_url)

        async def flood():
            blob = "p" * 1000
            try:
                for i in range(20000):
                    await slow.send(type="ping", nonce=f"{i}{blob}")
            except websockets.ConnectionClosed:
                pass

        flooder = asyncio.create_task(flood())
        t0 = time.monotonic()
        await fast.generate("f1", max_tokens=200)
        _, done = await fast.until_done("f1", timeout=60)
        assert done["type"] == "done" and done["finish_reason"] in ("length", "stop")
        fast_s = time.monotonic() - t0
        await asyncio.wait_for(flooder, 60)
        assert await eventually(lambda: gw.probe.metric("gateway_slow_consumer_closes_total") >= 1, timeout=10)
        assert gw.probe.metric("gateway_slow_consumer_closes_total") == 1
        assert gw.probe.sessions == 1                  # only the fast client remains
        print(f"fast client finished 200 tokens in {fast_s:.2f}s next to a non-reading client")
        await fast.close()


async def test_heartbeats_on_idle_socket_and_dead_client_detected(make_settings, redis_client, stack):
    settings = make_settings(heartbeat_s=0.3, ws_ping_s=0.3, ping_timeout_s=0.5)
    async with gateway_in_process(settings) as gw:
        idle = await GatewayClient.connect(gw.ws_url)
        msg = await idle.recv_any(timeout=3)
        assert msg["type"] == "heartbeat"
        await idle.close()

        # a client that vanished without a FIN: it never answers protocol pings
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"101" in head.split(b"\r\n")[0]
        writer.write(masked_frame(
            b'{"type":"generate","id":"z","prompt":"hello","max_tokens":%d,"temperature":0}' % LONG))
        await writer.drain()
        def its_rid() -> str | None:
            return next((rid for _, rid in gw.probe.requests()), None)
        assert await eventually(its_rid, timeout=2)
        rid = its_rid()
        final = await wait_final(redis_client, stack, rid, timeout=20)
        assert final["finish_reason"] == "cancelled"
        writer.close()



# ---------------------------------------------------------------------------- limits / admission


async def test_per_key_concurrency_is_shared_across_replicas_and_rate_limit(make_settings):
    keys = f"team:{hash_key('sk-team')}"
    settings = make_settings(api_keys=keys, per_key_concurrency=2, per_key_rate_per_min=5)
    headers = {"Authorization": "Bearer sk-team"}
    async with gateway_in_process(settings) as gw_a, gateway_in_process(settings) as gw_b:
        for gw in (gw_a, gw_b):                    # one fixed rate window (a clock minute) for the whole test
            gw.probe.set_rate_clock(lambda: 600.0)
        a = await GatewayClient.connect(gw_a.ws_url, headers=headers)
        b = await GatewayClient.connect(gw_b.ws_url, headers=headers)
        await a.generate("k1", max_tokens=LONG)
        await b.generate("k2", max_tokens=LONG)
        await b.send(type="generate", id="k3", prompt="x", max_tokens=5)
        err = await b.recv("k3")
        assert err["code"] == "concurrency_limit" and err["retryable"] is True
        await a.send(type="cancel", id="k1")
        await a.until_done("k1")
        await b.generate("k3", max_tokens=2)                   # a slot is free again
        await b.until_done("k3")
        await b.generate("k4", prompt="x", max_tokens=2)   # 5th attempt this minute: ok
        await b.until_done("k4")
        await b.send(type="generate", id="k5", prompt="x", max_tokens=2)   # 6th: rate limited
        assert (await b.recv("k5"))["code"] == "rate_limited"
        await b.send(type="cancel", id="k2")
        await b.until_done("k2")
        await a.close()
        await b.close()


# ---------------------------------------------------------------------------- graceful shutdown


async def test_sigterm_tells_clients_to_resume_elsewhere(redis_server, stack, make_settings,
                                                         tmp_path, redis_client):
    proc, base = start_gateway(redis_server.url, stack.prefix, tmp_path,
                               env={"RESUME_GRACE_S": "10", "HEARTBEAT_S": "0"})
    try:
        c = await GatewayClient.connect(base.replace("http", "ws") + "/v1/stream")
        rid = await c.generate("g1", max_tokens=300)
        seen = [await c.recv("g1")]
        proc.signal(signal.SIGTERM)
        while True:
            msg = await c.recv_any(timeout=10)
            if msg["type"] == "chunk":
                seen.append(msg)
            else:
                break
        assert msg["type"] == "error" and msg["code"] == "shutting_down" and msg["retryable"] is True
        with pytest.raises(websockets.ConnectionClosed) as info:
            await c.recv_any(timeout=10)
        assert info.value.rcvd.code == 1012 and "resume" in info.value.rcvd.reason
        assert proc.popen.wait(20) == 0

        async with gateway_in_process(make_settings()) as other:
            d = await GatewayClient.connect(other.ws_url)
            await d.send(type="resume", id="g1", last_seq=seen[-1]["seq"], request_id=rid)
            accepted = await d.recv("g1")
            assert accepted["type"] == "accepted", accepted
            rest, done = await d.until_done("g1")
            assert done["finish_reason"] in ("length", "stop")
            events = await history(redis_client, stack.keys, rid)
            assert "".join(ch["text"] for ch in seen + rest) == text_of(events)
            await d.close()
    finally:
        proc.stop()


async def test_metrics_count_outcomes_ttft_and_flushes(make_settings):
    async with gateway_in_process(make_settings()) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.generate("x1", max_tokens=20)
        await c.until_done("x1")
        async with httpx.AsyncClient(base_url=gw.base) as http:
            text = (await http.get("/metrics")).text
        assert 'gateway_requests_total{outcome="length"} 1.0' in text or \
               'gateway_requests_total{outcome="stop"} 1.0' in text
        assert "gateway_ttft_seconds_count 1.0" in text
        flushes = float(next(line.split()[1] for line in text.splitlines() if line.startswith("gateway_flushes_total")))
        assert flushes >= 1
        await c.close()

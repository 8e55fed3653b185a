"""Issue 13 at the gateway's edge, as a client sees it (no model worker needed): invalid Unicode,
strict typing, bounded memory per socket, socket caps, resume authorization, the progress
watchdog, sender failures, ADMIN_TOKEN and AUTH_REQUIRED.

Requests that must be accepted without a model register a "worker" in the live-worker registry
that never takes anything: exactly a worker that went silent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import msgpack
import pytest
import redis.asyncio as aioredis
import websockets

from gateway.auth import hash_key
from shared.streams import Keys, RequestEntry
from tests.gateway_client import GatewayClient, eventually, masked_frame, open_raw_socket, read_until_reset, send_until_blocked
from tests.stack_fixtures import gateway_in_process, gateway_settings
from tests.worker_redis import silent_worker


async def assert_alive(c: GatewayClient, nonce: str = "alive") -> None:
    await c.send(type="ping", nonce=nonce)
    reply = await c.recv(None, timeout=5, skip=("heartbeat", "error"))
    assert reply["type"] == "pong" and reply["nonce"] == nonce, reply


async def closed_with(c: GatewayClient, timeout: float = 10) -> int | None:
    """Read until the socket closes; the close code the server sent (a hang fails the test)."""
    with pytest.raises(websockets.ConnectionClosed) as info:
        deadline = time.monotonic() + timeout
        while True:
            await c.recv_any(timeout=max(0.01, deadline - time.monotonic()))
    return info.value.rcvd.code if info.value.rcvd else None


# ---------------------------------------------------------------------------- item 1: Unicode

LONE = "\\ud800"   # a JSON escape of a lone surrogate, as the frame carries it


@pytest.mark.parametrize("frame", [
    '{"type":"generate","id":"u1","prompt":"a%sb"}' % LONE,
    '{"type":"generate","id":"u2","messages":[{"role":"user","content":"%s"}]}' % LONE,
    '{"type":"generate","id":"u3%s","prompt":"x"}' % LONE,
    '{"type":"ping","nonce":"%s"}' % LONE,
    '{"type":"generate","id":"u4","prompt":"x","stop":["%s"]}' % LONE,
    '{"type":"auth","api_key":"%s"}' % LONE,
    '{"type":"generate","id":"u5","prompt":"x","%s":1}' % LONE,
], ids=["prompt", "content", "id", "nonce", "stop", "auth", "key"])
async def test_lone_surrogates_anywhere_get_invalid_request_and_the_socket_lives(redis_server, stream_prefix,
                                                                                 redis_client, frame):
    await silent_worker(redis_client, Keys(stream_prefix))
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.ws.send(frame)
        reply = await c.recv_any(timeout=5)
        assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
        assert "Unicode" in reply["message"]
        await assert_alive(c)
        # a valid surrogate pair (an emoji) is fine
        await c.ws.send('{"type":"ping","nonce":"\\ud83d\\ude00"}')
        assert (await c.recv_any(timeout=5))["nonce"] == "\U0001F600"
        assert not await redis_client.xlen(Keys(stream_prefix).requests)    # nothing was queued
        await c.close()


async def test_a_failing_sender_closes_the_socket_with_a_typed_error(redis_server, stream_prefix):
    """Fault injection: the first send on the socket raises. The client must get `internal`
    and a close, never an open socket that stays silent."""
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, heartbeat_s=0.2)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await eventually(lambda: gw.probe.sessions, timeout=1)
        failed = gw.probe.fail_next_send(ValueError("injected encoder bug"))
        await c.send(type="ping", nonce="x")
        reply = await c.recv_any(timeout=5)
        assert reply["type"] == "error" and reply["code"] == "internal" and reply["retryable"] is True
        assert await closed_with(c) == 1011
        assert failed and gw.probe.metric("gateway_sender_failures_total") == 1
        await eventually(lambda: gw.probe.sessions == 0, timeout=2)
        assert gw.probe.sessions == 0


# ---------------------------------------------------------------------------- item 3: typing, Origin

async def test_strict_types_json_and_msgpack(redis_server, stream_prefix, redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        j = await GatewayClient.connect(gw.ws_url)
        for bad in ({"max_tokens": "10"}, {"max_tokens": 10.5}, {"max_tokens": True}, {"temperature": "0.5"},
                    {"seed": "7"}, {"top_k": 2.0}):
            await j.send(type="generate", id="t", prompt="hi", **bad)
            reply = await j.recv("t")
            assert reply["type"] == "error" and reply["code"] == "invalid_request", (bad, reply)
        await j.generate("ok", prompt="hi", max_tokens=10, temperature=0)   # int for a float: fine
        await j.close()

        m = await GatewayClient.connect(gw.ws_url, binary=True)
        for bad in ({"prompt": b"binary prompt"}, {"messages": [{"role": "user", "content": b"bytes"}]},
                    {"prompt": "x", "stop": [b"bytes"]}):
            await m.ws.send(msgpack.packb({"type": "generate", "id": "b", **bad}, use_bin_type=True))
            reply = await m.recv("b")
            assert reply["type"] == "error" and reply["code"] == "invalid_request", (bad, reply)
        await assert_alive(m)
        await m.close()


async def test_refused_origin_gets_the_error_frame_before_close_1008(redis_server, stream_prefix):
    settings = gateway_settings(redis_server.url, stream_prefix, allowed_origins="https://chat.example.com")
    async with gateway_in_process(settings) as gw:
        for binary in (False, True):
            evil = await GatewayClient.connect(gw.ws_url, binary=binary, origin="https://evil.example.net")
            err = await evil.recv_any()
            assert err["type"] == "error" and err["code"] == "origin_not_allowed" and err["retryable"] is False
            assert await closed_with(evil) == 1008


async def test_json_is_spoken_when_no_subprotocol_is_offered(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        ws = await websockets.connect(gw.ws_url)
        assert ws.subprotocol is None
        await ws.send(json.dumps({"type": "ping", "nonce": 3}))
        raw = await asyncio.wait_for(ws.recv(), 5)
        assert isinstance(raw, str) and json.loads(raw)["type"] == "pong"
        await ws.close()


# ---------------------------------------------------------------------------- item 7: memory bounds

async def test_pong_nonce_is_bounded(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        await c.send(type="ping", nonce="n" * 64)
        assert (await c.recv_any())["nonce"] == "n" * 64
        for nonce in ("n" * 65, 2**60, [1, 2], {"a": 1}):
            await c.send(type="ping", nonce=nonce)
            reply = await c.recv_any()
            assert reply["type"] == "error" and reply["code"] == "invalid_request", (nonce, reply)
            assert len(reply["message"]) < 400
        await assert_alive(c)
        await c.close()


async def test_a_fast_pipelining_client_is_slowed_not_cut_off(redis_server, stream_prefix):
    """Thousands of pings sent at once with default queue bounds: replies are held back by
    backpressure on the reader, every one is answered, nobody is called a slow consumer."""
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, send_queue_max=16,
                                               send_queue_max_bytes=2048)) as gw:
        c = await GatewayClient.connect(gw.ws_url, binary=True)
        n = 3000
        sender = asyncio.ensure_future(asyncio.gather(*[c.send(type="ping", nonce=i) for i in range(n)]))
        replies = [await c.recv_any(timeout=30) for _ in range(n)]
        await sender
        assert [r["nonce"] for r in replies] == list(range(n))
        assert gw.probe.metric("gateway_slow_consumer_closes_total") == 0
        await c.close()


async def test_a_client_that_stops_reading_holds_bounded_control_bytes_and_is_closed(redis_server, stream_prefix):
    """A real socket with a 4 KiB receive buffer floods pings and reads nothing: the replies
    waiting for it stay within SEND_QUEUE_MAX_BYTES, and once a send has been blocked for
    SLOW_CONSUMER_S the TCP connection is really dropped (not just marked)."""
    bound = 20_000
    settings = gateway_settings(redis_server.url, stream_prefix, send_queue_max_bytes=bound, slow_consumer_s=1.0,
                            sweep_interval_s=0.1)
    async with gateway_in_process(settings) as gw:
        sock = await asyncio.to_thread(open_raw_socket, "127.0.0.1", gw.port, rcvbuf=4096)
        frames = masked_frame(json.dumps({"type": "ping", "nonce": "n" * 64}).encode()) * 100_000
        flooder = asyncio.create_task(asyncio.to_thread(send_until_blocked, sock, frames))
        peak = 0

        def closed_as_slow() -> bool:            # the control queue's size sampled meanwhile
            nonlocal peak
            peak = max(peak, gw.probe.metric("gateway_control_queue_bytes"))
            return gw.probe.metric("gateway_slow_consumer_closes_total") >= 1
        assert await eventually(closed_as_slow, timeout=30, interval=0.01)
        assert gw.probe.metric("gateway_slow_consumer_closes_total") == 1
        assert 0 < peak <= bound, peak
        await eventually(lambda: gw.probe.sessions == 0, timeout=10)     # the socket is really gone on the server
        assert gw.probe.sessions == 0 and gw.probe.metric("gateway_control_queue_bytes") == 0
        await flooder
        assert await asyncio.to_thread(read_until_reset, sock), "the server did not drop the connection"
        sock.close()


async def test_sockets_per_address_and_per_key_are_capped(redis_server, stream_prefix):
    keys = f"team:{hash_key('sk-team')}"
    settings = gateway_settings(redis_server.url, stream_prefix, max_sockets_per_address=3, max_sockets_per_key=2,
                            api_keys=keys)
    headers = {"Authorization": "Bearer sk-team"}
    async with gateway_in_process(settings) as gw:
        a = await GatewayClient.connect(gw.ws_url, headers=headers)
        b = await GatewayClient.connect(gw.ws_url, headers=headers)
        third = await GatewayClient.connect(gw.ws_url, headers=headers)            # 3rd socket of the key
        err = await third.recv_any()
        assert err["code"] == "too_many_sockets" and err["retryable"] is True
        assert await closed_with(third) == 1013
        browser = await GatewayClient.connect(gw.ws_url)                             # 3rd of the address
        await browser.send(type="auth", api_key="sk-team")                           # key cap applies at auth too
        err = await browser.recv_any()
        assert err["code"] == "too_many_sockets"
        await closed_with(browser)
        await a.close()
        await eventually(lambda: gw.probe.sockets_of_key("team") < 2, timeout=2)
        c = await GatewayClient.connect(gw.ws_url, headers=headers)                  # a slot is free again
        await assert_alive(c)
        d = await GatewayClient.connect(gw.ws_url)                                   # 3rd of the address (b, c, d)
        e = await GatewayClient.connect(gw.ws_url)                                   # 4th: refused at the handshake
        err = await e.recv_any()
        assert err["code"] == "too_many_sockets" and "address" in err["message"]
        assert await closed_with(e) == 1013
        for ws in (b, c, d):
            await ws.close()
        async with httpx.AsyncClient(base_url=gw.base) as http:
            text = (await http.get("/metrics")).text
        assert 'gateway_rejections_total{code="too_many_sockets"} 3.0' in text


# ---------------------------------------------------------------------------- item 6: resume authorization

async def start(c: GatewayClient, cid: str) -> str:
    rid = await c.generate(cid, prompt="hello", max_tokens=5)
    assert len(rid) == 32 and int(rid, 16) >= 0          # request ids: 128 bits, hex
    return rid


async def test_resume_needs_the_request_id_and_the_same_key(redis_server, stream_prefix, redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    keys = f"alice:{hash_key('sk-alice')},bob:{hash_key('sk-bob')}"
    settings = gateway_settings(redis_server.url, stream_prefix, api_keys=keys, resume_grace_s=30)
    alice_h, bob_h = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    async with gateway_in_process(settings) as gw:
        phone = await GatewayClient.connect(gw.ws_url, headers=alice_h)
        laptop = await GatewayClient.connect(gw.ws_url, headers=alice_h)
        # two devices of one key use the same client id: each keeps its own request
        rid_phone = await start(phone, "r1")
        rid_laptop = await start(laptop, "r1")
        assert rid_phone != rid_laptop
        await phone.close()
        await laptop.close()

        bob = await GatewayClient.connect(gw.ws_url, headers=bob_h)
        await bob.send(type="resume", id="r1", last_seq=0)                       # no request_id
        reply = await bob.recv("r1")
        assert reply["code"] == "invalid_request" and "request_id" in reply["message"]
        await bob.send(type="resume", id="r1", last_seq=0, request_id=rid_phone)  # another key's request
        assert (await bob.recv("r1"))["code"] == "resume_expired"
        await bob.send(type="resume", id="r1", last_seq=0, request_id="0" * 32)   # unknown id: same answer
        assert (await bob.recv("r1"))["code"] == "resume_expired"
        await bob.close()

        for rid in (rid_phone, rid_laptop):
            again = await GatewayClient.connect(gw.ws_url, headers=alice_h)
            await again.send(type="resume", id="r1", last_seq=0, request_id=rid)
            accepted = await again.recv("r1")
            assert accepted["type"] == "accepted" and accepted["request_id"] == rid
            await again.send(type="cancel", id="r1")
            await again.close()


async def test_anonymous_sockets_have_their_own_identity_and_resume_by_request_id(redis_server, stream_prefix,
                                                                                  redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, resume_grace_s=30,
                                               per_key_concurrency=1)) as gw:
        a = await GatewayClient.connect(gw.ws_url)
        b = await GatewayClient.connect(gw.ws_url)
        rid_a = await start(a, "same")
        await start(b, "same")            # per-key concurrency 1: anonymous sockets do not share a key
        ids = {key_id for key_id, _ in gw.probe.requests()}
        assert len(ids) == 2 and all(i.startswith("anon:") for i in ids)
        await a.close()
        c = await GatewayClient.connect(gw.ws_url)
        await c.send(type="resume", id="mine", last_seq=0, request_id=rid_a)
        accepted = await c.recv("mine")
        assert accepted["type"] == "accepted" and accepted["request_id"] == rid_a
        await c.close()
        await b.close()


async def test_resume_attempts_are_rate_limited_per_socket(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, resume_rate_per_min=3)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        codes = []
        for i in range(5):
            await c.send(type="resume", id=f"g{i}", last_seq=0, request_id=f"{i:032x}")
            codes.append((await c.recv(f"g{i}"))["code"])
        assert codes == ["resume_expired"] * 3 + ["rate_limited"] * 2, codes   # the minute starts at the first
        await assert_alive(c)
        await c.close()


def test_the_resume_budget_is_a_minute_from_the_first_attempt():
    from gateway.resume import ResumeBudget
    from shared.errors import ProtocolError
    now = [119.5]          # just before a clock minute ends: the burst still counts as one minute
    budget = ResumeBudget(2, clock=lambda: now[0])
    budget.take("a")
    now[0] = 120.5
    budget.take("b")
    with pytest.raises(ProtocolError) as info:
        budget.take("c")
    assert info.value.code == "rate_limited" and info.value.request_id == "c"
    now[0] = 179.25
    with pytest.raises(ProtocolError):
        budget.take("d")
    now[0] = 179.5         # a minute after the first attempt: a new budget
    budget.take("e")
    budget.take("f")


# ---------------------------------------------------------------------------- item 9: progress watchdog

async def test_a_request_without_progress_ends_stalled_and_retryable(redis_server, stream_prefix, redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    settings = gateway_settings(redis_server.url, stream_prefix, request_stall_s=0.6, sweep_interval_s=0.1)
    async with gateway_in_process(settings) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        t0 = time.monotonic()
        rid = await start(c, "s")
        key_id = next(key_id for key_id, _ in gw.probe.requests())
        chunks, done = await c.until_done("s", timeout=10)
        waited = time.monotonic() - t0
        assert not chunks and done["type"] == "done" and done["finish_reason"] == "error"
        assert done["error"]["code"] == "stalled" and done["error"]["retryable"] is True
        assert 0.5 <= waited < 5, waited
        assert gw.probe.metric("gateway_stalled_requests_total") == 1
        # a late worker will not run it (the cancel is written by housekeeping, beside the `done`)
        assert await eventually(lambda: redis_client.exists(Keys(stream_prefix).cancel(rid)), timeout=5)
        async def slot_free() -> bool:
            return await redis_client.zscore(Keys(stream_prefix).conc(key_id), rid) is None
        assert await eventually(slot_free, timeout=5)       # its slot is free (bookkeeping, beside the `done`)
        await assert_alive(c)
        await c.close()


# ---------------------------------------------------------------------------- auth promises

async def test_auth_required_with_no_keys_refuses_everyone(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, auth_required=True,
                                               auth_timeout_s=0.5)) as gw:
        for headers in (None, {"Authorization": "Bearer anything"}):
            c = await GatewayClient.connect(gw.ws_url, headers=headers)
            if headers is None:
                await c.send(type="auth", api_key="anything")
            err = await c.recv_any(timeout=5)
            assert err["type"] == "error" and err["code"] == "unauthorized"
            assert await closed_with(c) == 1008


async def test_admin_token_guards_the_metrics_endpoint(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, admin_token="s3cret")) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
            ok = await http.get("/metrics", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and "gateway_active_sockets" in ok.text
            assert (await http.get("/healthz")).status_code == 200        # probes stay open
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert (await http.get("/metrics")).status_code == 200      # no token configured: open


# ---------------------------------------------------------------------------- cancel, drain, retention

async def test_cancel_fallback_when_the_owning_worker_never_confirms(redis_server, stream_prefix, redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, cancel_fallback_s=0.8)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await start(c, "f")
        await redis_client.hset(Keys(stream_prefix).meta(rid), "owner", "ghost")   # taken by a worker that froze
        t0 = time.monotonic()
        await c.send(type="cancel", id="f")
        chunks, done = await c.until_done("f", timeout=10)
        waited = time.monotonic() - t0
        assert done["finish_reason"] == "cancelled" and not chunks
        assert 0.7 <= waited < 5, waited                          # it waited for the worker, then gave up
        await c.send(type="cancel", id="f")
        assert (await c.recv("f"))["code"] == "unknown_id"        # finished: nothing left to cancel
        await c.close()


async def is_ready(http) -> bool:
    return (await http.get("/readyz")).status_code == 200


async def test_draining_readyz_503_and_shutting_down(redis_server, stream_prefix):
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert await eventually(lambda: is_ready(http), timeout=5, interval=0.05)
            drain = asyncio.create_task(gw.probe.drain(timeout=5))
            err = await c.recv_any(timeout=5)
            assert err["type"] == "error" and err["code"] == "shutting_down" and err["retryable"] is True
            assert await closed_with(c) == 1012
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["draining"] is True
            late = await GatewayClient.connect(gw.ws_url)             # a socket opened while draining
            assert (await late.recv_any())["code"] == "shutting_down"
            assert await closed_with(late) == 1012
            await drain


async def test_resume_expired_after_output_ttl(redis_server, stream_prefix, redis_client):
    await silent_worker(redis_client, Keys(stream_prefix))
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, output_ttl_s=1,
                                               resume_grace_s=30)) as gw:
        a = await GatewayClient.connect(gw.ws_url)
        rid = await start(a, "t")
        await a.close()
        b = await GatewayClient.connect(gw.ws_url)
        await b.send(type="resume", id="t", last_seq=0, request_id=rid)    # within the TTL: fine
        assert (await b.recv("t"))["type"] == "accepted"
        await b.close()
        await asyncio.sleep(2.2)
        c = await GatewayClient.connect(gw.ws_url)
        await c.send(type="resume", id="t", last_seq=0, request_id=rid)
        reply = await c.recv("t")
        assert reply["type"] == "error" and reply["code"] == "resume_expired" and reply["retryable"] is False
        await c.close()


async def test_admission_admits_exactly_max_queue_depth(redis_server, stream_prefix, redis_client):
    """The limit is pinned: with nothing taken off the queue, exactly MAX_QUEUE_DEPTH requests
    are accepted (within one cached backlog snapshot and across fresh reads alike)."""
    await silent_worker(redis_client, Keys(stream_prefix))
    for cache_ms in (60_000, 0):
        prefix = f"{stream_prefix}{cache_ms}"
        await silent_worker(redis_client, Keys(prefix))
        async with gateway_in_process(gateway_settings(redis_server.url, prefix, max_queue_depth=3,
                                                   admission_cache_ms=cache_ms)) as gw:
            c = await GatewayClient.connect(gw.ws_url)
            replies = []
            for i in range(6):
                await c.send(type="generate", id=f"q{i}", prompt="x", max_tokens=5)
                replies.append(await c.recv(f"q{i}"))
            assert [r["type"] for r in replies] == ["accepted"] * 3 + ["error"] * 3, (cache_ms, replies)
            assert {r["code"] for r in replies[3:]} == {"overloaded"}
            assert await redis_client.xlen(Keys(prefix).requests) == 3
            await c.close()


async def test_a_stalled_redis_does_not_hold_up_a_sockets_streams_or_its_done(tmp_path):
    """Nothing in a socket's send path waits on Redis: with Redis frozen (SIGSTOP) right after
    the gateway read a batch of live events, the socket still gets request A's tokens and its
    `done`, and request B's tokens behind it; B ends once Redis is back."""
    from shared.localredis import LocalRedis
    from shared.events import DoneEvent, DoneUsage, TokEvent
    from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, pack_event_list
    server = LocalRedis().start()
    redis = aioredis.from_url(server.url)
    keys = Keys("stall")
    try:
        await redis.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        await silent_worker(redis, Keys("stall"))
        # a long inbox BLOCK: the reader is certainly parked in XREAD when our XADD lands
        settings = gateway_settings(server.url, "stall", per_key_concurrency=4, flush_interval_ms=0,
                                    inbox_block_ms=600_000)
        async with gateway_in_process(settings) as gw:
            c = await GatewayClient.connect(gw.ws_url)
            for cid in ("A", "B"):
                await c.generate(cid, prompt="x", max_tokens=8)
            got = await redis.xreadgroup(CONSUMER_GROUP, "fake", {keys.requests: ">"}, count=2)
            entries = [RequestEntry.decode(f[ENTRY_FIELD]) for _, f in got[0][1]]
            rid = {("A", "B")[i]: e.rid for i, e in enumerate(entries)}   # submitted in this order
            gw_id = entries[0].gw
            batch = [TokEvent(rid["A"], 3, [1, 2, 3], "abc", 1, 0).encode(),
                     DoneEvent(rid["A"], 3, "length", DoneUsage(1, 3), 1, 0).encode(),
                     TokEvent(rid["B"], 2, [4, 5], "de", 1, 0).encode()]
            # (no history needed: the live events join up on their own)
            async def reader_blocked() -> bool:      # CLIENT LIST: the inbox XREAD is parked in Redis
                return any(c["cmd"] == "xread" and "b" in c["flags"] for c in await redis.client_list())
            assert await eventually(reader_blocked, timeout=15)
            await redis.xadd(keys.inbox(gw_id), {ENTRY_FIELD: pack_event_list(batch)})
            # Redis answers a blocked XREAD in the same pass as the XADD that wakes it: by the
            # time our XADD's reply is here, the gateway's batch is on its socket
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                chunks, done = await c.until_done("A", timeout=5)
                assert "".join(ch["text"] for ch in chunks) == "abc" and done["finish_reason"] == "length"
                assert done["seq"] == 3
                chunk_b = await c.recv("B", timeout=5)
                assert chunk_b["type"] == "chunk" and chunk_b["text"] == "de" and chunk_b["seq"] == 2
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            await redis.xadd(keys.inbox(gw_id), {ENTRY_FIELD: pack_event_list(
                [DoneEvent(rid["B"], 2, "stop", DoneUsage(1, 2), 1, 0).encode()])})
            _, done_b = await c.until_done("B", timeout=10)
            assert done_b["type"] == "done" and done_b["seq"] == 2
            # the bookkeeping held back while Redis was frozen is written once it is back
            async def left_our_set() -> bool:
                return not await redis.sismember(keys.gw_reqs(gw_id), rid["A"])
            assert await eventually(left_our_set, timeout=15)
            await c.close()
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        await redis.aclose()
        server.stop()

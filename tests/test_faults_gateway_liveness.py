"""Every accepted request ends, and its per-key slot is held exactly until then (issue 13 items 5
and 8), with real processes: worker and gateways as subprocesses, a real redis-server.

* a SIGKILLed gateway's requests are parked by a surviving gateway and cancelled after the
  resume grace, instead of running to completion with nobody listening;
* a client that drops its socket keeps its concurrency slot until the request ends, so a
  reconnect loop cannot run more than PER_KEY_CONCURRENCY requests at once;
* after a Redis restart, new requests work at once (no stale pooled connection refuses them) and
  no lease stays held after its request ended.
"""

from __future__ import annotations

import asyncio
import signal
import time

import redis.asyncio as aioredis

from gateway.auth import hash_key
from shared.localredis import LocalRedis
from shared.streams import ENTRY_FIELD, Keys, decode_event
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import _env, spawn, start_gateway, wait_for_worker

LONG = 3500      # tokens: far more than the tiny model makes in the few seconds a test waits
KEY, KEY_ID = "s3cret-liveness", "alice"     # a real API key: its limits are shared by all its sockets
AUTH = {"Authorization": f"Bearer {KEY}"}


def start_worker_proc(url: str, prefix: str, model_dir, log_dir, name: str = "w0", **env):
    proc = spawn("worker", _env(url, prefix, {"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "TORCH_THREADS": "1",
                                              "WORKER_ID": name, "MAX_SEQ_LEN": 4000, "MAX_BATCH": 64,
                                              "WORKER_HEARTBEAT_S": 0.5, **env}), log_dir, name)
    wait_for_worker(url, prefix, proc)
    return proc


def gw_env(**extra) -> dict:
    env = {"MAX_TOKENS_CAP": LONG, "PER_KEY_RATE_PER_MIN": 100000, "FLUSH_INTERVAL_MS": 30, "HEARTBEAT_S": 0,
           "GATEWAY_HEARTBEAT_S": 0.3, "GATEWAY_TTL_S": 1.5, "SWEEP_INTERVAL_S": 0.1,
           "API_KEYS": f"{KEY_ID}:{hash_key(KEY)}"}
    env.update(extra)
    return env


async def final_event(redis, keys: Keys, rid: str, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = await redis.xrevrange(keys.out(rid), count=1)
        if last:
            ev = decode_event(last[0][1][ENTRY_FIELD])
            if ev["k"] in ("done", "err"):
                return ev
        await asyncio.sleep(0.1)
    return None


async def generate(client: GatewayClient, cid: str, max_tokens: int = LONG, **params) -> dict:
    await client.send(type="generate", id=cid, prompt=params.pop("prompt", f"Story {cid}:"), max_tokens=max_tokens,
                      temperature=0.0, **params)
    return await client.recv(cid, timeout=30)


async def test_sigkilled_gateways_requests_are_parked_and_cancelled_by_a_survivor(redis_server, redis_client,
                                                                                  stream_prefix, tiny_model_dir,
                                                                                  tmp_path):
    keys = Keys(stream_prefix)
    worker = start_worker_proc(redis_server.url, stream_prefix, tiny_model_dir, tmp_path)
    env = gw_env(RESUME_GRACE_S=1)
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=env)
    gw_b, _ = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=env)
    try:
        a = await GatewayClient.connect(base_a.replace("http", "ws") + "/v1/stream", headers=AUTH)
        rids = []
        for i in range(3):
            accepted = await generate(a, f"k{i}")
            assert accepted["type"] == "accepted", accepted
            rids.append(accepted["request_id"])
        assert (await a.recv("k0", timeout=30))["type"] == "chunk"
        killed_at = time.monotonic()
        gw_a.signal(signal.SIGKILL)                          # no goodbye, nothing parked by gw-a itself
        gw_a.popen.wait(10)
        for rid in rids:
            final = await final_event(redis_client, keys, rid, timeout=30)
            assert final is not None, f"{rid} still running {time.monotonic() - killed_at:.0f}s after its gateway died"
            assert final["k"] == "done" and final["finish_reason"] == "cancelled", final
            assert final["seq"] < LONG
        # ... and the slots of those requests are free again: the worker releases a lease in the
        # round trip after the final's history write (docs/transport.md), well before it expires
        deadline = time.monotonic() + 5
        while await redis_client.zcard(keys.conc(KEY_ID)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await redis_client.zcard(keys.conc(KEY_ID)) == 0
        assert "is dead: parked 3" in gw_b.log()
    finally:
        for p in (gw_a, gw_b, worker):
            p.stop()


async def test_a_dropped_socket_keeps_its_slot_until_the_request_ends(redis_server, redis_client, stream_prefix,
                                                                      tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    worker = start_worker_proc(redis_server.url, stream_prefix, tiny_model_dir, tmp_path)
    gw, base = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw",
                             env=gw_env(PER_KEY_CONCURRENCY=1, RESUME_GRACE_S=30))
    url = base.replace("http", "ws") + "/v1/stream"
    try:
        a = await GatewayClient.connect(url, headers=AUTH)
        accepted = await generate(a, "x")
        assert accepted["type"] == "accepted", accepted
        rid = accepted["request_id"]
        assert (await a.recv("x", timeout=30))["type"] == "chunk"
        a.ws.transport.abort()                               # gone; the request waits for a resume
        await asyncio.sleep(0.5)
        b = await GatewayClient.connect(url, headers=AUTH)                 # a reconnect loop: new socket, new request
        refused = await generate(b, "y")
        assert refused["type"] == "error" and refused["code"] == "concurrency_limit", refused
        # the client resumes and cancels its first request: when it ends, the slot is free
        await b.send(type="resume", id="x", last_seq=0, request_id=rid)
        assert (await b.recv("x", timeout=30))["type"] == "accepted"
        await b.send(type="cancel", id="x")
        _, done = await b.until_done("x", timeout=30)
        assert done["finish_reason"] == "cancelled", done
        for _ in range(50):
            if await redis_client.zcard(keys.conc(KEY_ID)) == 0:
                break
            await asyncio.sleep(0.1)
        again = await generate(b, "z", max_tokens=5)
        assert again["type"] == "accepted", again
        _, done = await b.until_done("z", timeout=30)
        assert done["type"] == "done"
        await b.close()
    finally:
        gw.stop()
        worker.stop()


async def test_after_a_redis_restart_new_requests_work_at_once_and_no_lease_leaks(tiny_model_dir, tmp_path):
    server = LocalRedis(appendonly=True).start()
    prefix = "rr"
    keys = Keys(prefix)
    redis = aioredis.from_url(server.url)
    worker = start_worker_proc(server.url, prefix, tiny_model_dir, tmp_path)
    gw, base = start_gateway(server.url, prefix, tmp_path, name="gw",
                             env=gw_env(PER_KEY_CONCURRENCY=200, RESUME_GRACE_S=10, MAX_QUEUE_DEPTH=5000))
    url = base.replace("http", "ws") + "/v1/stream"
    try:
        # 20 streams running across the restart (each client keeps reading: nothing is orphaned)
        running = await GatewayClient.connect(url, headers=AUTH)
        rids = {}
        for i in range(20):
            accepted = await generate(running, f"run{i}", max_tokens=300)
            assert accepted["type"] == "accepted", accepted
            rids[f"run{i}"] = accepted["request_id"]
        await running.recv("run0", timeout=30)
        await asyncio.to_thread(server.restart, kill=True, down_for=1.5)

        async def one(i: int) -> dict:
            c = await GatewayClient.connect(url, headers=AUTH)
            try:
                reply = await generate(c, f"n{i}", max_tokens=8)
                if reply["type"] != "accepted":
                    return reply
                _, done = await c.until_done(f"n{i}", timeout=60)
                return done
            finally:
                await c.close()

        results = await asyncio.gather(*(one(i) for i in range(40)))
        refused = [r for r in results if r["type"] != "done"]
        assert not refused, f"{len(refused)} of 40 new requests failed right after the restart: {refused[:3]}"

        for cid in rids:   # every request that ran across the restart ends (whatever way), once
            while True:
                msg = await running.recv(cid, timeout=60)
                if msg["type"] in ("done", "error"):
                    break
        await running.close()
        # every request has ended: no lease may stay held (they would expire only after
        # CONCURRENCY_LEASE_S, refusing the key meanwhile)
        deadline = time.monotonic() + 5
        while await redis.zcard(keys.conc(KEY_ID)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        leaked = await redis.zrange(keys.conc(KEY_ID), 0, -1)
        assert not leaked, f"{len(leaked)} leases held after every request ended"
    finally:
        gw.stop()
        worker.stop()
        await redis.aclose()
        server.stop()

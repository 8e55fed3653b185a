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

import redis.asyncio as aioredis

from gateway.auth import hash_key
from shared.localredis import LocalRedis
from shared.streams import Keys
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import metric, scrape, start_gateway, start_worker
from tests.worker_redis import read_events

LONG = 3500      # tokens: far more than the tiny model makes in the few seconds a test waits
KEY, KEY_ID = "s3cret-liveness", "alice"     # a real API key: its limits are shared by all its sockets
AUTH = {"Authorization": f"Bearer {KEY}"}


def start_worker_proc(url: str, prefix: str, model_dir, log_dir):
    return start_worker(url, prefix, model_dir, log_dir, name="w0",
                        env={"MAX_SEQ_LEN": 4000, "MAX_BATCH": 64, "WORKER_HEARTBEAT_S": 0.5})


def gw_env(**extra) -> dict:
    env = {"MAX_TOKENS_CAP": LONG, "PER_KEY_RATE_PER_MIN": 100000, "FLUSH_INTERVAL_MS": 30, "HEARTBEAT_S": 0,
           "GATEWAY_HEARTBEAT_S": 0.3, "GATEWAY_TTL_S": 1.5, "SWEEP_INTERVAL_S": 0.1,
           "API_KEYS": f"{KEY_ID}:{hash_key(KEY)}"}
    env.update(extra)
    return env


async def slots_free(redis, keys: Keys) -> bool:
    """No concurrency lease of the key is held."""
    return await redis.zcard(keys.conc(KEY_ID)) == 0


async def test_sigkilled_gateways_requests_are_parked_and_cancelled_by_a_survivor(redis_server, redis_client,
                                                                                  stream_prefix, tiny_model_dir,
                                                                                  tmp_path):
    keys = Keys(stream_prefix)
    worker = start_worker_proc(redis_server.url, stream_prefix, tiny_model_dir, tmp_path)
    env = gw_env(RESUME_GRACE_S=1)
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=env)
    gw_b, base_b = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=env)
    try:
        a = await GatewayClient.connect(base_a.replace("http", "ws") + "/v1/stream", headers=AUTH)
        rids = []
        for i in range(3):
            rids.append(await a.generate(f"k{i}", prompt=f"Story {i}:", max_tokens=LONG))
        assert (await a.recv("k0", timeout=30))["type"] == "chunk"
        gw_a.signal(signal.SIGKILL)                          # no goodbye, nothing parked by gw-a itself
        gw_a.popen.wait(10)
        for rid in rids:
            final = (await read_events(redis_client, keys, rid, timeout=30))[-1]    # not running on, unheard
            assert final["k"] == "done" and final["finish_reason"] == "cancelled", final
            assert final["seq"] < LONG
        # ... and the slots of those requests are free again: the worker releases a lease in the
        # round trip after the final's history write (docs/transport.md), well before it expires
        assert await eventually(lambda: slots_free(redis_client, keys), timeout=5)
        assert metric(await scrape(base_b + "/metrics"), "gateway_orphans_taken_over_total") == 3   # parked by gw-b
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
        rid = await a.generate("x", max_tokens=LONG)
        assert (await a.recv("x", timeout=30))["type"] == "chunk"
        a.ws.transport.abort()                               # gone; the request waits for a resume

        async def socket_gone() -> bool:
            return metric(await scrape(base + "/metrics"), "gateway_active_sockets") == 0
        assert await eventually(socket_gone, timeout=10)
        b = await GatewayClient.connect(url, headers=AUTH)                 # a reconnect loop: new socket, new request
        refused = await b.send_generate("y", max_tokens=LONG)
        assert refused["type"] == "error" and refused["code"] == "concurrency_limit", refused
        # the client resumes and cancels its first request: when it ends, the slot is free
        await b.send(type="resume", id="x", last_seq=0, request_id=rid)
        assert (await b.recv("x", timeout=30))["type"] == "accepted"
        await b.send(type="cancel", id="x")
        _, done = await b.until_done("x", timeout=30)
        assert done["finish_reason"] == "cancelled", done
        assert await eventually(lambda: slots_free(redis_client, keys), timeout=5)
        await b.generate("z", max_tokens=5)
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
            rids[f"run{i}"] = await running.generate(f"run{i}", max_tokens=300)
        await running.recv("run0", timeout=30)
        await asyncio.to_thread(server.restart, kill=True, down_for=1.5)

        async def one(i: int) -> dict:
            c = await GatewayClient.connect(url, headers=AUTH)
            try:
                reply = await c.send_generate(f"n{i}", max_tokens=8)
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
        await eventually(lambda: slots_free(redis, keys), timeout=5)
        leaked = await redis.zrange(keys.conc(KEY_ID), 0, -1)
        assert not leaked, f"{len(leaked)} leases held after every request ended"
    finally:
        gw.stop()
        worker.stop()
        await redis.aclose()
        server.stop()

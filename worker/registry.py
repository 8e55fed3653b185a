"""The worker's entry in the fleet registry: `p:{w:<id>}:info` (hash with capacity and load,
TTL `worker_ttl_s`) and its heartbeat score in the zset `p:{reg}:workers`.

Gateways read it (shared.backlog.live_workers) for admission control, operators to see
replicas, and health checks to tell a live worker from a stuck one: the hash only stays
while the worker's event loop keeps refreshing it.
"""

from __future__ import annotations

import os
import time

import redis.asyncio as aioredis

from shared.streams import CONSUMER_GROUP, Keys


def registry_fields(*, capacity: int, running: int, waiting: int, in_flight: int, kv_used: int,
                    kv_total: int, model: str, started_ms: int, steps: int, state: str, reason: str = "",
                    preemptions: int = 0, fenced: int = 0, dropped: int = 0, yielded: int = 0) -> dict:
    return {"reason": reason,
        "capacity": capacity, "running": running, "waiting": waiting, "in_flight": in_flight,
        "kv_free": max(0, kv_total - kv_used), "kv_total": kv_total, "model": model,
        "started_ms": started_ms, "pid": os.getpid(), "steps": steps, "state": state,
        "preemptions": preemptions,   # requests whose KV blocks were taken back to recompute (total)
        # ownership (totals): writes refused because another worker had taken the request over,
        # requests dropped for that reason, and entries delivered to us that we left to their
        # live owner (worker.intake.contests); a healthy fleet keeps the first two at 0
        "fenced": fenced, "dropped": dropped, "yielded": yielded,
        "heartbeat_ms": int(time.time() * 1000),
    }


async def heartbeat(redis: aioredis.Redis, keys: Keys, worker_id: str, fields: dict, ttl_s: float) -> None:
    now_ms = int(time.time() * 1000)
    # two slots ({w:id} and {reg}): one pipeline, no MULTI across them
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.worker(worker_id), mapping=fields)
        pipe.pexpire(keys.worker(worker_id), int(ttl_s * 1000))
        pipe.zadd(keys.workers, {worker_id: now_ms})
        # (silent workers leave the zset when a survivor has claimed their entries:
        # worker.intake.claims.Claims.claim_dead_workers -> forget_dead)
        await pipe.execute()


# KEYS: requests. ARGV: group, consumer. Removes the consumer only if it owns no pending entry
# (atomically: DELCONSUMER would drop its pending entries, i.e. lose requests).
DELETE_IDLE_CONSUMER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
return redis.pcall('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""


async def forget_dead(redis: aioredis.Redis, keys: Keys, worker_id: str) -> None:
    """A dead worker that owns nothing: its registry entry, control stream and group consumer go
    (keys stay bounded however many workers come and go)."""
    await redis.eval(DELETE_IDLE_CONSUMER, 1, keys.requests, CONSUMER_GROUP, worker_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(keys.workers, worker_id)
        pipe.delete(keys.worker(worker_id), keys.ctl(worker_id))
        await pipe.execute()


async def deregister(redis: aioredis.Redis, keys: Keys, worker_id: str) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(keys.workers, worker_id)
        pipe.delete(keys.worker(worker_id), keys.ctl(worker_id))
        await pipe.execute()

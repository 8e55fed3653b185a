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

from shared.streams import Keys


def registry_fields(*, capacity: int, running: int, waiting: int, in_flight: int, kv_used: int,
                    kv_total: int, model: str, started_ms: int, steps: int, state: str) -> dict:
    return {
        "capacity": capacity, "running": running, "waiting": waiting, "in_flight": in_flight,
        "kv_free": max(0, kv_total - kv_used), "kv_total": kv_total, "model": model,
        "started_ms": started_ms, "pid": os.getpid(), "steps": steps, "state": state,
        "heartbeat_ms": int(time.time() * 1000),
    }


async def heartbeat(redis: aioredis.Redis, keys: Keys, worker_id: str, fields: dict, ttl_s: float) -> None:
    now_ms = int(time.time() * 1000)
    # two slots ({w:id} and {reg}): one pipeline, no MULTI across them
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.worker(worker_id), mapping=fields)
        pipe.pexpire(keys.worker(worker_id), int(ttl_s * 1000))
        pipe.zadd(keys.workers, {worker_id: now_ms})
        # forget workers silent for 10 TTLs, so the zset does not grow with every restart
        pipe.zremrangebyscore(keys.workers, "-inf", now_ms - int(ttl_s * 10_000))
        await pipe.execute()


async def deregister(redis: aioredis.Redis, keys: Keys, worker_id: str) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrem(keys.workers, worker_id)
        pipe.delete(keys.worker(worker_id))
        await pipe.execute()

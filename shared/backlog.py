"""Read-side view of the worker fleet for gateways and operators: live workers with their
capacity, and the depth of the request queue. Lives in shared/ so a gateway (which has no torch)
never imports worker code.

A worker is live while its heartbeat in the zset `{p}:workers` is younger than `worker_ttl_s`;
its hash `{p}:worker:{id}` (same TTL) holds capacity and load, written by `worker.registry`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.streams import CONSUMER_GROUP, Keys


@dataclass
class WorkerInfo:
    worker_id: str
    capacity: int
    running: int
    waiting: int
    kv_free: int
    kv_total: int
    model: str
    pid: int
    started_ms: int
    heartbeat_ms: int

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - self.running - self.waiting)


@dataclass
class QueueDepth:
    length: int    # entries in the request stream (acked ones included until trimmed)
    lag: int       # entries no worker has read yet
    pending: int   # read by a worker, not finished

    @property
    def backlog(self) -> int:
        return self.lag + self.pending


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def live_workers(redis: aioredis.Redis, keys: Keys, worker_ttl_s: float) -> list[WorkerInfo]:
    """Workers whose heartbeat is fresh, with their registry hash (skipped if it expired)."""
    now_ms = int(time.time() * 1000)
    members = await redis.zrangebyscore(keys.workers, now_ms - int(worker_ttl_s * 1000), "+inf", withscores=True)
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for member, _ in members:
            pipe.hgetall(keys.worker(_text(member)))
        hashes = await pipe.execute()
    out = []
    for (member, score), h in zip(members, hashes):
        if not h:
            continue
        f = {_text(k): _text(v) for k, v in h.items()}
        out.append(WorkerInfo(
            worker_id=_text(member), capacity=int(f.get("capacity", 0)), running=int(f.get("running", 0)),
            waiting=int(f.get("waiting", 0)), kv_free=int(f.get("kv_free", 0)), kv_total=int(f.get("kv_total", 0)),
            model=f.get("model", ""), pid=int(f.get("pid", 0)), started_ms=int(f.get("started_ms", 0)),
            heartbeat_ms=int(score),
        ))
    return out


async def queue_depth(redis: aioredis.Redis, keys: Keys) -> QueueDepth:
    """Length, lag and pending of the request stream's consumer group (zeros before it exists)."""
    try:
        groups = await redis.xinfo_groups(keys.requests)
    except ResponseError:  # no such key yet
        return QueueDepth(0, 0, 0)
    length = await redis.xlen(keys.requests)
    for g in groups:
        name = _text(g.get("name", b""))
        if name == CONSUMER_GROUP:
            lag = g.get("lag")
            return QueueDepth(length=length, lag=int(lag) if lag is not None else length,
                              pending=int(g.get("pending", 0)))
    return QueueDepth(length=length, lag=length, pending=0)

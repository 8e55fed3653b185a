"""Read-side view of the worker fleet for gateways and operators: live workers with their
capacity, and the depth of the request queue. Lives in shared/ so a gateway (which has no torch)
never imports worker code.

A worker is live while its heartbeat in the zset `p:{reg}:workers` is younger than `worker_ttl_s`;
its hash `p:{w:<id>}:info` (same TTL) holds capacity and load, written by `worker.registry`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.streams import CONSUMER_GROUP, Keys, as_str


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


@dataclass(frozen=True)
class Backlog:
    """The work ahead of a new request, as every replica sees it."""
    queued: int          # not yet read by any worker (the consumer group's lag)
    pending: int         # read by a worker, not finished
    live_workers: int

    @property
    def depth(self) -> int:
        return self.queued + self.pending


async def live_workers(redis: aioredis.Redis, keys: Keys, worker_ttl_s: float) -> list[WorkerInfo]:
    """Workers whose heartbeat is fresh, with their registry hash (skipped if it expired)."""
    now_ms = int(time.time() * 1000)
    members = await redis.zrangebyscore(keys.workers, now_ms - int(worker_ttl_s * 1000), "+inf", withscores=True)
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for member, _ in members:
            pipe.hgetall(keys.worker(as_str(member)))
        hashes = await pipe.execute()
    out = []
    for (member, score), h in zip(members, hashes):
        if not h:
            continue
        f = {as_str(k): as_str(v) for k, v in h.items()}
        out.append(WorkerInfo(
            worker_id=as_str(member), capacity=int(f.get("capacity", 0)), running=int(f.get("running", 0)),
            waiting=int(f.get("waiting", 0)), kv_free=int(f.get("kv_free", 0)), kv_total=int(f.get("kv_total", 0)),
            model=f.get("model", ""), pid=int(f.get("pid", 0)), started_ms=int(f.get("started_ms", 0)),
            heartbeat_ms=int(score),
        ))
    return out


async def read_backlog(redis: aioredis.Redis, keys: Keys, worker_ttl_s: float) -> Backlog:
    """Queue depth and live-worker count in one round trip (admission runs this on a hot path)."""
    now_ms = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xinfo_groups(keys.requests)
        pipe.xlen(keys.requests)
        pipe.zcount(keys.workers, now_ms - int(worker_ttl_s * 1000), "+inf")
        groups, length, live = await pipe.execute(raise_on_error=False)
    if isinstance(live, Exception):
        raise live
    queued = pending = 0
    if isinstance(groups, ResponseError):   # no stream yet: nothing queued
        groups = []
    elif isinstance(groups, Exception):
        raise groups
    group = next((g for g in groups if as_str(g.get("name")) == CONSUMER_GROUP), None)
    if group is None:
        queued = int(length) if not isinstance(length, Exception) else 0  # no worker ever joined
    else:
        pending = int(group.get("pending") or 0)
        lag = group.get("lag")
        # lag is nil when Redis cannot compute it (e.g. after trimming); then assume nothing
        # beyond what is pending rather than refuse everything
        queued = int(lag) if lag is not None else 0
    return Backlog(queued, pending, int(live))

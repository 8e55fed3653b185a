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
    state: str = "ready"     # ready | draining | unhealthy

    @property
    def free_slots(self) -> int:
        """Room in its running batch (none while it drains or its engine fails)."""
        return max(0, self.capacity - self.running - self.waiting) if self.state == "ready" else 0


@dataclass(frozen=True)
class Backlog:
    """The work ahead of a new request, as every replica sees it."""
    queued: int | None   # entries no worker has read yet (None: cannot be known right now)
    pending: int         # read by a worker, not finished
    live_workers: int

    @property
    def depth(self) -> int | None:
        return None if self.queued is None else self.queued + self.pending


def stream_id(value) -> tuple[int, int]:
    ms, _, seq = as_str(value).partition("-")
    return int(ms), int(seq or 0)


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
            heartbeat_ms=int(score), state=f.get("state") or "ready",
        ))
    return out


async def read_backlog(redis: aioredis.Redis, keys: Keys, worker_ttl_s: float) -> Backlog:
    """Queue depth and live-worker count in one round trip (admission runs this on a hot path).

    The group's `lag` alone is not trusted. Redis derives it from the group's entries-read
    counter, which an AOF reload or a promoted replica can leave behind: Redis 7.0 propagates
    each XREADGROUP as `XCLAIM ... LASTID` without the counter, so after a restart `lag` can
    read the entries added since the AOF was last rewritten (seen: 1,500 with an empty stream),
    and admission would refuse everything for good. So:
    * nothing is queued when the group has delivered up to the stream's last id, whatever
      `lag` says (the usual state: workers read what they have room for at once);
    * otherwise the queue is `lag`, but never more than the entries in the stream that are not
      pending (undelivered entries are in the stream; acked ones the trim has not reached yet
      only make this bound loose): a stale counter cannot invent a backlog the stream does not
      hold. Workers re-sync the counter when they see a new Redis (worker.consumer_group), after
      which `lag` is exact again;
    * `lag` nil (Redis cannot compute it, e.g. after deletions) while entries wait: unknown,
      and admission admits rather than refuse on a figure it does not have.
    """
    now_ms = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xinfo_groups(keys.requests)
        pipe.xinfo_stream(keys.requests)
        pipe.zcount(keys.workers, now_ms - int(worker_ttl_s * 1000), "+inf")
        groups, stream, live = await pipe.execute(raise_on_error=False)
    if isinstance(live, Exception):
        raise live
    for reply in (groups, stream):
        if isinstance(reply, Exception) and not isinstance(reply, ResponseError):
            raise reply
    if isinstance(stream, ResponseError):   # no stream yet: nothing queued
        return Backlog(0, 0, int(live))
    group = None if isinstance(groups, ResponseError) else \
        next((g for g in groups if as_str(g.get("name")) == CONSUMER_GROUP), None)
    length = int(stream.get("length") or 0)
    if group is None:                       # no worker ever joined: everything is queued
        return Backlog(length, 0, int(live))
    pending = int(group.get("pending") or 0)
    lag = group.get("lag")
    if stream_id(group.get("last-delivered-id") or "0-0") >= stream_id(stream.get("last-generated-id") or "0-0"):
        queued: int | None = 0
    elif lag is None:
        queued = None
    else:
        queued = min(int(lag), max(0, length - pending))
    return Backlog(queued, pending, int(live))

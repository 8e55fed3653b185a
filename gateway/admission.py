"""Admission control: refuse work the backend cannot serve, before it is queued.

The backlog is read from Redis, so every replica sees the same queue: `XINFO GROUPS` on the
request stream gives the consumer group's `lag` (entries no worker has read yet) and `pending`
(read but not yet finished); their sum is the work ahead of a new request. Live workers come from
the registry zset `{p}:workers` (worker id -> last heartbeat ms). One snapshot is reused for
`cache_ms` so a burst of thousands of requests costs one round trip, not thousands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.errors import ErrorCode, ProtocolError
from shared.streams import CONSUMER_GROUP, Keys


@dataclass(frozen=True)
class Backlog:
    queued: int          # not yet read by any worker
    pending: int         # read by a worker, not finished
    live_workers: int

    @property
    def depth(self) -> int:
        return self.queued + self.pending


async def read_backlog(redis: aioredis.Redis, keys: Keys, worker_ttl_s: float) -> Backlog:
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
    group = next((g for g in groups if _s(g.get("name")) == CONSUMER_GROUP), None)
    if group is None:
        queued = int(length) if not isinstance(length, Exception) else 0  # no worker ever joined
    else:
        pending = int(group.get("pending") or 0)
        lag = group.get("lag")
        # lag is nil when Redis cannot compute it (e.g. after trimming); then assume nothing
        # beyond what is pending rather than refuse everything
        queued = int(lag) if lag is not None else 0
    return Backlog(queued, pending, int(live))


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Admission:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, max_depth: int, worker_ttl_s: float, cache_ms: int):
        self.redis = redis
        self.keys = keys
        self.max_depth = max_depth
        self.worker_ttl_s = worker_ttl_s
        self.cache_s = cache_ms / 1000
        self._snapshot: Backlog | None = None
        self._at = 0.0
        self.admitted_since_snapshot = 0

    async def backlog(self) -> Backlog:
        now = time.monotonic()
        if self._snapshot is None or now - self._at >= self.cache_s:
            self._snapshot = await read_backlog(self.redis, self.keys, self.worker_ttl_s)
            self._at = now
            self.admitted_since_snapshot = 0
        return self._snapshot

    async def admit(self) -> None:
        backlog = await self.backlog()
        if backlog.live_workers == 0:
            raise ProtocolError(ErrorCode.OVERLOADED, "no worker is alive to serve the request; retry later")
        # requests this replica admitted since the snapshot count too, so a burst cannot overshoot
        if backlog.depth + self.admitted_since_snapshot >= self.max_depth:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"the request queue is full ({backlog.depth} waiting or running, "
                                f"limit {self.max_depth}); retry later")
        self.admitted_since_snapshot += 1

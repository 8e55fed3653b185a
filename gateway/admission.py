"""Admission control: refuse work the backend cannot serve, before it is queued.

The backlog is read from Redis, so every replica sees the same queue: entries no worker has
read yet plus entries read but not yet finished (shared.backlog.read_backlog, which does not
trust the consumer group's `lag` counter after a Redis restart); their sum is the work ahead
of a new request. When the depth cannot be known, admission admits (and says so once in the
log) rather than refuse every request on a figure it does not have. Live workers come from
the registry zset `{p}:workers` (worker id -> last heartbeat ms). One snapshot is reused for
`cache_ms` so a burst of thousands of requests costs one round trip, not thousands.

"Alive" for admission is a heartbeat within ADMISSION_GRACE_TTLS x WORKER_TTL_S, not within one
TTL: WORKER_TTL_S is tuned for failover (claim a silent worker's requests within seconds), while
a worker that missed a few heartbeats because Redis itself restarted is back a moment later, and
a request queued meanwhile simply waits in the stream. Refusing then would turn every Redis
restart into a burst of `overloaded` errors for new requests.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from shared.backlog import Backlog, read_backlog
from shared.errors import ErrorCode, ProtocolError
from shared.streams import Keys

ADMISSION_GRACE_TTLS = 5

log = logging.getLogger("gateway.admission")


class Admission:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, max_depth: int, worker_ttl_s: float, cache_ms: int):
        self.redis = redis
        self.keys = keys
        self.max_depth = max_depth
        self.worker_ttl_s = worker_ttl_s * ADMISSION_GRACE_TTLS
        self.cache_s = cache_ms / 1000
        self._snapshot: Backlog | None = None
        self._at = 0.0
        self.admitted_since_snapshot = 0
        self._depth_unknown = False

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
        if backlog.depth is None:
            if not self._depth_unknown:
                log.warning("the request queue's depth cannot be read from Redis right now (its consumer-group "
                            "counter is unknown); admitting without a depth check until it can")
            self._depth_unknown = True
            return
        if self._depth_unknown:
            log.info("the request queue's depth is known again (%d)", backlog.depth)
            self._depth_unknown = False
        # requests this replica admitted since the snapshot count too, so a burst cannot overshoot
        if backlog.depth + self.admitted_since_snapshot >= self.max_depth:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"the request queue is full ({backlog.depth} waiting or running, "
                                f"limit {self.max_depth}); retry later")
        self.admitted_since_snapshot += 1

"""Which worker a new request should run on (shared.routing): rendezvous hashing of its route
key over the live workers that have room, from a registry snapshot this gateway refreshes every
`REFRESH_S` in its housekeeping (one round trip; staleness only costs cache affinity, never
correctness: the worker that reads an entry checks the route against its own, fresher view)."""

from __future__ import annotations

import time

from shared.backlog import WorkerInfo, live_workers
from shared.routing import rendezvous, route_key
from shared.streams import Keys

REFRESH_S = 1.0


class Router:
    def __init__(self, redis, keys: Keys, *, worker_ttl_s: float, enabled: bool = True):
        self.redis = redis
        self.keys = keys
        self.worker_ttl_s = worker_ttl_s
        self.enabled = enabled
        self.workers: list[WorkerInfo] = []
        self.refreshed_at = 0.0

    async def refresh(self) -> None:
        self.workers = await live_workers(self.redis, self.keys, self.worker_ttl_s)
        self.refreshed_at = time.monotonic()

    async def live(self) -> list[WorkerInfo]:
        """The live workers, from a snapshot at most REFRESH_S old (read now when older, as it
        is with routing off, or when it holds none: a worker may have started since)."""
        if not self.workers or time.monotonic() - self.refreshed_at >= REFRESH_S:
            await self.refresh()
        return self.workers

    def due(self, now: float) -> bool:
        return self.enabled and now - self.refreshed_at >= REFRESH_S

    def pick(self, explicit_key: str | None, prompt: str | None, messages: list[dict] | None,
             scope: str = "") -> str:
        """The worker id to route to, or "" (any worker: routing off, no live worker known, or
        the key's worker has no room). `scope`: the request's cache scope (gateway.cache_scope)."""
        if not self.enabled or not self.workers:
            return ""
        by_id = {w.worker_id: w for w in self.workers}
        first = rendezvous(route_key(explicit_key, prompt, messages, scope), by_id)[0]
        return first if by_id[first].free_slots > 0 else ""

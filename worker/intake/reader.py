"""Reading new request entries: XREADGROUP only as many as the engine has room for.

Why its own module: how much work this worker takes is decided here. It reads no more new
entries than it has free slots (the running batch plus WORKER_QUEUE_DEPTH queued in the
engine), so an idle worker elsewhere gets the rest instead of this one hoarding them, and it
reads nothing while it is full or its engine is unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from redis.exceptions import ResponseError

from shared.streams import CONSUMER_GROUP, Keys, as_str
from worker.inflight import InFlightTable
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")

BLOCK_MS = 1000          # XREAD BLOCK of the intake loop (bounds SIGTERM reaction)


class Reader:
    def __init__(self, *, blocking_redis, keys: Keys, worker_id: str, table: InFlightTable, stop: asyncio.Event,
                 accept: Callable[[str, dict, int], Awaitable[None]],
                 hand_back: Callable[[list[str]], Awaitable[None]],
                 ensure_group: Callable[[], Awaitable[None]]):
        self.blocking_redis = blocking_redis     # XREADGROUP ... BLOCK only
        self.keys = keys
        self.worker_id = worker_id
        self.table = table
        self.stop = stop
        self.accept = accept                     # one delivered entry (worker.intake.accept)
        self.hand_back = hand_back               # entries we cannot run (worker.leases)
        self.ensure_group = ensure_group         # the group is gone (the stream was deleted under us)

    def stopping(self) -> bool:
        return self.stop.is_set()

    async def loop(self) -> None:
        table = self.table
        while not self.stopping():
            free = table.free_slots()
            if free <= 0:
                await table.wait_for_room()
                continue
            try:
                resp = await with_backoff(
                    lambda: self.blocking_redis.xreadgroup(CONSUMER_GROUP, self.worker_id, {self.keys.requests: ">"},
                                                           count=free, block=BLOCK_MS),
                    "read requests", self.stopping)
            except asyncio.CancelledError:
                return
            except ResponseError as exc:  # NOGROUP: the stream was deleted under us
                log.warning("xreadgroup failed (%s); recreating the group", exc)
                await asyncio.sleep(0.2)
                await with_backoff(self.ensure_group, "create consumer group", self.stopping)
                continue
            entries = [(as_str(i), f) for _stream, got in resp or [] for i, f in got]
            if entries and table.unhealthy:   # it turned unhealthy while this read was blocked
                await self.hand_back([i for i, _ in entries])
                log.warning("engine unhealthy: handed back %d new entries", len(entries))
                continue
            for entry_id, fields in entries:
                await self.accept(entry_id, fields, deliveries=1)

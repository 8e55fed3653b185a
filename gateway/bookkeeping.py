"""Redis writes about requests that no client waits on, done by one task per gateway instead of
in a socket's send loop.

Why: when a request ends, its concurrency lease is released and it leaves this gateway's `reqs`
set; when a socket goes away, its unfinished requests are parked for a resume (or cancelled).
Awaited in the sender, a Redis stall froze every stream of that socket before `done` went out
(and the slow-consumer watchdog could not see it, the socket was not slow). Here they are
queued, written in batches, and retried with backoff while Redis is away; the client already
has its `done`. Nothing is lost by a delay: a stale `reqs` member is skipped at takeover, and an
orphan parked late is cancelled late. The lease matters more: a client that got `done` may
start its next request at once. A worker releases it before the final event can reach any
gateway (worker.output_writer); for a request this gateway ended itself (a cancel before it
started, a cancel fallback, a stall), the next submit of the same key on this gateway takes the
pending releases along in its own round trip (`take_releases`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from redis.exceptions import RedisError

from gateway.submit import Submitter

log = logging.getLogger("gateway.bookkeeping")

MAX_QUEUED = 100_000      # requests whose end waits to be written; beyond, the oldest is dropped
BATCH = 500


class Bookkeeper:
    def __init__(self, submitter: Submitter, *, grace_s: float, on_cancelled=lambda n: None):
        self.submitter = submitter
        self.grace_s = grace_s
        self.on_cancelled = on_cancelled      # told how many orphans it cancelled (no grace)
        self._releases: dict[str, set[str]] = {}              # key_id -> rids whose lease goes
        self._left: set[str] = set()                           # rids that leave our `reqs` set
        self._orphans: deque[tuple[str, int]] = deque()        # (rid, att)
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dropped = 0

    # ---- what sessions hand over (never await) --------------------------------------------

    def request_ended(self, key_id: str, rid: str) -> None:
        """Release its lease and take it out of this gateway's `reqs` set."""
        if len(self._left) >= MAX_QUEUED:
            self.dropped += 1       # Redis has been away for very long: the lease expires by itself
            return
        self._releases.setdefault(key_id, set()).add(rid)
        self._left.add(rid)
        self._work.set()

    def take_releases(self, key_id: str) -> list[str]:
        """The leases of `key_id` still to release: a submit of that key writes them first."""
        return list(self._releases.pop(key_id, ()))

    def orphaned(self, orphans: list[tuple[str, int]]) -> None:
        """A session went away: park these (rid, att) for a resume, or cancel them (no grace)."""
        for item in orphans:
            self._push(self._orphans, item)

    def _push(self, queue: deque, item) -> None:
        if len(queue) >= MAX_QUEUED:
            queue.popleft()
            self.dropped += 1
        queue.append(item)
        self._work.set()

    @property
    def queued(self) -> int:
        return len(self._left) + len(self._orphans)

    # ---- the task ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-bookkeeping")

    async def stop(self, timeout: float = 2.0) -> None:
        """Write what is queued (within `timeout`: Redis may be away), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), timeout)
        except (asyncio.TimeoutError, RedisError, OSError):
            log.warning("stopping with %d request(s) not written back (their leases expire by themselves)",
                        self.queued)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            await self._work.wait()
            self._work.clear()
            try:
                await self.flush()
                backoff = 0.05
            except (RedisError, OSError) as exc:
                log.warning("bookkeeping of %d request(s) failed (%s); retrying in %.2fs", self.queued, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._work.set()

    async def flush(self) -> None:
        """Write everything queued; an item leaves the queue only once Redis has it."""
        if self._left:
            releases, left = self._releases, self._left
            self._releases, self._left = {}, set()
            try:
                await self.submitter.end_requests(releases, sorted(left))
            except BaseException:
                for key_id, rids in releases.items():      # back in the queue, behind newer ones
                    self._releases.setdefault(key_id, set()).update(rids)
                self._left |= left
                raise
        while self._orphans:
            batch = [self._orphans[i] for i in range(min(BATCH, len(self._orphans)))]
            if self.grace_s > 0:
                await self.submitter.park_orphans(batch, self.grace_s)
            else:
                cancelled = [rid for rid, att in batch if await self.submitter.cancel_orphan(rid, att)]
                self.on_cancelled(len(cancelled))
            for _ in batch:
                self._orphans.popleft()

"""Routing: an entry that names another worker is handed to it, if that worker can take it now.

Why its own module: the gateway routes a request to the worker whose prefix cache holds its
prompt (shared.routing), but the entry may be read by any worker of the group. The reader
hands it over when the named worker is live and has room (XCLAIM into its pending list,
JUSTID so the delivery count stays, and a `take` on its control stream); otherwise it runs
here: no request waits on a busy or dead worker. The receiving side reads the handed-over
entry back (worker.control's `take`). Who is live and how much room each has comes from a
view of the registry, read every VIEW_REFRESH_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from shared.backlog import WorkerInfo, live_workers
from shared.config import Settings
from shared.logs import rid_of
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, as_str, encode_take
from worker.inflight import Stats
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")

VIEW_REFRESH_S = 1.0     # how often the live peers and their room are read (routing)
VIEW_RECHECK_S = 0.1     # at most this often again when an entry names a worker the view lacks
CTL_MAXLEN = 10000       # a worker's control stream (MAXLEN ~)
SENT_MARGIN_MS = 100     # a hand-over this close before a peer's beat may not be in its figures yet
SENT_KEEP_MS = 10_000


@dataclass(frozen=True)
class HandOver:
    """Entry `entry_id` (of `rid`, delivered `deliveries` times) goes to worker `peer`."""
    entry_id: str
    rid: str
    deliveries: int
    peer: str


class Forwarding:
    def __init__(self, *, redis, keys: Keys, settings: Settings, worker_id: str, stats: Stats, stop: asyncio.Event):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.stats = stats
        self.stop = stop
        # live peers and their room, for routing (refreshed every VIEW_REFRESH_S)
        self.view: dict[str, WorkerInfo] = {}
        self.view_at = 0.0
        self._sent: dict[str, list[float]] = {}   # peer -> wall ms of our hand-overs to it (room they took)

    def stopping(self) -> bool:
        return self.stop.is_set()

    async def refresh_view(self) -> None:
        self.view = {w.worker_id: w for w in await live_workers(self.redis, self.keys, self.settings.worker_ttl_s)}
        self.view_at = time.monotonic()
        old = time.time() * 1000 - SENT_KEEP_MS
        self._sent = {peer: kept for peer, sent in self._sent.items() if (kept := [t for t in sent if t > old])}

    async def refresh_view_if_stale(self) -> None:
        """Read the registry again once the view is VIEW_REFRESH_S old (the claim loop's pace)."""
        if time.monotonic() - self.view_at >= VIEW_REFRESH_S:
            await with_backoff(self.refresh_view, "read the worker registry", self.stopping)

    async def forward(self, entry_id: str, entry: RequestEntry, deliveries: int) -> bool:
        """The entry names another worker (`entry.route`). If that worker is live and has room,
        hand the entry to it and write nothing else; True when handed over."""
        peer = self.view.get(entry.route)
        if peer is None and time.monotonic() - self.view_at >= VIEW_RECHECK_S:
            # The gateway routed to a worker this view does not know: one that registered since
            # our last read (a worker that just started), or one that died. Read again (at most
            # every VIEW_RECHECK_S) rather than run a new worker's requests here for up to a
            # VIEW_REFRESH_S, missing its cache each time.
            await with_backoff(self.refresh_view, "read the worker registry", self.stopping)
            peer = self.view.get(entry.route)
        if peer is None or peer.free_slots <= 0 or self.stopping():
            return False
        await with_backoff(lambda: self.hand_over([HandOver(entry_id, entry.rid, deliveries, entry.route)]),
                           "hand a routed entry over")
        self.stats.forwarded += 1
        log.debug("request %s routed to worker %s: handed it over", entry.rid, entry.route, extra=rid_of(entry.rid))
        return True

    def rooms(self) -> dict[str, int]:
        """Live peers (not us) with room in their running batch: as the view has them, less what
        we handed them since their last beat (their figures cannot show it yet)."""
        out = {}
        for w in self.view.values():
            since = w.heartbeat_ms - SENT_MARGIN_MS
            free = w.free_slots - sum(1 for t in self._sent.get(w.worker_id, ()) if t > since)
            if w.worker_id != self.worker_id and free > 0:
                out[w.worker_id] = free
        return out

    async def hand_over(self, moves: list["HandOver"], before=None) -> None:
        """Put each entry into its peer's pending list (XCLAIM JUSTID: the delivery count stays)
        and tell the peer on its control stream (`take`): one pipeline. `before(pipe)` queues
        what must go first (placement releases the requests it had taken)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if before is not None:
                before(pipe)
            for m in moves:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, m.peer, 0, [m.entry_id], justid=True)
                pipe.xadd(self.keys.ctl(m.peer), {ENTRY_FIELD: encode_take(m.rid, m.entry_id, m.deliveries)},
                          maxlen=CTL_MAXLEN, approximate=True)
            await pipe.execute()
        now = time.time() * 1000
        for m in moves:
            self._sent.setdefault(m.peer, []).append(now)

    async def read_handed_over(self, entry_id: str) -> tuple[str, dict] | None:
        """An entry another worker handed to us: (entry id, fields) while it is still in our
        pending list; None if it moved on meanwhile (acked, or claimed by someone)."""
        async def read():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xrange(self.keys.requests, entry_id, entry_id)
                pipe.xpending_range(self.keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1,
                                    consumername=self.worker_id)
                return await pipe.execute()
        found, mine = await with_backoff(read, "read a routed entry")
        if found and mine:
            return as_str(found[0][0]), found[0][1]
        return None

"""Claiming the entries other workers will not finish: a dead worker's at once, idle ones by XAUTOCLAIM.

Why its own module: a request entry stays pending under the worker that read it until that
worker acks it; if it died, or handed the entry back, someone has to take the entry over.

* dead workers: a worker whose registry heartbeat lapsed (`worker_ttl_s`) has its entries
  XCLAIMed at once, all of them in one round (its own pending list, read page by page: the cost
  follows what it owned, not the stream), whatever our free slots, ahead of new intake; what
  does not fit our running batch goes on to live peers with room (worker.intake.placement). The
  registry is looked at again just after the oldest live heartbeat would lapse, so a death is
  seen when it can first be judged, not up to a tick later. A dead worker with nothing left
  pending is forgotten (registry entry, control stream, group consumer);
* idle entries: XAUTOCLAIM (following its cursor) of entries idle for `claim_idle_ms`, up to
  our free slots: hand-backs, and workers gone from the registry;
* Redis liveness: neither runs until we have watched Redis for a worker TTL without
  interruption: after a Redis restart every heartbeat and every entry's idle time is stale,
  and live peers need that window to beat and refresh their entries again
  (shared.peer_liveness).

What happens to a claimed request another worker started is worker.failover's decision.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from shared.config import Settings
from shared.peer_liveness import PeerLiveness, server_run_id
from shared.streams import CONSUMER_GROUP, Keys, as_str
from worker import consumer_group, registry
from worker.inflight import InFlightTable, Stats
from worker.intake.contests import Contests
from worker.intake.placement import Placement
from worker.redis_io import TRANSIENT

log = logging.getLogger("worker.intake")

MAX_SCAN_CALLS = 50      # XAUTOCLAIM calls a round may take to walk the pending list
PAGE = 1000              # a dead worker's pending entries read (and claimed) this many per call
LAPSE_MARGIN_S = 0.005   # look this long after the oldest live heartbeat would lapse
MIN_CHECK_S = 0.02       # (bounds the pace should a peer's clock lag ours by about a TTL)


# KEYS: requests. ARGV: group, dead consumer, us, min-idle ms, count, start (an id, "(id" or "-").
# One page of the dead consumer's pending list XCLAIMed to us, in one round trip: {entries claimed,
# their delivery counts before this claim, entries looked at, the last id looked at}. (Redis walks
# that consumer's own pending list: the cost follows what it owned. Entries deleted meanwhile are
# not returned: by Redis 7 XCLAIM drops them from the pending list; by 6.2 they come back nil.)
CLAIM_FROM = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[6], '+', tonumber(ARGV[5]), ARGV[2])
if #p == 0 then return {{}, {}, 0, ''} end
local ids, counts = {}, {}
for i, e in ipairs(p) do ids[i] = e[1]; counts[e[1]] = e[4] end
local got = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], ARGV[4], unpack(ids))
local claimed, times = {}, {}
for i = 1, #got do
  local e = got[i]
  if e and e[2] then claimed[#claimed + 1] = e; times[#times + 1] = counts[e[1]] end
end
return {claimed, times, #p, p[#p][1]}
"""


class Claims:
    def __init__(self, *, redis, keys: Keys, settings: Settings, worker_id: str, table: InFlightTable,
                 contests: Contests, placement: Placement, stats: Stats,
                 accept: Callable[[list[tuple[str, dict, int]]], Awaitable[None]]):
        self.redis = redis
        self.placement = placement
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.table = table
        self.contests = contests
        self.stats = stats
        self.accept = accept                      # [(entry id, fields, deliveries)]: worker.intake.accept
        self.cursor = "0-0"      # where the next XAUTOCLAIM scan goes on
        # who is dead: not judged while Redis (or this process) was away (shared.peer_liveness)
        self.peers = PeerLiveness(self.settings.worker_ttl_s, what="peer workers")
        self.oldest_beat_ms: int | None = None    # the oldest live peer's last heartbeat (wall ms)
        self._claim_from = redis.register_script(CLAIM_FROM)

    def judging(self) -> bool:
        """Whether idle times can be trusted (Redis watched for a worker TTL without a break)."""
        return self.peers.judging()

    async def watch_redis(self) -> None:
        """One liveness round: which Redis server answers, and how promptly. A new server
        (restart, failover) means stale heartbeats, idle times and group counters."""
        sent_at = self.peers.clock()
        run_id = await server_run_id(self.redis, self.keys.workers)
        if self.peers.observe(run_id, sent_at):
            await consumer_group.resync_entries_read(self.redis, self.keys)

    # ---- entries of dead workers ------------------------------------------------------------

    async def claim_dead_workers(self) -> None:
        """Claim the entries of every worker whose registry heartbeat is older than
        worker_ttl_s (up to our capacity a round), and clean up after those with none left."""
        try:
            await self.watch_redis()
            await self._claim_dead_workers()
        except TRANSIENT:
            self.peers.interrupted()   # what we read next may be stale: a fresh window first
            raise

    def next_check_s(self, longest: float) -> float:
        """How long until the registry is looked at again: `longest`, or just after the oldest
        live peer's heartbeat would lapse, if that is sooner."""
        if self.oldest_beat_ms is None:
            return longest
        due = (self.oldest_beat_ms + self.peers.ttl_ms - time.time() * 1000) / 1000 + LAPSE_MARGIN_S
        return min(longest, max(MIN_CHECK_S, due))

    async def _claim_dead_workers(self) -> None:
        cutoff = self.peers.cutoff_ms()
        self.oldest_beat_ms = None
        if self.table.unhealthy or cutoff is None:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(self.keys.workers, "-inf", cutoff)
            pipe.zrangebyscore(self.keys.workers, f"({cutoff}", "+inf", start=0, num=2, withscores=True)
            silent, oldest = await pipe.execute()
        self.oldest_beat_ms = next((int(score) for w, score in oldest if as_str(w) != self.worker_id), None)
        for dead in (as_str(w) for w in silent):
            if dead == self.worker_id:
                continue
            claimed, deliveries, looked_at = await self._claim_from_dead(dead)
            if not looked_at:
                await registry.forget_dead(self.redis, self.keys, dead)
                log.info("worker %s is dead and owns nothing any more: removed its registry entry, control "
                         "stream and consumer", dead)
                continue
            if claimed:
                log.info("worker %s is dead (no heartbeat for %.1f s): claimed %d of its requests", dead,
                         self.settings.worker_ttl_s, len(claimed))
                await self._accept_claimed(claimed, deliveries, place=True)

    async def _claim_from_dead(self, dead: str) -> tuple[list[tuple[str, dict]], dict[str, int], int]:
        """Every entry pending under `dead`, XCLAIMed to us a page (one round trip) at a time:
        (claimed entries, their delivery counts with this claim, entries looked at). Min-idle:
        of two survivors claiming at once only one gets each entry (XCLAIM resets the idle
        time), and an entry the dead worker refreshed just before dying still qualifies."""
        min_idle = int(self.settings.worker_ttl_s * 500)
        claimed: list[tuple[str, dict]] = []
        deliveries: dict[str, int] = {}
        looked_at, start = 0, "-"
        while True:
            got, times, n, last = await self._claim_from(
                keys=[self.keys.requests], args=[CONSUMER_GROUP, dead, self.worker_id, min_idle, PAGE, start])
            for (entry_id, flat), before in zip(got, times):
                entry_id = as_str(entry_id)
                claimed.append((entry_id, dict(zip(flat[::2], flat[1::2]))))
                deliveries[entry_id] = int(before) + 1       # (the claim counted one more)
            looked_at += int(n)
            if int(n) < PAGE:
                return claimed, deliveries, looked_at
            start = f"({as_str(last)}"

    # ---- idle entries -----------------------------------------------------------------------

    async def claim_once(self, count: int) -> None:
        """XAUTOCLAIM up to `count` idle entries, following its cursor: Redis scans at most
        10 x COUNT pending entries a call, so with one free slot behind a hundred busy entries
        a scan from 0-0 every time would never reach the idle ones further on."""
        claimed: list = []
        for _ in range(MAX_SCAN_CALLS):
            self.cursor, entries, deleted = (await self.redis.xautoclaim(
                self.keys.requests, CONSUMER_GROUP, self.worker_id, self.settings.claim_idle_ms,
                start_id=self.cursor, count=count - len(claimed)))[:3]
            self.cursor = as_str(self.cursor)
            if deleted:
                log.warning("pending entries trimmed before anyone finished them: %s", deleted)
            claimed += [(as_str(i), f) for i, f in entries if f]
            if len(claimed) >= count or self.cursor == "0-0":
                break
        if claimed:
            # delivery counts (the claim has already counted this delivery)
            ids = sorted(claimed, key=lambda e: tuple(int(x) for x in e[0].split("-")))
            pending = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min=ids[0][0],
                                                      max=ids[-1][0], count=len(claimed) + len(self.table) + 100,
                                                      consumername=self.worker_id)
            await self._accept_claimed(claimed, {as_str(p["message_id"]): int(p["times_delivered"])
                                                 for p in pending})

    async def _accept_claimed(self, entries: list, deliveries: dict[str, int], *, place: bool = False) -> None:
        """Take what we claimed, a few pipelines for all (worker.intake.accept). `place`: a
        dead worker's entries, whatever our room: what our batch has room for is taken first,
        the rest goes to peers with room or queues here. Each is watched until it starts."""
        ours = self.table.entry_ids() | self.contests.entry_ids()
        entries = [(entry_id, fields) for entry_id, fields in entries if entry_id not in ours]
        self.stats.claimed += len(entries)
        now, extra = self.placement.split(entries) if place else (entries, [])
        await self.accept([(entry_id, fields, deliveries.get(entry_id, 2)) for entry_id, fields in now])
        if extra:
            extra = await self.placement.hand_on(extra, deliveries)
            await self.accept([(entry_id, fields, deliveries.get(entry_id, 2)) for entry_id, fields in extra])
        self.placement.watch({entry_id for entry_id, _ in now + extra}, deliveries)

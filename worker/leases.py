"""Keeping what this worker owns, and giving it back: the upkeep side of worker.ownership.

Why its own module: ownership is decided once, when intake takes a request (worker.ownership's
TAKE), but it has to be kept for as long as the request runs here, and given up cleanly when
this worker cannot run it. Both act on the same two things, the lease in the request's meta
and the entry in our pending list (PEL); meta is the truth, and the PEL follows it.

* keep-fresh (every `keep_fresh_interval`, or at once when the output writer finds a lease
  past its deadline): per request we own, extend the lease and read the cancel flag
  (worker.ownership's KEEP), and move the request's `lease_until` to that round's deadline
  (counted from when it was sent, so a stalled Redis cannot stretch it); a request whose old
  deadline had passed with no commit round to see it (the writer's round waiting in a stalled
  Redis) is counted as a lapse here (`worker_lease_lapses_total`); a request whose epoch
  moved on was taken over: dropped here. Then XCLAIM ... JUSTID of every entry we own: resets
  its idle time (a slow but healthy worker's requests are never claimed away), and brings back
  one another consumer claimed (that worker found our lease alive and left the request to us);
* hand back (drain, a dead or unhealthy engine, entries we cannot run): XCLAIM the entries to
  ourselves with an IDLE far above claim_idle_ms, so the next XAUTOCLAIM elsewhere takes them
  at once, and clear owner and lease of the requests (RELEASE, only while still ours).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from shared.aio import wait_event
from shared.config import Settings
from shared.logs import rid_of
from shared.streams import CONSUMER_GROUP, Keys, as_str
from worker.engine_client import Cancel, EngineClient
from worker.events import InFlight
from worker.inflight import InFlightTable, Stats
from worker.ownership import Ownership
from worker.redis_io import Backoff, with_backoff

log = logging.getLogger("worker.leases")

PENDING_PAGE = 1000      # our pending entries read this many per call (pending_ids)


class Leases:
    def __init__(self, *, redis, keys: Keys, settings: Settings, worker_id: str, ownership: Ownership,
                 table: InFlightTable, engine: EngineClient, stats: Stats,
                 mark_lapsed: Callable[[list[InFlight], float], None]):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.ownership = ownership
        self.table = table
        self.engine = engine
        self.stats = stats
        self.mark_lapsed = mark_lapsed   # the output writer's: holds output, counts the lapse once
        self._renew = asyncio.Event()    # a lease passed its deadline: renew now, not at the next interval
        # keep-fresh's XCLAIM (idle time reset) and a hand back's (idle time far past claim_idle_ms)
        # of the same entry must reach Redis in the order their decisions were made: a reset
        # landing after a hand back would leave the entry unclaimable for claim_idle_ms
        self._claiming = asyncio.Lock()

    # ---- keep-fresh -------------------------------------------------------------------------

    def renew_soon(self, st: InFlight | None = None) -> None:
        """A lease of ours passed its deadline unrenewed (its output is held): run a round now."""
        self._renew.set()

    async def keep_fresh_loop(self) -> None:
        interval = self.ownership.interval
        while True:
            await wait_event(self._renew, interval)
            self._renew.clear()
            if len(self.table):
                # retried at this loop's own pace during an outage: when Redis is back, our
                # entries and leases are fresh again within `interval`, inside the window peers
                # give us
                await with_backoff(self.keep_fresh_once, "keep fresh", backoff=Backoff(cap=interval))

    async def keep_fresh_once(self) -> None:
        """Extend our leases and read the cancel flags; drop what was taken over; then make the
        PEL follow meta: every entry we own is pending under us, with its idle time reset."""
        states = self.table.states()
        if not states:
            return
        verdicts = await self.ownership.keep(states)
        kept, renewed = [], 0
        for st, verdict in zip(states, verdicts):
            if verdict.taken_over:       # its epoch moved on: another worker took it over
                if self.table.holds(st) and not st.final_written:
                    log.warning("request %s was taken over by another worker (meta.epoch is past %d); dropping it "
                                "here", st.rid, st.epoch, extra=rid_of(st.rid))
                    self.table.drop(st)
                continue
            kept.append(st)
            st.lease_refused = verdict.refused
            if verdict.lease_until is not None and verdict.lease_until > st.lease_until:
                now = time.monotonic()
                if not st.may_write(now):
                    # its deadline passed, perhaps with no commit round to see it (the writer's round
                    # waited in a stalled Redis's socket, holding its lock): a lapse all the same
                    self.mark_lapsed([st], now)
                st.lease_until = verdict.lease_until
                if st.lease_lapsed and st.may_write(now):
                    st.lease_lapsed = False
                    renewed += 1
            if verdict.cancelled and self.table.holds(st) and not st.engine_done:
                self.engine.submit(Cancel(st.rid, received_at=time.time()))
        if renewed:
            log.info("%d request(s) whose output was held for their lease: renewed, writing again", renewed)
        if any(st.lease_lapsed and not st.may_write(time.monotonic()) for st in kept):
            self._renew.set()            # renewed, but its reply came after the deadline: again
        async with self._claiming:      # after a hand back that began, never before one that ended
            kept = [st for st in kept if self.table.holds(st)]   # not one handed over meanwhile
            if kept:
                # an entry another consumer claimed comes back to us (that worker found our lease
                # alive and left the request to us); our own get their idle time reset
                await self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0,
                                        [st.entry_id for st in kept], justid=True)

    # ---- giving entries back ----------------------------------------------------------------

    async def pending_ids(self) -> list[str]:
        """Every entry pending under us in the consumer group, page by page."""
        ids, start = [], "-"
        while True:
            page = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min=start, max="+",
                                                   count=PENDING_PAGE, consumername=self.worker_id)
            ids += [as_str(p["message_id"]) for p in page]
            if len(page) < PENDING_PAGE:
                return ids
            start = "(" + ids[-1]

    async def hand_back(self, entry_ids: list[str], states: Sequence[InFlight] = ()) -> None:
        """Make entries we hold claimable by any other worker right away: XCLAIM them to
        ourselves with an IDLE far above claim_idle_ms (the next XAUTOCLAIM elsewhere takes
        them), and clear owner and lease of the requests `states` (while still ours)."""
        idle_ms = max(10 * self.settings.claim_idle_ms, 3_600_000)

        async def op():
            if states:
                await self.ownership.load()
            async with self._claiming, self.redis.pipeline(transaction=False) as pipe:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0, entry_ids, idle=idle_ms,
                            justid=True)
                self.ownership.release_in(pipe, states)
                await pipe.execute()
        try:
            await asyncio.wait_for(with_backoff(op, "hand back"), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not hand back %d entries; they are claimed after claim_idle_ms", len(entry_ids))
        self.stats.handed_back += len(entry_ids)

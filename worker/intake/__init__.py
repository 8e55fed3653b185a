"""Taking work in: read new request entries, claim those other workers will not finish, become
the owner of each (or leave it to its live owner), and end the ones that cannot run.

Why a package: ownership of a request entry is decided here and only here (with the scripts
of worker.ownership), by a few concerns that each fit in one module:

* worker.intake.reader       — new entries: XREADGROUP, only as many as there is room for
* worker.intake.claims       — a dead worker's entries (registry), idle ones (XAUTOCLAIM), Redis liveness
* worker.intake.accept       — one delivered entry: validate, forward, take (the epoch fences), decide, run
* worker.intake.contests     — taking a request, and entries whose request a live worker holds
* worker.intake.forwarding   — routing: hand an entry to the worker that has its prompt cached
* worker.intake.placement    — claimed work the claimant cannot start goes to a worker with room
* worker.intake.dead_letters — ending a request without running it (dead letter; already finished)

Keeping what we own (keep-fresh) and handing it back: worker.leases. `Intake` builds the
parts, each given what it uses, and runs the claim loop's rounds; its methods are what the
service, the lifecycle and the control loop call.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import ResponseError

from shared.aio import wait_event
from shared.config import Settings
from shared.streams import Keys
from worker import consumer_group
from worker.engine_client import EngineClient
from worker.inflight import InFlightTable, Stats
from worker.intake.accept import Acceptor
from worker.intake.claims import Claims
from worker.intake.contests import Contests
from worker.intake.dead_letters import DeadLetters
from worker.intake.forwarding import Forwarding
from worker.intake.placement import Placement
from worker.intake.reader import Reader
from worker.leases import Leases
from worker.output_writer import OutputWriter
from worker.ownership import Ownership
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")

TRIM_EVERY_S = 10.0
DEAD_CHECK_S = 0.25      # how often the registry is checked for workers whose heartbeat lapsed


class Intake:
    def __init__(self, *, redis, blocking_redis, keys: Keys, settings: Settings, worker_id: str,
                 table: InFlightTable, engine: EngineClient, writer: OutputWriter, stats: Stats,
                 stop: asyncio.Event, ownership: Ownership, leases: Leases):
        self.redis = redis                       # claims, meta, hand-back
        self.keys = keys
        self.settings = settings
        self.table = table
        self.stop = stop
        self.leases = leases
        self.contests = Contests(ownership=ownership, leases=leases, stats=stats)
        self.forwarding = Forwarding(redis=redis, keys=keys, settings=settings, worker_id=worker_id, stats=stats,
                                     stop=stop)
        dead_letters = DeadLetters(worker_id=worker_id, table=table, writer=writer, contests=self.contests,
                                   stats=stats)
        self.acceptor = Acceptor(redis=redis, keys=keys, settings=settings, worker_id=worker_id, table=table,
                                 engine=engine, writer=writer, stats=stats, contests=self.contests,
                                 forwarding=self.forwarding, dead_letters=dead_letters)
        self.placement = Placement(settings=settings, worker_id=worker_id, table=table, engine=engine,
                                   ownership=ownership, forwarding=self.forwarding, stats=stats, stop=stop)
        self.claims = Claims(redis=redis, keys=keys, settings=settings, worker_id=worker_id, table=table,
                             contests=self.contests, placement=self.placement, stats=stats,
                             accept=self.acceptor.accept_many)
        self.reader = Reader(blocking_redis=blocking_redis, keys=keys, worker_id=worker_id, table=table, stop=stop,
                             accept=self.acceptor.accept, hand_back=leases.hand_back, ensure_group=self.ensure_group)

    def stopping(self) -> bool:
        return self.stop.is_set()

    async def ensure_group(self) -> None:
        """Create or join the group, and put its counters right (a new Redis may have loaded
        them stale: worker.consumer_group)."""
        await consumer_group.ensure_group(self.redis, self.keys)
        await consumer_group.resync_entries_read(self.redis, self.keys)

    async def tend_group(self) -> None:
        """Trim finished entries; re-sync the group's counters if they are visibly off."""
        await consumer_group.trim_finished(self.redis, self.keys)
        if await consumer_group.counters_look_wrong(self.redis, self.keys):
            await consumer_group.resync_entries_read(self.redis, self.keys)

    async def accept(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """One delivered entry (worker.intake.accept)."""
        await self.acceptor.accept(entry_id, fields, deliveries)

    async def read_loop(self) -> None:
        await self.reader.loop()

    async def claim_loop(self) -> None:
        # A dead worker is known from the registry as soon as its heartbeat lapses: its entries
        # are claimed then (checked every DEAD_CHECK_S, and just after the oldest live heartbeat
        # would lapse), whatever our free slots, ahead of new intake (which waits while we are
        # full); what cannot start here goes to workers with room (worker.intake.placement),
        # looked at every round. XAUTOCLAIM after claim_idle_ms is the fallback
        # for entries nobody else accounts for (hand-backs, workers gone from the registry); a
        # short interval is what makes a hand-back land elsewhere within a second. Neither runs
        # until we have watched Redis for a worker TTL without interruption (worker.intake.claims).
        scan_every = max(0.2, min(1.0, self.settings.claim_idle_ms / 2000))
        last_trim = last_scan = 0.0
        while not self.stopping():
            if await wait_event(self.stop, self.claims.next_check_s(DEAD_CHECK_S)):
                return
            try:
                await with_backoff(self.claims.claim_dead_workers, "claim from dead workers", self.stopping)
                await self.recheck_contested()
                await self.forwarding.refresh_view_if_stale()
                await self.placement.rebalance()
                free = self.table.free_slots()
                if free > 0 and self.claims.judging() and time.monotonic() - last_scan >= scan_every:
                    await with_backoff(lambda: self.claims.claim_once(free), "claim", self.stopping)
                    last_scan = time.monotonic()
                if time.monotonic() - last_trim > TRIM_EVERY_S:
                    await with_backoff(self.tend_group, "trim", self.stopping)
                    last_trim = time.monotonic()
            except asyncio.CancelledError:
                return
            except ResponseError as exc:
                log.warning("claim loop: %s", exc)

    # ---- contested entries ------------------------------------------------------------------

    def contested(self) -> set[str]:
        """The entries we wait on because another worker holds their request (logs, tests)."""
        return self.contests.entry_ids()

    async def recheck_contested(self) -> None:
        """Look again at contested entries whose owner's lease has ended by now."""
        if not len(self.contests):
            return
        if self.table.unhealthy:      # we cannot run them: make those we hold claimable elsewhere
            await self.contests.release()
            return
        for c in self.contests.due():
            await self.acceptor.accept(c.entry_id, c.fields, c.deliveries)
            self.placement.watch({c.entry_id}, {c.entry_id: c.deliveries})

    def knows_peers(self) -> bool:
        """Whether the last routing view holds another live worker (one that may forward to us)."""
        return any(w != self.forwarding.worker_id for w in self.forwarding.view)

    async def release_contested(self) -> None:
        """Forget the contested entries (we stop, or cannot run them); see Contests.release."""
        await self.contests.release()

    # ---- a routed entry handed to us --------------------------------------------------------

    async def take_forwarded(self, entry_id: str, deliveries: int) -> None:
        """Another worker handed us an entry routed here (`take` on our control stream): it is in
        our pending list; run it unless it moved on meanwhile (acked, or claimed by someone)."""
        if self.stopping() or self.table.unhealthy:
            await self.leases.hand_back([entry_id])
            return
        found = await self.forwarding.read_handed_over(entry_id)
        if found:
            await self.acceptor.accept(found[0], found[1], deliveries)
            self.placement.watch({entry_id}, {entry_id: deliveries})

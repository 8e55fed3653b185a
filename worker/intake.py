"""Taking work in: read new request entries, claim a dead worker's, and keep ours claimed.

Why its own module: ownership of a request entry is decided here and only here (with the
scripts of worker.ownership).

* intake: XREADGROUP only as many new entries as the engine has free slots (an idle worker
  elsewhere gets the rest instead of this one hoarding them);
* claim: the entries of a worker whose registry heartbeat lapsed (`worker_ttl_s`) at once, ahead
  of new intake; XAUTOCLAIM (following its cursor) of entries idle for `claim_idle_ms` for the
  rest (hand-backs, workers gone from the registry); see worker.failover for what happens to a
  request another worker started. A dead worker with nothing left pending is forgotten
  (registry entry, control stream, group consumer);
* accept: one script on the request's slot {r:rid} (worker.ownership.TAKE) makes us the owner
  only if the request is unowned, already ours, or its owner's lease lapsed; it bumps
  meta.epoch and reads the cancel flag, the history (progress, and the delivered token ids a
  continuation starts from) and meta.gw / meta.att (where live events go; whether someone
  resumed, so an attach marker goes first);
* contest: an entry delivered to us (a blocked read served while we were frozen, a claim)
  for a request another worker holds a live lease on is not run and nothing is written: we look
  again when that lease ends. Lapsed (its owner died): we take it. Refreshed (its owner lives):
  we leave it to the owner, without a write and without an ack ("yielded");
* keep-fresh: per request we own, extend the lease and read the cancel flag (worker.ownership.KEEP);
  a request whose epoch moved on was taken over: dropped here. Then XCLAIM ... JUSTID of every
  entry we own: resets its idle time (a slow but healthy worker's requests are never claimed
  away), and brings back one another consumer claimed (the PEL follows meta ownership);
* poison entries are dead-lettered through the output writer's commit (final error, then
  dead-letter XADD + XACK in one MULTI on slot {q}).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.exceptions import ResponseError

from shared.aio import wait_event
from shared.config import Settings
from shared.errors import ErrorCode
from shared.events import TokEvent
from shared.logs import rid_of
from shared.backlog import WorkerInfo, live_workers
from shared.streams import (CONSUMER_GROUP, ENTRY_FIELD, META_LEASE, META_OWNER, Keys, RequestEntry, as_str,
                            encode_take)
from shared.peer_liveness import PeerLiveness, server_run_id
from worker import consumer_group, failover, registry
from worker.engine_client import Add, Cancel, EngineClient
from worker.events import InFlight, Progress, progress_from_last
from worker.inflight import InFlightTable, Stats
from worker.output_writer import DeadLetter, OutputWriter
from worker.ownership import Finished, Held, Ownership, Taken
from worker.redis_io import TRANSIENT, Backoff, with_backoff

log = logging.getLogger("worker.intake")

BLOCK_MS = 1000          # XREAD BLOCK of the intake loop (bounds SIGTERM reaction)
TRIM_EVERY_S = 10.0
DEAD_CHECK_S = 0.25      # how often the registry is checked for workers whose heartbeat lapsed
VIEW_REFRESH_S = 1.0     # how often the live peers and their room are read (routing)
VIEW_RECHECK_S = 0.1     # at most this often again when an entry names a worker the view lacks
CTL_MAXLEN = 10000       # a worker's control stream (MAXLEN ~)
MAX_SCAN_CALLS = 50      # XAUTOCLAIM calls a round may take to walk the pending list
RECHECK_MARGIN_S = 0.05  # a contested entry is looked at again this long after the owner's lease ends


@dataclass
class Contest:
    """An entry delivered to us for a request another worker holds a live lease on."""
    entry_id: str
    fields: dict
    deliveries: int
    owner: str
    deadline_ms: int         # the owner's lease when we last looked (Redis's clock)
    recheck_at: float        # time.monotonic() at which to look again


class Intake:
    def __init__(self, *, redis, blocking_redis, keys: Keys, settings: Settings, worker_id: str,
                 table: InFlightTable, engine: EngineClient, writer: OutputWriter, stats: Stats,
                 stop: asyncio.Event):
        self.redis = redis                       # claims, meta, hand-back
        self.blocking_redis = blocking_redis     # XREADGROUP ... BLOCK only
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.table = table
        self.engine = engine
        self.writer = writer
        self.stats = stats
        self.stop = stop
        self.ownership = Ownership(redis, keys, settings, worker_id)
        self.contested: dict[str, Contest] = {}   # entry id -> a request another worker holds
        self.cursor = "0-0"      # where the next XAUTOCLAIM scan goes on
        # live peers and their room, for routing (refreshed every VIEW_REFRESH_S)
        self.view: dict[str, WorkerInfo] = {}
        self.view_at = 0.0
        # who is dead: not judged while Redis (or this process) was away (shared.peer_liveness)
        self.peers = PeerLiveness(self.settings.worker_ttl_s, what="peer workers")

    async def ensure_group(self) -> None:
        """Create or join the group, and put its counters right (a new Redis may have loaded
        them stale: worker.consumer_group)."""
        await consumer_group.ensure_group(self.redis, self.keys)
        await consumer_group.resync_entries_read(self.redis, self.keys)

    # ---- new entries ------------------------------------------------------------------------

    def stopping(self) -> bool:
        return self.stop.is_set()

    async def intake_loop(self) -> None:
        table = self.table
        while not self.stopping():
            free = table.free_slots()
            if free <= 0:
                table.capacity_event.clear()
                if table.free_slots() <= 0:
                    await table.capacity_event.wait()
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
                await self.release_entries([i for i, _ in entries])
                log.warning("engine unhealthy: handed back %d new entries", len(entries))
                continue
            for entry_id, fields in entries:
                await self.accept(entry_id, fields, deliveries=1)

    # ---- entries of dead workers ------------------------------------------------------------

    async def claim_loop(self) -> None:
        table = self.table
        # A dead worker is known from the registry as soon as its heartbeat lapses: its entries
        # are claimed then (checked every DEAD_CHECK_S), whatever our free slots, ahead of new
        # intake (which waits while we are full). XAUTOCLAIM after claim_idle_ms is the fallback
        # for entries nobody else accounts for (hand-backs, workers gone from the registry); a
        # short interval is what makes a hand-back land elsewhere within a second. Neither runs
        # until we have watched Redis for a worker TTL without interruption: after a Redis
        # restart every heartbeat and every entry's idle time is stale, and live peers need that
        # window to beat and refresh their entries again (shared.peer_liveness).
        scan_every = max(0.2, min(1.0, self.settings.claim_idle_ms / 2000))
        last_trim = last_scan = 0.0
        while not self.stopping():
            if await wait_event(self.stop, DEAD_CHECK_S):
                return
            try:
                await with_backoff(self.claim_dead_workers, "claim from dead workers", self.stopping)
                await self.recheck_contested()
                if time.monotonic() - self.view_at >= VIEW_REFRESH_S:
                    await with_backoff(self.refresh_view, "read the worker registry", self.stopping)
                free = table.free_slots()
                if free > 0 and self.peers.judging() and time.monotonic() - last_scan >= scan_every:
                    await with_backoff(lambda: self.claim_once(free), "claim", self.stopping)
                    last_scan = time.monotonic()
                if time.monotonic() - last_trim > TRIM_EVERY_S:
                    await with_backoff(self.tend_group, "trim", self.stopping)
                    last_trim = time.monotonic()
            except asyncio.CancelledError:
                return
            except ResponseError as exc:
                log.warning("claim loop: %s", exc)

    async def refresh_view(self) -> None:
        self.view = {w.worker_id: w for w in await live_workers(self.redis, self.keys, self.settings.worker_ttl_s)}
        self.view_at = time.monotonic()

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
        await self._accept_claimed(claimed)

    async def tend_group(self) -> None:
        """Trim finished entries; re-sync the group's counters if they are visibly off."""
        await consumer_group.trim_finished(self.redis, self.keys)
        if await consumer_group.counters_look_wrong(self.redis, self.keys):
            await consumer_group.resync_entries_read(self.redis, self.keys)

    async def watch_redis(self) -> None:
        """One liveness round: which Redis server answers, and how promptly. A new server
        (restart, failover) means stale heartbeats, idle times and group counters."""
        sent_at = self.peers.clock()
        run_id = await server_run_id(self.redis, self.keys.workers)
        if self.peers.observe(run_id, sent_at):
            await consumer_group.resync_entries_read(self.redis, self.keys)

    async def claim_dead_workers(self) -> None:
        """Claim the entries of every worker whose registry heartbeat is older than
        worker_ttl_s (up to our capacity a round), and clean up after those with none left."""
        try:
            await self.watch_redis()
            await self._claim_dead_workers()
        except TRANSIENT:
            self.peers.interrupted()   # what we read next may be stale: a fresh window first
            raise

    async def _claim_dead_workers(self) -> None:
        cutoff = self.peers.cutoff_ms()
        if self.table.unhealthy or cutoff is None:
            return
        silent = await self.redis.zrangebyscore(self.keys.workers, "-inf", cutoff)
        room = self.table.capacity
        for dead in (as_str(w) for w in silent):
            if dead == self.worker_id or room <= 0:
                continue
            pending = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min="-", max="+",
                                                      count=room, consumername=dead)
            if not pending:
                await registry.forget_dead(self.redis, self.keys, dead)
                log.info("worker %s is dead and owns nothing any more: removed its registry entry, control "
                         "stream and consumer", dead)
                continue
            # min-idle: of two survivors claiming at once only one gets each entry (XCLAIM resets
            # the idle time), and an entry the dead worker refreshed just before dying still qualifies
            min_idle = int(self.settings.worker_ttl_s * 500)
            claimed = await self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, min_idle,
                                              [p["message_id"] for p in pending])
            claimed = [(as_str(i), f) for i, f in claimed if f]
            if claimed:
                log.info("worker %s is dead (no heartbeat for %.1f s): claimed %d of its requests", dead,
                         self.settings.worker_ttl_s, len(claimed))
                room -= len(claimed)
                await self._accept_claimed(claimed)

    async def _accept_claimed(self, entries: list) -> None:
        if not entries:
            return
        # delivery counts (the claim has already counted this delivery)
        ids = sorted(entries, key=lambda e: tuple(int(x) for x in e[0].split("-")))
        pending = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min=ids[0][0],
                                                  max=ids[-1][0], count=len(entries) + 100,
                                                  consumername=self.worker_id)
        deliveries = {as_str(p["message_id"]): int(p["times_delivered"]) for p in pending}
        ours = {st.entry_id for st in self.table.requests.values()} | set(self.contested)
        for entry_id, fields in entries:
            if entry_id in ours:
                continue
            self.stats.claimed += 1
            await self.accept(entry_id, fields, deliveries=deliveries.get(entry_id, 2))

    # ---- taking one entry -------------------------------------------------------------------

    async def accept(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """One delivered entry: validate it, become the request's owner (or learn that a live
        worker is), decide, run."""
        prev = self.contested.pop(entry_id, None)
        raw = fields.get(ENTRY_FIELD) if fields else None
        try:
            entry = RequestEntry.decode(raw if raw is not None else b"")
        except ValueError as exc:
            await self.dead_letter(entry_id, str(exc), raw, deliveries, "invalid", fields=fields, prev=prev)
            return
        if entry.rid in self.table.requests:
            return
        if entry.route and entry.route != self.worker_id and prev is None and await self._forward(entry_id, entry,
                                                                                                   deliveries):
            return
        rid = entry.rid
        got = await self._take(entry_id, fields, deliveries, rid, prev, key_id=entry.key_id, gw=entry.gw)
        if got is None:
            return
        if isinstance(got, Finished):     # finished before its worker could ack it: ack only
            await self._ack_finished(rid, entry_id, entry)
            return
        history = got.history
        progress = progress_from_last(history[-1] if history else None)
        if deliveries > self.settings.max_deliveries:
            await self._dead_letter_taken(entry_id, f"delivered {deliveries} times without finishing", raw,
                                          deliveries, "deliveries", rid, got, progress, entry)
            return
        st = InFlight.start(rid, entry_id, entry, progress, epoch=got.epoch, gw=got.gw, worker=self.worker_id)
        # a continuation's first token is an earlier run's: TTFT counts from that one
        st.first_token_ms = next((e.ms for e in history if isinstance(e, TokEvent)), 0)
        if got.att > 0 and st.gw:
            st.marker_att = got.att
        decision = failover.decide(entry, progress, history)
        if decision.action == "ack":     # (TAKE answers Finished for these: only a final at an odd id)
            st.engine_done = st.final_written = True
            await with_backoff(lambda: self.redis.hdel(self.keys.meta(rid), META_OWNER, META_LEASE), "release owner")
        elif got.cancelled:
            st.finish_done("cancelled")
        elif decision.action == "lost":
            self.stats.lost += 1
            st.finish_error(ErrorCode.WORKER_LOST, failover.LOST_MESSAGE)
        if st.engine_done:
            self.table.requests[rid] = st        # until its final is written (retried if refused)
            await with_backoff(lambda: self.writer.commit([st]), "finish request")
            return
        if decision.action == "continue":
            self.stats.continued += 1
            log.info("continuing %s after its %d delivered tokens", rid, len(decision.generated_ids),
                     extra=rid_of(rid))
        else:
            log.debug("request %s taken (entry %s, epoch %d, priority %s)", rid, entry_id, st.epoch,
                      entry.priority, extra=rid_of(rid))
        self.table.requests[rid] = st
        self.engine.submit(Add(entry, generated_ids=decision.generated_ids))

    async def _forward(self, entry_id: str, entry: RequestEntry, deliveries: int) -> bool:
        """Routing (shared.routing): the entry names another worker, whose prefix cache holds
        its prompt. If that worker is live and has room, hand the entry to it (XCLAIM into its
        pending list, JUSTID so the delivery count stays, and a `take` on its control stream)
        and write nothing else; True when handed over. Otherwise it runs here: no request
        waits on a busy or dead worker."""
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

        async def handover():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, entry.route, 0, [entry_id], justid=True)
                pipe.xadd(self.keys.ctl(entry.route), {ENTRY_FIELD: encode_take(entry.rid, entry_id, deliveries)},
                          maxlen=CTL_MAXLEN, approximate=True)
                return await pipe.execute()
        await with_backoff(handover, "hand a routed entry over")
        self.stats.forwarded += 1
        log.debug("request %s routed to worker %s: handed it over", entry.rid, entry.route, extra=rid_of(entry.rid))
        return True

    async def take_forwarded(self, entry_id: str, deliveries: int) -> None:
        """Another worker handed us an entry routed here (`take` on our control stream): it is in
        our pending list; run it unless it moved on meanwhile (acked, or claimed by someone)."""
        if self.stopping() or self.table.unhealthy:
            await self.release_entries([entry_id])
            return

        async def read():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xrange(self.keys.requests, entry_id, entry_id)
                pipe.xpending_range(self.keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1,
                                    consumername=self.worker_id)
                return await pipe.execute()
        found, mine = await with_backoff(read, "read a routed entry")
        if found and mine:
            await self.accept(as_str(found[0][0]), found[0][1], deliveries)

    async def _take(self, entry_id: str, fields: dict, deliveries: int, rid: str, prev: Contest | None, *,
                    key_id: str, gw: str = "", whole_history: bool = True) -> Taken | Finished | None:
        """Become rid's owner (worker.ownership.TAKE). None: another worker holds a live lease
        on it, and nothing was written; the entry is contested (looked at again when that
        lease ends) or, if that owner proved alive since `prev`, left to it."""
        got = await with_backoff(lambda: self.ownership.take(rid, key_id=key_id, gw=gw, whole_history=whole_history),
                                 "take request")
        if isinstance(got, Held):
            self._contest(entry_id, fields, deliveries, rid, got, prev)
            return None
        if prev is not None:
            log.info("worker %s's lease on %s lapsed (it died): taking the request", prev.owner, rid,
                     extra=rid_of(rid))
        return got

    def _contest(self, entry_id: str, fields: dict, deliveries: int, rid: str, held: Held,
                 prev: Contest | None) -> None:
        if prev is not None and (held.owner != prev.owner or held.deadline_ms > prev.deadline_ms):
            # its owner refreshed the lease (alive), or another worker took it: it is theirs.
            # No write, no ack: the owner's keep-fresh brings the entry back to its own PEL.
            self.stats.yielded += 1
            log.info("request %s (entry %s) belongs to worker %s, which is alive: leaving it to it", rid, entry_id,
                     held.owner, extra=rid_of(rid))
            return
        if prev is None:
            log.info("request %s (entry %s) is held by worker %s for %d ms more: looking again then", rid, entry_id,
                     held.owner, held.remaining_ms, extra=rid_of(rid))
        self.contested[entry_id] = Contest(entry_id, fields, deliveries, held.owner, held.deadline_ms,
                                           time.monotonic() + held.remaining_ms / 1000 + RECHECK_MARGIN_S)

    async def recheck_contested(self) -> None:
        """Look again at contested entries whose owner's lease has ended by now."""
        if not self.contested:
            return
        if self.table.unhealthy:      # we cannot run them: make those we hold claimable elsewhere
            await self.release_contested()
            return
        now = time.monotonic()
        for c in [c for c in self.contested.values() if c.recheck_at <= now]:
            await self.accept(c.entry_id, c.fields, c.deliveries)

    async def release_contested(self) -> None:
        """Forget the contested entries (we stop, or cannot run them); those still pending
        under us become claimable by others at once (a live owner takes its own back anyway)."""
        contested, self.contested = list(self.contested), {}
        if not contested:
            return
        mine = await with_backoff(lambda: self.redis.xpending_range(
            self.keys.requests, CONSUMER_GROUP, min="-", max="+", count=len(self.table.requests) + len(contested) + 100,
            consumername=self.worker_id), "read pending")
        held = [i for i in contested if i in {as_str(p["message_id"]) for p in mine}]
        if held:
            await self.release_entries(held)

    async def _ack_finished(self, rid: str, entry_id: str, entry: RequestEntry | None, *,
                            dead_letter: dict | None = None, key_id: str = "") -> None:
        """Its history already ends with a final: ack it (and release its concurrency lease)."""
        st = InFlight.start(rid, entry_id, entry, Progress(finished=True), key_id=key_id, worker=self.worker_id)
        st.engine_done = st.final_written = True
        st.dead_letter = dead_letter
        self.table.requests[rid] = st
        await with_backoff(lambda: self.writer.commit([st]), "finish request")

    async def dead_letter(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                          *, fields: dict | None = None, prev: Contest | None = None) -> None:
        """An entry that cannot be run: dead letter + ack, and a final error for its client when
        its rid can be read (taking the request first, like any other entry, so a live owner
        keeps its own request)."""
        rid = failover.rid_of_raw(raw)
        if rid is None or rid in self.table.requests:
            self.stats.dead += 1
            log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason, extra=rid_of(rid))
            dl = DeadLetter(entry_id, failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries))
            await with_backoff(lambda: self.writer.commit([], [dl]), "dead-letter")
            return
        key_id = failover.key_id_of_raw(raw)
        got = await self._take(entry_id, fields or {}, deliveries, rid, prev, key_id=key_id, whole_history=False)
        if got is None:
            return
        progress = Progress(finished=True) if isinstance(got, Finished) else \
            progress_from_last(got.history[-1] if got.history else None)
        await self._dead_letter_taken(entry_id, reason, raw, deliveries, kind, rid, got, progress, None)

    async def _dead_letter_taken(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                                 rid: str, got: Taken | Finished, progress: Progress,
                                 entry: RequestEntry | None) -> None:
        """Dead-letter an entry whose request we own now (`got`): its final error follows
        whatever earlier attempts wrote (our epoch fences off any of them still writing)."""
        self.stats.dead += 1
        log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason, extra=rid_of(rid))
        fields = failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries)
        key_id = failover.key_id_of_raw(raw)
        if isinstance(got, Finished):
            await self._ack_finished(rid, entry_id, entry, dead_letter=fields, key_id=key_id)
            return
        st = InFlight.start(rid, entry_id, entry, progress, epoch=got.epoch, key_id=key_id, worker=self.worker_id)
        st.dead_letter = fields
        if progress.finished:
            st.engine_done = st.final_written = True
        else:
            st.finish_error(failover.DEAD_CODE[kind], f"request rejected by the worker: {reason}", retryable=False)
        self.table.requests[rid] = st
        await with_backoff(lambda: self.writer.commit([st]), "dead-letter")

    # ---- keeping our entries ----------------------------------------------------------------

    async def keep_fresh_loop(self) -> None:
        interval = self.ownership.interval
        while True:
            await asyncio.sleep(interval)
            if self.table.requests:
                # retried at this loop's own pace during an outage: when Redis is back, our
                # entries and leases are fresh again within `interval`, inside the window peers
                # give us
                await with_backoff(self.keep_fresh_once, "keep fresh", backoff=Backoff(cap=interval))

    async def keep_fresh_once(self) -> None:
        """Extend our leases and read the cancel flags; drop what was taken over; then make the
        PEL follow meta: every entry we own is pending under us, with its idle time reset."""
        states = list(self.table.requests.values())
        if not states:
            return
        verdicts = await self.ownership.keep(states)
        kept = []
        for st, verdict in zip(states, verdicts):
            if verdict < 0:              # its epoch moved on: another worker took it over
                if self.table.holds(st) and not st.final_written:
                    log.warning("request %s was taken over by another worker (meta.epoch is past %d); dropping it "
                                "here", st.rid, st.epoch, extra=rid_of(st.rid))
                    self.table.drop(st)
                continue
            kept.append(st)
            if verdict == 1 and self.table.holds(st) and not st.engine_done:
                self.engine.submit(Cancel(st.rid, received_at=time.time()))
        if kept:
            # an entry another consumer claimed comes back to us (that worker found our lease
            # alive and left the request to us); our own get their idle time reset
            await self.redis.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0,
                                    [st.entry_id for st in kept], justid=True)

    # ---- giving entries back ----------------------------------------------------------------

    async def release_entries(self, entry_ids: list[str], states: list[InFlight] = ()) -> None:
        """Make entries we hold claimable by any other worker right away: XCLAIM them to
        ourselves with an IDLE far above claim_idle_ms (the next XAUTOCLAIM elsewhere takes
        them), and clear owner and lease of the requests `states` (while still ours)."""
        idle_ms = max(10 * self.settings.claim_idle_ms, 3_600_000)

        async def op():
            if states:
                await self.ownership.load()
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0, entry_ids, idle=idle_ms,
                            justid=True)
                self.ownership.release_in(pipe, states)
                await pipe.execute()
        try:
            await asyncio.wait_for(with_backoff(op, "hand back"), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not hand back %d entries; they are claimed after claim_idle_ms", len(entry_ids))
        self.stats.handed_back += len(entry_ids)

"""Taking work in: read new request entries, claim a dead worker's, and keep ours claimed.

Why its own module: ownership of a request entry is decided here and only here.

* intake: XREADGROUP only as many new entries as the engine has free slots (an idle worker
  elsewhere gets the rest instead of this one hoarding them);
* claim: the entries of a worker whose registry heartbeat lapsed (`worker_ttl_s`) at once, ahead
  of new intake; XAUTOCLAIM (following its cursor) of entries idle for `claim_idle_ms` for the
  rest (hand-backs, workers gone from the registry); see worker.failover for what happens to a
  request another worker started. A dead worker with nothing left pending is forgotten
  (registry entry, control stream, group consumer);
* accept: one MULTI on the request's slot {r:rid} sets meta.owner, bumps meta.epoch, reads the
  cancel flag, the history (progress, and the delivered token ids a continuation starts from)
  and meta.gw / meta.att (where live events go; whether someone resumed, so an attach marker
  goes first);
* keep-fresh: XCLAIM ... JUSTID of our own pending entries resets their idle time, so a slow
  but healthy worker's requests are never claimed away; notices requests claimed away anyway
  (after a long stall) and drops them; polls the cancel flags;
* poison entries are dead-lettered through the output writer's commit (final error, then
  dead-letter XADD + XACK in one MULTI on slot {q}).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import ResponseError

from shared.aio import wait_event
from shared.config import Settings
from shared.errors import ErrorCode
from shared.streams import (CONSUMER_GROUP, ENTRY_FIELD, META_ATT, META_EPOCH, META_GW, META_KEY, META_OWNER,
                            Keys, RequestEntry, as_str, decode_event)
from shared.peer_liveness import PeerLiveness, server_run_id
from worker import consumer_group, failover, registry
from worker.engine_client import Add, Cancel, EngineClient
from worker.events import InFlight, progress_from_last
from worker.inflight import InFlightTable, Stats
from worker.output_writer import DeadLetter, OutputWriter
from worker.redis_io import TRANSIENT, Backoff, with_backoff

log = logging.getLogger("worker.intake")

BLOCK_MS = 1000          # XREAD BLOCK of the intake loop (bounds SIGTERM reaction)
TRIM_EVERY_S = 10.0
DEAD_CHECK_S = 0.25      # how often the registry is checked for workers whose heartbeat lapsed
MAX_SCAN_CALLS = 50      # XAUTOCLAIM calls a round may take to walk the pending list


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
        self.cursor = "0-0"      # where the next XAUTOCLAIM scan goes on
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
        ours = {st.entry_id for st in self.table.requests.values()}
        for entry_id, fields in entries:
            if entry_id in ours:
                continue
            self.stats.claimed += 1
            await self.accept(entry_id, fields, deliveries=deliveries.get(entry_id, 2))

    # ---- taking one entry -------------------------------------------------------------------

    async def accept(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """Take ownership of one delivered entry: validate, claim it in meta, decide, run."""
        raw = fields.get(ENTRY_FIELD) if fields else None
        try:
            entry = RequestEntry.decode(raw if raw is not None else b"")
        except ValueError as exc:
            await self.dead_letter(entry_id, str(exc), raw, deliveries, "invalid")
            return
        if deliveries > self.settings.max_deliveries:
            await self.dead_letter(entry_id, f"delivered {deliveries} times without finishing", raw,
                                   deliveries, "deliveries", entry=entry)
            return
        if entry.rid in self.table.requests:
            return
        keys, rid = self.keys, entry.rid

        async def claim():
            async with self.redis.pipeline(transaction=True) as pipe:   # slot {r:rid}
                pipe.hset(keys.meta(rid), META_OWNER, self.worker_id)
                pipe.hsetnx(keys.meta(rid), META_KEY, entry.key_id)
                if entry.gw:
                    pipe.hsetnx(keys.meta(rid), META_GW, entry.gw)
                pipe.hincrby(keys.meta(rid), META_EPOCH, 1)
                pipe.hmget(keys.meta(rid), [META_GW, META_ATT])
                pipe.expire(keys.meta(rid), self.settings.output_ttl_s)
                pipe.exists(keys.cancel(rid))
                # the whole history (empty for a new request): its token ids are what a
                # continuation starts from, read in the same MULTI that makes us the owner
                pipe.xrange(keys.out(rid))
                return await pipe.execute()
        *_, epoch, (gw, att), _, cancelled, raw_history = await with_backoff(claim, "claim request")
        history = [decode_event(fields[ENTRY_FIELD]) for _id, fields in raw_history]
        progress = progress_from_last(history[-1] if history else None)
        st = InFlight.start(rid, entry_id, entry, progress, epoch=int(epoch), gw=as_str(gw) if gw else "")
        if att and int(att) > 0 and st.gw:
            st.marker_att = int(att)
        decision = failover.decide(entry, progress, history)
        if decision.action == "ack":     # finished before its worker died: ack only
            st.engine_done = st.final_written = True
            await with_backoff(lambda: self.redis.hdel(keys.meta(rid), META_OWNER), "release owner")
        elif cancelled:
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
            log.info("continuing %s after its %d delivered tokens", rid, len(decision.generated_ids))
        self.table.requests[rid] = st
        self.engine.submit(Add(entry, generated_ids=decision.generated_ids))

    async def dead_letter(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                          entry: RequestEntry | None = None) -> None:
        rid = entry.rid if entry else failover.rid_of_raw(raw)
        self.stats.dead += 1
        log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason)
        fields = failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries)
        if rid is None or rid in self.table.requests:
            await with_backoff(lambda: self.writer.commit([], [DeadLetter(entry_id, fields)]), "dead-letter")
            return
        # the final event must follow whatever earlier attempts wrote; taking the next epoch
        # fences off any earlier worker still writing
        async def take():
            async with self.redis.pipeline(transaction=True) as pipe:   # slot {r:rid}
                pipe.hincrby(self.keys.meta(rid), META_EPOCH, 1)
                pipe.expire(self.keys.meta(rid), self.settings.output_ttl_s)
                pipe.xrevrange(self.keys.out(rid), count=1)
                return await pipe.execute()
        epoch, _, last = await with_backoff(take, "read progress")
        progress = progress_from_last(decode_event(last[0][1][ENTRY_FIELD]) if last else None)
        st = InFlight.start(rid, entry_id, entry, progress, epoch=int(epoch), key_id=failover.key_id_of_raw(raw))
        st.dead_letter = fields
        if progress.finished:
            st.engine_done = st.final_written = True
        else:
            st.finish_error(failover.DEAD_CODE[kind], f"request rejected by the worker: {reason}", retryable=False)
        self.table.requests[rid] = st
        await with_backoff(lambda: self.writer.commit([st]), "dead-letter")

    # ---- keeping our entries ----------------------------------------------------------------

    async def keep_fresh_loop(self) -> None:
        interval = max(0.1, min(self.settings.worker_heartbeat_s, self.settings.claim_idle_ms / 3000))
        while True:
            await asyncio.sleep(interval)
            if self.table.requests:
                # retried at this loop's own pace during an outage: when Redis is back, our
                # entries are fresh again within `interval`, inside the window peers give us
                await with_backoff(self.keep_fresh_once, "keep fresh", backoff=Backoff(cap=interval))

    async def keep_fresh_once(self) -> None:
        states = list(self.table.requests.values())
        if not states:
            return
        mine = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min="-", max="+",
                                              count=len(states) + self.table.capacity + 100,
                                              consumername=self.worker_id)
        pending = {as_str(p["message_id"]) for p in mine}
        kept = []
        for st in states:
            if st.entry_id in pending:
                kept.append(st)
            elif self.table.holds(st) and not st.final_written:
                # claimed by another worker (we stalled past claim_idle_ms): it owns it now
                log.warning("request %s was claimed by another worker; dropping it here", st.rid)
                self.table.drop(st)
        if not kept:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0, [st.entry_id for st in kept],
                        justid=True)
            for st in kept:
                pipe.exists(self.keys.cancel(st.rid))
                pipe.expire(self.keys.meta(st.rid), self.settings.output_ttl_s)
            results = await pipe.execute()
        for i, st in enumerate(kept):
            if results[1 + 2 * i] and self.table.holds(st) and not st.engine_done:
                self.engine.submit(Cancel(st.rid))

    # ---- giving entries back ----------------------------------------------------------------

    async def release_entries(self, entry_ids: list[str], rids: list[str] = ()) -> None:
        """Make entries we hold claimable by any other worker right away: XCLAIM them to
        ourselves with an IDLE far above claim_idle_ms (the next XAUTOCLAIM elsewhere takes
        them), and clear ourselves as the owner of `rids`."""
        idle_ms = max(10 * self.settings.claim_idle_ms, 3_600_000)

        async def op():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0, entry_ids, idle=idle_ms,
                            justid=True)
                for rid in rids:
                    pipe.hdel(self.keys.meta(rid), META_OWNER)
                await pipe.execute()
        try:
            await asyncio.wait_for(with_backoff(op, "hand back"), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not hand back %d entries; they are claimed after claim_idle_ms", len(entry_ids))
        self.stats.handed_back += len(entry_ids)

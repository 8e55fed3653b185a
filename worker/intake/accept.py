"""Taking one delivered entry: validate it, forward it, or become its request's owner and run it.

Why its own module: every way an entry reaches this worker (a read, a claim, a hand-over, a
contested entry looked at again) ends here, so what happens to one entry is decided in one
place. Becoming the owner is one script on the request's slot {r:rid} (worker.ownership.TAKE):
only if the request is unowned, already ours, or its owner's lease lapsed; it bumps meta.epoch
and reads the cancel flag, the history (progress, and the delivered token ids a continuation
starts from) and meta.gw / meta.att (where live events go; whether someone resumed, so an
attach marker goes first). What to do with a request another worker started is
worker.failover's decision.
"""

from __future__ import annotations

import logging

from shared.config import Settings
from shared.errors import ErrorCode
from shared.events import TokEvent
from shared.logs import rid_of
from shared.streams import ENTRY_FIELD, META_LEASE, META_OWNER, Keys, RequestEntry
from worker import failover
from worker.engine_client import Add, EngineClient
from worker.events import InFlight, progress_from_last
from worker.inflight import InFlightTable, Stats
from worker.intake.contests import Contests
from worker.intake.dead_letters import DeadLetters
from worker.intake.forwarding import Forwarding
from worker.output_writer import OutputWriter
from worker.ownership import Finished
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")


class Acceptor:
    def __init__(self, *, redis, keys: Keys, settings: Settings, worker_id: str, table: InFlightTable,
                 engine: EngineClient, writer: OutputWriter, stats: Stats, contests: Contests,
                 forwarding: Forwarding, dead_letters: DeadLetters):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.table = table
        self.engine = engine
        self.writer = writer
        self.stats = stats
        self.contests = contests
        self.forwarding = forwarding
        self.dead_letters = dead_letters

    async def accept(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """One delivered entry: validate it, become the request's owner (or learn that a live
        worker is), decide, run."""
        prev = self.contests.pop(entry_id)
        raw = fields.get(ENTRY_FIELD) if fields else None
        try:
            entry = RequestEntry.decode(raw if raw is not None else b"")
        except ValueError as exc:
            await self.dead_letters.dead_letter(entry_id, str(exc), raw, deliveries, "invalid", fields=fields,
                                                prev=prev)
            return
        if entry.rid in self.table:
            return
        if entry.route and entry.route != self.worker_id and prev is None and await self.forwarding.forward(
                entry_id, entry, deliveries):
            return
        rid = entry.rid
        got = await self.contests.take(entry_id, fields, deliveries, rid, prev, key_id=entry.key_id, gw=entry.gw)
        if got is None:
            return
        if isinstance(got, Finished):     # finished before its worker could ack it: ack only
            await self.dead_letters.ack_finished(rid, entry_id, entry)
            return
        history = got.history
        progress = progress_from_last(history[-1] if history else None)
        if deliveries > self.settings.max_deliveries:
            await self.dead_letters.dead_letter_taken(entry_id, f"delivered {deliveries} times without finishing",
                                                      raw, deliveries, "deliveries", rid, got, progress, entry)
            return
        st = InFlight.start(rid, entry_id, entry, progress, epoch=got.epoch, gw=got.gw, worker=self.worker_id,
                            lease_until=got.lease_until)
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
            self.table.add(st)        # until its final is written (retried if refused)
            await with_backoff(lambda: self.writer.commit([st]), "finish request")
            return
        if decision.action == "continue":
            self.stats.continued += 1
            log.info("continuing %s after its %d delivered tokens", rid, len(decision.generated_ids),
                     extra=rid_of(rid))
        else:
            log.debug("request %s taken (entry %s, epoch %d, priority %s)", rid, entry_id, st.epoch,
                      entry.priority, extra=rid_of(rid))
        self.table.add(st)
        self.engine.submit(Add(entry, generated_ids=decision.generated_ids))

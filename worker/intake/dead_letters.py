"""Ending a request without running it: dead letters, and entries whose request already ended.

Why its own module: an entry that cannot be run (it does not decode or validate, or it was
delivered more than `max_deliveries` times: a request that crashes every worker that takes it)
must still end exactly once and never be retried forever (worker.failover). It goes through
the output writer's commit like any other end: the final error for its client when its rid is
known, then dead-letter XADD + XACK in one MULTI on slot {q}. A request whose history already
ends with a final (its worker died before the ack) is ended the same way, with the ack only.
"""

from __future__ import annotations

import logging

from shared.logs import rid_of
from shared.streams import RequestEntry
from worker import failover
from worker.events import InFlight, Progress, progress_from_last
from worker.inflight import InFlightTable, Stats
from worker.intake.contests import Contest, Contests
from worker.output_writer import DeadLetter, OutputWriter
from worker.ownership import Finished, Taken
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")


class DeadLetters:
    def __init__(self, *, worker_id: str, table: InFlightTable, writer: OutputWriter, contests: Contests,
                 stats: Stats):
        self.worker_id = worker_id
        self.table = table
        self.writer = writer
        self.contests = contests
        self.stats = stats

    async def dead_letter(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                          *, fields: dict | None = None, prev: Contest | None = None) -> None:
        """An entry that cannot be run: dead letter + ack, and a final error for its client when
        its rid can be read (taking the request first, like any other entry, so a live owner
        keeps its own request)."""
        rid = failover.rid_of_raw(raw)
        if rid is None or rid in self.table:
            self.stats.dead += 1
            log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason, extra=rid_of(rid))
            dl = DeadLetter(entry_id, failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries))
            await with_backoff(lambda: self.writer.commit([], [dl]), "dead-letter")
            return
        key_id = failover.key_id_of_raw(raw)
        got = await self.contests.take(entry_id, fields or {}, deliveries, rid, prev, key_id=key_id,
                                       whole_history=False)
        if got is None:
            return
        progress = Progress(finished=True) if isinstance(got, Finished) else \
            progress_from_last(got.history[-1] if got.history else None)
        await self.dead_letter_taken(entry_id, reason, raw, deliveries, kind, rid, got, progress, None)

    async def dead_letter_taken(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                                rid: str, got: Taken | Finished, progress: Progress,
                                entry: RequestEntry | None) -> None:
        """Dead-letter an entry whose request we own now (`got`): its final error follows
        whatever earlier attempts wrote (our epoch fences off any of them still writing)."""
        self.stats.dead += 1
        log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason, extra=rid_of(rid))
        fields = failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries)
        key_id = failover.key_id_of_raw(raw)
        if isinstance(got, Finished):
            await self.ack_finished(rid, entry_id, entry, dead_letter=fields, key_id=key_id)
            return
        st = InFlight.start(rid, entry_id, entry, progress, epoch=got.epoch, key_id=key_id, worker=self.worker_id,
                            lease_until=got.lease_until)
        st.dead_letter = fields
        if progress.finished:
            st.engine_done = st.final_written = True
        else:
            st.finish_error(failover.DEAD_CODE[kind], f"request rejected by the worker: {reason}", retryable=False)
        self.table.add(st)
        await with_backoff(lambda: self.writer.commit([st]), "dead-letter")

    async def ack_finished(self, rid: str, entry_id: str, entry: RequestEntry | None, *,
                           dead_letter: dict | None = None, key_id: str = "") -> None:
        """Its history already ends with a final: ack it (and release its concurrency lease)."""
        st = InFlight.start(rid, entry_id, entry, Progress(finished=True), key_id=key_id, worker=self.worker_id)
        st.engine_done = st.final_written = True
        st.dead_letter = dead_letter
        self.table.add(st)
        await with_backoff(lambda: self.writer.commit([st]), "finish request")

"""Taking a request, and the entries we could not take because another worker holds them.

Why its own module: an entry can reach us for a request another worker holds a live lease on
(a blocked read served while we were frozen, a claim). Such an entry is "contested": it is
not run and nothing is written; we look again when that lease ends. Lapsed by then (its owner
died): we take it. Refreshed (its owner lives): we leave it to the owner, without a write and
without an ack ("yielded"; the owner's keep-fresh brings the entry back to its own pending
list, worker.leases).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from shared.logs import rid_of
from worker.inflight import Stats
from worker.leases import Leases
from worker.ownership import Finished, Held, Ownership, Taken
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")

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


class Contests:
    def __init__(self, *, ownership: Ownership, leases: Leases, stats: Stats):
        self.ownership = ownership
        self.leases = leases
        self.stats = stats
        self._contested: dict[str, Contest] = {}   # entry id -> a request another worker holds

    def __len__(self) -> int:
        return len(self._contested)

    def entry_ids(self) -> set[str]:
        return set(self._contested)

    def pop(self, entry_id: str) -> Contest | None:
        """The contest of `entry_id`, if it was one (it is being looked at again now)."""
        return self._contested.pop(entry_id, None)

    def due(self) -> list[Contest]:
        """Contested entries whose owner's lease has ended by now."""
        now = time.monotonic()
        return [c for c in self._contested.values() if c.recheck_at <= now]

    async def take(self, entry_id: str, fields: dict, deliveries: int, rid: str, prev: Contest | None, *,
                   key_id: str, gw: str = "", whole_history: bool = True) -> Taken | Finished | None:
        """Become rid's owner (worker.ownership.TAKE). None: another worker holds a live lease
        on it, and nothing was written; the entry is contested (looked at again when that
        lease ends) or, if that owner proved alive since `prev`, left to it."""
        got = await with_backoff(lambda: self.ownership.take(rid, key_id=key_id, gw=gw, whole_history=whole_history),
                                 "take request")
        return self._settle(entry_id, fields, deliveries, rid, got, prev)

    async def take_many(self, entries: list[tuple[str, dict, int, str, Contest | None, str, str]]
                        ) -> list[Taken | Finished | None]:
        """`take` of each (entry id, fields, deliveries, rid, prev, key id, gw), in one pipeline."""
        gots = await with_backoff(lambda: self.ownership.take_many([(rid, key_id, gw)
                                                                    for _i, _f, _d, rid, _p, key_id, gw in entries]),
                                  "take requests")
        return [self._settle(entry_id, fields, deliveries, rid, got, prev)
                for (entry_id, fields, deliveries, rid, prev, _k, _g), got in zip(entries, gots)]

    def _settle(self, entry_id: str, fields: dict, deliveries: int, rid: str, got: Taken | Held | Finished,
                prev: Contest | None) -> Taken | Finished | None:
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
        self._contested[entry_id] = Contest(entry_id, fields, deliveries, held.owner, held.deadline_ms,
                                            time.monotonic() + held.remaining_ms / 1000 + RECHECK_MARGIN_S)

    async def release(self) -> None:
        """Forget the contested entries (we stop, or cannot run them); those still pending
        under us become claimable by others at once (a live owner takes its own back anyway)."""
        contested, self._contested = list(self._contested), {}
        if not contested:
            return
        mine = set(await with_backoff(self.leases.pending_ids, "read pending"))
        held = [i for i in contested if i in mine]
        if held:
            await self.leases.hand_back(held)

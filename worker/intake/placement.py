"""Placing claimed work where it can start: what a claimant cannot start goes to a live worker
with room, at claim time or as soon as one has room.

Why its own module: a dead worker's requests are claimed by whichever survivor sees the death
first, whatever its room (worker.intake.claims): claiming at once is what keeps failover short.
But a survivor whose batch is full can only queue them, and they waited behind its running
streams (issue 34: 13 claimed requests waited 16-18 s while the worker they came from, paused,
fenced and back, sat idle). So:

* at claim time, what does not fit the claimant's running batch goes to live peers with room
  (the registry view, read again right then) through the routing hand-over (XCLAIM into the
  peer's pending list + `take` on its control stream, worker.intake.forwarding); what nobody
  has room for stays here, queued;
* claimed (and handed-over) requests are watched until they start. One that has not started
  within `worker_ttl_s` while a live peer has room is taken back from the engine (silently:
  nothing of it was written here), released (owner and lease cleared, worker.ownership) and
  handed to that peer the same way; the peer takes it and continues it from its history. A
  worker that was paused, fenced and came back is such a peer as soon as it beats again.

"Not started" is read off what the worker sees, not asked of the engine: no output since it
was taken here, while the engine reports requests waiting. The newest go first (the engine
admits in arrival order within a lane), at most as many as are waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Sequence, TypeVar

from shared.config import Settings
from shared.streams import ENTRY_FIELD, RequestEntry
from worker.engine_client import Cancel, EngineClient
from worker.events import InFlight
from worker.inflight import InFlightTable, Stats
from worker.intake.forwarding import Forwarding, HandOver
from worker.ownership import Ownership
from worker.redis_io import with_backoff

log = logging.getLogger("worker.intake")

T = TypeVar("T")


def assign(items: Sequence[T], rooms: dict[str, int]) -> tuple[list[tuple[T, str]], list[T]]:
    """`items` in order to the peers of `rooms` (peer -> free slots), each to the peer with the
    most room left, none past its room: (item, peer) pairs, and the items nobody had room for."""
    left = {peer: n for peer, n in rooms.items() if n > 0}
    moves: list[tuple[T, str]] = []
    for item in items:
        peer = max(left, key=left.__getitem__, default=None)
        if peer is None:
            break
        moves.append((item, peer))
        left[peer] -= 1
        if not left[peer]:
            del left[peer]
    return moves, list(items[len(moves):])


@dataclass
class Watch:
    """A request taken here from a claim or a hand-over, not started yet."""
    st: InFlight
    deliveries: int
    since: float             # time.monotonic() when it was taken here
    seq: int                 # tokens in its history then

    def started(self) -> bool:
        st = self.st
        return st.engine_done or st.seq != self.seq or bool(st.pending.ids)


class Placement:
    def __init__(self, *, settings: Settings, worker_id: str, table: InFlightTable, engine: EngineClient,
                 ownership: Ownership, forwarding: Forwarding, stats: Stats, stop: asyncio.Event):
        self.worker_id = worker_id
        self.table = table
        self.engine = engine
        self.ownership = ownership
        self.forwarding = forwarding
        self.stats = stats
        self.stop = stop
        self.start_within_s = settings.worker_ttl_s
        self._watched: dict[str, Watch] = {}     # rid -> a request that has not started here yet

    def stopping(self) -> bool:
        return self.stop.is_set()

    def watched(self) -> set[str]:
        """The requests waiting to start here (logs, tests)."""
        return set(self._watched)

    # ---- at claim time ----------------------------------------------------------------------

    def split(self, entries: list[T]) -> tuple[list[T], list[T]]:
        """Claimed entries -> (those our running batch has room for, the rest)."""
        room = max(0, self.table.capacity - self.table.running_count())
        return entries[:room], entries[room:]

    async def hand_on(self, entries: list[tuple[str, dict]], deliveries: dict[str, int]) -> list[tuple[str, dict]]:
        """Claimed entries (in our pending list) our batch has no room for: to live peers with
        room (the registry read again now); returns those nobody has room for (they queue here)."""
        if not entries or self.stopping():
            return entries
        await with_backoff(self.forwarding.refresh_view, "read the worker registry", self.stopping)
        extra = [(entry_id, rid) for entry_id, fields in entries if (rid := _rid(fields)) is not None]
        moves, _ = assign(extra, self.forwarding.rooms())
        if not moves:
            return entries
        hand = [HandOver(entry_id, rid, deliveries.get(entry_id, 2), peer) for (entry_id, rid), peer in moves]
        await with_backoff(lambda: self.forwarding.hand_over(hand), "hand claimed entries over")
        self.stats.placed += len(hand)
        log.info("claimed %d entries more than there is room for here: handed %d to workers with room (%s)",
                 len(entries), len(hand), sorted({m.peer for m in hand}))
        gone = {m.entry_id for m in hand}
        return [(i, f) for i, f in entries if i not in gone]

    # ---- until they start -------------------------------------------------------------------

    def watch(self, entry_ids: set[str], deliveries: dict[str, int]) -> None:
        """Requests just taken here from these entries: watched until they start."""
        if not entry_ids:
            return
        now = time.monotonic()
        for st in self.table.states():
            if st.entry_id in entry_ids and not st.engine_done and st.rid not in self._watched:
                self._watched[st.rid] = Watch(st, deliveries.get(st.entry_id, 2), now, st.seq)

    async def rebalance(self) -> None:
        """Hand watched requests that did not start within `worker_ttl_s` to live peers with
        room (the view is the claim loop's, refreshed every VIEW_REFRESH_S)."""
        if not self._watched:
            return
        for rid, w in list(self._watched.items()):
            if not self.table.holds(w.st) or w.started():
                del self._watched[rid]
        now = time.monotonic()
        due = [w for w in self._watched.values() if now - w.since >= self.start_within_s]
        waiting = self.engine.waiting
        if not due or waiting <= 0 or self.stopping():
            return
        rooms = self.forwarding.rooms()
        due.sort(key=lambda w: w.since, reverse=True)
        moves, _ = assign(due[:waiting], rooms)
        if not moves:
            return
        states = [w.st for w, _peer in moves]
        for st in states:
            del self._watched[st.rid]
            self.engine.submit(Cancel(st.rid, silent=True))
        self.table.remove([st.rid for st in states])   # outputs it may still have made are dropped
        hand = [HandOver(w.st.entry_id, w.st.rid, w.deliveries, peer) for w, peer in moves]

        async def op() -> None:
            await self.ownership.load()
            await self.forwarding.hand_over(hand, before=lambda pipe: self.ownership.release_in(pipe, states))
        await with_backoff(op, "hand waiting work over")
        self.stats.placed += len(hand)
        self.table.wake()
        log.info("%d claimed requests did not start here within %.1f s: handed to workers with room (%s)",
                 len(hand), self.start_within_s, sorted({m.peer for m in hand}))


def _rid(fields: dict) -> str | None:
    """The entry's request id (None: it does not decode; it stays here, to be dead-lettered)."""
    try:
        return RequestEntry.decode(fields.get(ENTRY_FIELD) or b"").rid
    except ValueError:
        return None

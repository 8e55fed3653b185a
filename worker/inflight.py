"""The requests this worker runs right now, the room left for more, and the worker's counters.

Why its own module: intake adds requests, the output writer finishes or fences them, control
and the lifecycle look them up, and each needs the same answers (how many still run, how many
more fit, what to do with one another worker took over). They share this table, passed to each
of them, instead of reaching into the service for its attributes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from shared.logs import rid_of
from worker.engine_client import Cancel, EngineClient
from worker.events import InFlight

log = logging.getLogger("worker.inflight")


@dataclass
class Stats:
    """What the worker did with requests (logged at exit; some go into its registry entry)."""
    finished: int = 0      # ended here: final written and acked
    continued: int = 0     # taken over mid-stream and continued from the delivered tokens
    lost: int = 0          # taken over with a history too incomplete to continue (worker_lost)
    dead: int = 0          # dead-lettered
    claimed: int = 0       # taken from another worker (dead, or handed back)
    handed_back: int = 0   # given back on drain or when the engine failed
    dropped: int = 0       # stopped here because another worker took them over
    yielded: int = 0       # delivered to us, but another worker held them: left to it untouched
    forwarded: int = 0     # routed to another live worker with room (its cache): handed to it

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class InFlightTable:
    """Every request this worker owns, from accept until its final is written and acked.

    The table owns its dict: a request comes in with `add` (intake) and leaves with `finished`
    (its final is written and acked), `drop` (another worker took it over) or `remove` (handed
    back); everyone else reads through the methods below, or `view` (read-only, live)."""

    def __init__(self, engine: EngineClient, *, capacity: int, queue_depth: int, stats: Stats,
                 on_finished: Callable[[InFlight], None] = lambda st: None):
        self.engine = engine
        self.on_finished = on_finished      # once per request whose final is written (metrics)
        self.capacity = capacity            # the engine's running batch
        self.queue_depth = queue_depth      # queued in the engine beyond it
        self.stats = stats
        self._requests: dict[str, InFlight] = {}
        # rid -> request, read-only and live: what the output writer routes outputs to and writes
        self.view: Mapping[str, InFlight] = MappingProxyType(self._requests)
        self._room = asyncio.Event()   # set whenever room may have opened (or we stop)

    # ---- reading ----------------------------------------------------------------------------

    def __contains__(self, rid: str) -> bool:
        return rid in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, rid: str) -> InFlight | None:
        return self._requests.get(rid)

    def states(self) -> list[InFlight]:
        """A snapshot of every request here (safe to iterate while the table changes)."""
        return list(self._requests.values())

    def entry_ids(self) -> set[str]:
        """The request-stream entries of the requests here."""
        return {st.entry_id for st in self._requests.values()}

    def holds(self, st: InFlight) -> bool:
        return self._requests.get(st.rid) is st

    def running(self) -> list[InFlight]:
        """Requests the engine is still working on (the others only wait for their last write)."""
        return [st for st in self._requests.values() if not st.engine_done]

    def running_count(self) -> int:
        return sum(1 for st in self._requests.values() if not st.engine_done)

    def lease_lapsed(self, now: float) -> int:
        """Requests whose output is held because our lease on them passed its deadline
        unrenewed (worker.ownership, `lease_until`). Safe from the metrics thread (one C-level copy)."""
        return sum(1 for st in list(self._requests.values())
                   if not st.may_write(now) and not st.final_written and not st.fenced)

    @property
    def unhealthy(self) -> str:
        """Why the engine cannot serve ("" when it can): every step fails."""
        return self.engine.unhealthy_reason

    def free_slots(self) -> int:
        """Room for new or claimed work: the running batch plus WORKER_QUEUE_DEPTH queued in the
        engine, whose admission and prefill follow lanes (interactive first, batch aged); with
        an empty engine queue a lane could only order what happens to be read together. None
        while the engine is unhealthy."""
        if self.unhealthy:
            return 0
        return self.capacity + self.queue_depth - self.running_count()

    def wake(self) -> None:
        self._room.set()

    async def wait_for_room(self) -> None:
        """Return once room may have opened (a request left, or we stop); at once if there is room."""
        self._room.clear()
        if self.free_slots() <= 0:
            await self._room.wait()

    # ---- coming and going -------------------------------------------------------------------

    def add(self, st: InFlight) -> None:
        """rid is ours now (taken, to run or only to finish): here until it leaves by one of
        the ways below."""
        self._requests[st.rid] = st

    def remove(self, rids: Iterable[str]) -> list[InFlight]:
        """Handed back (drain, a dead engine): they leave without a final; returns those that were here."""
        return [self._requests.pop(rid) for rid in rids if rid in self._requests]

    # ---- the output writer's callbacks -------------------------------------------------------

    def finished(self, done: list[InFlight]) -> None:
        """Their final is in history and their entry acked: they leave the table."""
        for st in done:
            if self.holds(st):
                del self._requests[st.rid]
                self.stats.finished += 1
                self.on_finished(st)
                log.debug("request %s finished here: %s, %d tokens", st.rid, st.finish_reason or "ended",
                          st.completion_tokens, extra=rid_of(st.rid))
        self.wake()

    def drop(self, st: InFlight) -> None:
        """Another worker owns rid now (its epoch moved on: our write was fenced, or keep-fresh
        saw it): forget it here without a final and without an ack; the engine stops it silently."""
        st.fenced = True
        if self.holds(st):
            del self._requests[st.rid]
            self.stats.dropped += 1
            if not st.engine_done:
                self.engine.submit(Cancel(st.rid, silent=True))
        self.wake()

    def give_up(self, st: InFlight) -> None:
        """Redis keeps refusing rid's output: stop generating it; its slot is free again."""
        self.engine.submit(Cancel(st.rid, silent=True))
        self.wake()

"""One process-wide timer for every session's heartbeat, instead of a timer and a waiting task
per socket.

An idle session costs no task and no timer of its own: it sits in a bucket of this wheel, keyed
by when its heartbeat is due (its last frame + HEARTBEAT_S). Each tick empties the buckets that
came due: a session that sent nothing since gets a heartbeat (its sender task runs for that one
frame and ends), one that was busy is put back at its new due time. Work per tick is the
sessions due in that tick (sessions / HEARTBEAT_S per second), never all of them.

The tick is a quarter of the interval (at most 1 s), and a bucket is processed no earlier than
the due times it holds, so an idle socket hears a heartbeat every HEARTBEAT_S plus at most one
tick (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict

from gateway.session import Session
from shared.aio import cancel_and_wait

log = logging.getLogger("gateway.heartbeats")

MAX_TICK_S = 1.0
EARLY_S = 0.05        # a heartbeat this close to due goes out now (its send lands a moment later)


class HeartbeatWheel:
    def __init__(self, interval_s: float, *, clock=time.monotonic):
        self.interval_s = interval_s
        self.tick_s = max(0.01, min(MAX_TICK_S, interval_s / 4)) if interval_s > 0 else MAX_TICK_S
        self._clock = clock
        self._buckets: defaultdict[int, list[Session]] = defaultdict(list)
        self._next_slot = self._slot(clock())    # the first bucket not yet emptied
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def _slot(self, t: float) -> int:
        """The first bucket whose time (slot x tick) is not before `t`."""
        return math.ceil(t / self.tick_s - 1e-9)

    def add(self, session: Session, due: float) -> None:
        """Look at `session` again at monotonic time `due` (in the first bucket not before it,
        give or take EARLY_S: a heartbeat due just after a tick goes out with that tick)."""
        if self.enabled:
            self._buckets[max(self._slot(due - EARLY_S), self._next_slot)].append(session)

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-heartbeats")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._next_slot * self.tick_s - self._clock()))
            try:
                self.tick(self._clock())
            except Exception:   # one bad session must not stop every heartbeat
                log.exception("heartbeat tick failed")

    def tick(self, now: float) -> None:
        """Empty every bucket whose time has come."""
        current = math.floor(now / self.tick_s + 1e-9)
        while self._next_slot <= current:
            due_now = self._buckets.pop(self._next_slot, ())
            self._next_slot += 1
            for session in due_now:
                if session.closed:
                    continue               # dropped here: closed sessions leave the wheel lazily
                due = session.last_send + self.interval_s
                if due <= now + EARLY_S:
                    session.heartbeat()
                    due = now + self.interval_s
                self.add(session, due)

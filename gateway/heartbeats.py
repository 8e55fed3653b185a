"""One process-wide timer for every socket's heartbeat, instead of a timer and a waiting task
per socket.

An idle socket costs no task and no timer of its own: it sits in a one-second bucket of this
wheel, keyed by when its heartbeat is due (its last frame + HEARTBEAT_S). Each tick empties the
buckets that came due: a socket that sent nothing since gets a heartbeat (its sender task runs
for that one frame and ends), one that was busy is put back at its new due time. Work per tick
is the sockets due in that second (sockets / HEARTBEAT_S), never all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from shared.aio import cancel_and_wait

if TYPE_CHECKING:
    from gateway.connection import Connection

log = logging.getLogger("gateway.heartbeats")

TICK_S = 1.0


class HeartbeatWheel:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._buckets: defaultdict[int, list[Connection]] = defaultdict(list)
        self._next_slot = int(time.monotonic() // TICK_S)
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def add(self, conn: Connection, due: float) -> None:
        """Look at `conn` again at monotonic time `due` (rounded up to the next tick)."""
        if self.enabled:
            self._buckets[max(int(due // TICK_S) + 1, self._next_slot)].append(conn)

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-heartbeats")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, (self._next_slot + 1) * TICK_S - time.monotonic()))
            try:
                self.tick(time.monotonic())
            except Exception:   # one bad socket must not stop every heartbeat
                log.exception("heartbeat tick failed")

    def tick(self, now: float) -> None:
        current = int(now // TICK_S)
        while self._next_slot <= current:
            due_now = self._buckets.pop(self._next_slot, ())
            self._next_slot += 1
            for conn in due_now:
                if conn.closed:
                    continue               # dropped here: closed sockets leave the wheel lazily
                due = conn.socket.last_send + self.interval_s
                if due <= now + TICK_S / 2:
                    conn.sender.heartbeat()
                    due = now + self.interval_s
                self.add(conn, due)

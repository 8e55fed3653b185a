"""A session's sender wake-up (`WakeEvent`), shared by the request table that fills the chunk
buffers and the sender (gateway.sender) that empties them.

Why more than an `asyncio.Event`: waking a sender costs a task step, a timer and a pass over its
requests, and at hundreds of streams a wake per arriving event was a large share of the gateway's
CPU per token. So the sender publishes `until`, the time it will look at its buffers by itself
(-inf while it runs: it looks at every buffer before it sleeps again; +inf when no task runs or
it sleeps without a timer), and the table wakes it only for a final or for a buffer due before
then (`needed`). Setting the event also starts the sender task if none is running, so an idle
socket needs no task at all (see heartbeats.py for how heartbeats reach it).
"""

from __future__ import annotations

import asyncio
import math


class WakeEvent(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self.on_set = lambda: None
        self.until = math.inf       # when the sender looks at its buffers without being woken

    def set(self) -> None:
        super().set()
        self.on_set()

    def needed(self, at: float | None) -> bool:
        """Whether a buffer due at `at` (None: nothing buffered) needs the sender woken now (not
        when it is woken already: a busy gateway then sets it once per pass, not per event)."""
        return at is not None and at < self.until and not self.is_set()

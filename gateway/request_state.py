"""One request as one session (a WebSocket or an HTTP response) serves it: its ids, its join of
history and live output (gateway.stream_join), its chunk buffer and its timings.

Kept apart from the table that drives it (gateway.requests) so the frame builders and the
sender can name it without importing the table, and the table without importing them.
"""

from __future__ import annotations

import asyncio
import time

from gateway.flusher import ChunkBuffer
from gateway.inbox import Subscriber
from gateway.stream_join import StreamJoin
from shared.events import FinalEvent


class RequestState:
    __slots__ = ("client_id", "rid", "key_id", "buffer", "sub", "join", "seq", "accepted", "started",
                 "first_sent", "last_sent", "att", "cancel_requested", "cancel_timer", "resumed", "slot_held",
                 "finished", "attach_timer", "progress_at", "stale_seen", "meaningful_sent", "meaningful_at",
                 "cancel_origin", "cancel_at", "cancel_ms", "prompt_tokens")

    def __init__(self, client_id: str, rid: str, key_id: str, buffer: ChunkBuffer, *, skip_seq: int = 0,
                 resumed: bool = False):
        self.client_id = client_id
        self.rid = rid
        self.key_id = key_id
        self.buffer = buffer
        self.sub: Subscriber | None = None
        # resume: the client has tokens up to skip_seq; live events wait for the attach marker
        self.join = StreamJoin(skip_seq, attaching=resumed, rid=rid)
        self.seq = skip_seq          # last token seq sent to the client
        self.accepted = False
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.att = 0                 # attach counter this session holds (meta.att after its resume)
        self.cancel_requested = False
        self.cancel_timer: asyncio.TimerHandle | None = None
        self.resumed = resumed
        self.slot_held = False       # this replica refreshes the request's concurrency lease
        self.finished = False
        self.attach_timer: asyncio.TimerHandle | None = None
        self.progress_at = self.started  # last event of any kind for this request (stall watchdog)
        self.stale_seen = 0          # stale-writer events the join dropped, already counted in metrics
        self.meaningful_sent = False  # a chunk with non-whitespace text went out
        self.prompt_tokens = 0       # the prompt's size in tokens, as the worker's token events say
        self.meaningful_at: float | None = None    # ... at this monotonic time
        self.cancel_origin: str | None = None      # the client cancelled it: client | http_disconnect
        self.cancel_at: float | None = None        # when this gateway received that cancel (monotonic)
        self.cancel_ms: float | None = None        # cancel -> the worker's cancelled final here (request_log)

    def cancelling(self, origin: str) -> None:
        """The client cancelled the request (`origin`: client, http_disconnect), now."""
        self.cancel_requested = True
        if self.cancel_origin is None:
            self.cancel_origin = origin
            self.cancel_at = time.monotonic()

    @property
    def final(self) -> FinalEvent | None:
        """The request's final event (from a worker, from the join on a gap, or made here)."""
        return self.join.final

"""One request as one session (a WebSocket or an HTTP response) serves it: its ids, its phase,
its join of history and live output (gateway.stream_join), its chunk buffer and its timings.

Kept apart from the table that drives it (gateway.requests) so the frame builders and the
sender can name it without importing the table, and the table without importing them.

Its lifecycle is one `Phase`, moved forward only by `RequestState.advance` through
`TRANSITIONS` (the one place that says which step may follow which):

    OPENING ──> STARTED ──> STREAMING ──> ENDED
       └──────────┴────────────┴──────────> ENDED

* OPENING: open in its session's table and subscribed to its output, its submit (or resume's
  attach) in flight; nothing of it goes out.
* STARTED: queued (or attached): it holds its key's concurrency slot, which this replica
  refreshes; the client has not been told yet.
* STREAMING: `accepted` is queued for the client; the sender flushes its output.
* ENDED: this session is done with it (its `done` went out, its submit was refused, or its
  session went away); no event of it is handled here any more.

A cancel is not a phase (a cancelled request streams on until its final comes): it is
`cancel_origin`, set once by `cancelling`.
"""

from __future__ import annotations

import asyncio
import enum
import time

from gateway.flusher import ChunkBuffer
from gateway.inbox import Subscriber
from gateway.stream_join import StreamJoin
from shared.events import FinalEvent


class Phase(enum.Enum):
    OPENING = "opening"
    STARTED = "started"
    STREAMING = "streaming"
    ENDED = "ended"


# which phase may follow which (the module docstring draws it)
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.OPENING: frozenset({Phase.STARTED, Phase.ENDED}),
    Phase.STARTED: frozenset({Phase.STREAMING, Phase.ENDED}),
    Phase.STREAMING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: a request was moved to a phase that cannot follow its own."""


class RequestState:
    __slots__ = ("client_id", "rid", "key_id", "buffer", "sub", "join", "seq", "phase", "started",
                 "first_sent", "last_sent", "att", "cancel_timer", "resumed",
                 "attach_timer", "progress_at", "stale_seen", "meaningful_at",
                 "cancel_origin", "cancel_at", "cancel_ms", "prompt_tokens", "tool_mode")

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
        self.phase = Phase.OPENING
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.att = 0                 # attach counter this session holds (meta.att after its resume)
        self.cancel_timer: asyncio.TimerHandle | None = None
        self.resumed = resumed       # opened by a resume (or an idempotent re-send): no TTFT of its own
        self.attach_timer: asyncio.TimerHandle | None = None
        self.progress_at = self.started  # last event of any kind for this request (stall watchdog)
        self.stale_seen = 0          # stale-writer events the join dropped, already counted in metrics
        self.prompt_tokens = 0       # the prompt's size in tokens, as the worker's token events say
        self.meaningful_at: float | None = None    # a chunk with non-whitespace text went out at this time
        self.cancel_origin: str | None = None      # the client cancelled it: client | http_disconnect
        self.cancel_at: float | None = None        # when this gateway received that cancel (monotonic)
        self.cancel_ms: float | None = None        # cancel -> the worker's cancelled final here (request_log)
        self.tool_mode: str | None = None          # resumed: its meta's tool mode (gateway.ws.tool_frames)

    # ---- the phase ----------------------------------------------------------------------------

    def advance(self, to: Phase) -> None:
        """Move to phase `to`; anything `TRANSITIONS` does not allow is a bug."""
        if to not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"request {self.rid}: {self.phase.value} -> {to.value}")
        self.phase = to

    @property
    def streaming(self) -> bool:
        """Accepted and not ended: what the sender flushes and the stall watchdog watches."""
        return self.phase is Phase.STREAMING

    @property
    def finished(self) -> bool:
        """Ended on this session: no event of it is handled here any more."""
        return self.phase is Phase.ENDED

    @property
    def slot_held(self) -> bool:
        """Queued or attached and not ended here: this replica refreshes its concurrency lease."""
        return self.phase is Phase.STARTED or self.phase is Phase.STREAMING

    @property
    def moved(self) -> bool:
        """Resumed on another session of this replica: its subscription here was closed."""
        return self.sub is not None and self.sub.closed

    @property
    def cancel_requested(self) -> bool:
        return self.cancel_origin is not None

    @property
    def meaningful_sent(self) -> bool:
        return self.meaningful_at is not None

    def cancelling(self, origin: str) -> None:
        """The client cancelled the request (`origin`: client, http_disconnect), now."""
        if self.cancel_origin is None:
            self.cancel_origin = origin
            self.cancel_at = time.monotonic()

    @property
    def final(self) -> FinalEvent | None:
        """The request's final event (from a worker, from the join on a gap, or made here)."""
        return self.join.final

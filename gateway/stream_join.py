"""History then live, exact by `seq`, fenced by epoch: how one request's output reaches one client.

Why a class of its own: the exactly-once promise to a client rests on this one rule, and it must
be testable on its own, without Redis, sockets or timers (Centrifugo's `recovery` package is
the model: buffer live, read history, merge by position, drop duplicates, and refuse to paper
over a gap). The request table (gateway.requests) drives it; the worker fault tests check the
workers' output through it too.

What it is given: live events from this gateway's inbox (`live`), attach markers (`marker`), and
the history reads it asks for (`wants_read` -> `start_read()` -> `history(events)`). What it
gives back: the events to deliver, in order: token events that continue exactly after the last
delivered token, then at most one final event (`done` / `err`).

The rules (docs/transport.md):
* A token event covers tokens `seq-n+1 .. seq`. One that ends at or before the last delivered
  token is a duplicate (history and live overlap; a retried write) and is dropped. One that
  starts right after it is delivered. One that starts further on is held and the history is
  read, then the held events are offered again. One that starts before and ends after the last
  delivered token is cut there when that token is where the join began (a resume inside the
  event: `TokEvent.tail` cuts ids, text by its per-token text lengths, logprobs); anywhere
  else (events of one writer never overlap once delivery has moved on), or for an old event
  that does not say where its text is cut, it is a gap.
* A final whose `seq` is beyond the last delivered token waits for those tokens the same way.
* An event whose epoch `ep` is below the highest seen came from a stale writer (a worker whose
  request another worker took over) and is dropped.
* While attaching (a resume), live events are held until the worker's marker says where the
  history ends; a read that completes while still attaching delivers history only.
* Workers write an event to the history before its live copy, so a history read that starts
  after a held event arrived must contain everything before it. If it does not, the history has
  lost those tokens (trimmed, expired, a failover to a replica that lagged): the join ends with
  a gap, and the request ends with the retryable `output_lost` error, never with a silent jump.
  So does a history that cannot be read at all (`history(None)`). The join makes that error
  event itself and delivers it as the final, so every way a stream ends comes out of `final`.
"""

from __future__ import annotations

from shared.errors import ErrorCode
from shared.events import HISTORY_TYPES, ErrEvent, FinalEvent, HistoryEvent, TokEvent


class StreamJoin:
    __slots__ = ("rid", "delivered", "start", "epoch", "final", "gap", "attaching", "reading", "wants_read", "stale",
                 "_held", "_reads_started", "_reads_done")

    def __init__(self, delivered: int = 0, *, attaching: bool = False, rid: str = ""):
        self.rid = rid                 # the request's id (named in the final a gap makes)
        self.delivered = delivered     # last token seq handed out (a resume: what the client has)
        self.start = delivered         # where the join began: the one point that may fall inside an event
        self.epoch = 0                 # highest writer epoch seen
        self.final: FinalEvent | None = None
        self.gap: str | None = None    # why the stream cannot go on exactly (then it has ended)
        self.attaching = attaching
        self.reading = False           # a history read is in flight
        self.wants_read = False        # the caller should start a history read
        self.stale = 0                 # events dropped as a stale writer's
        self._held: list[tuple[int, HistoryEvent]] = []   # (reads started when it was held, event)
        self._reads_started = self._reads_done = 0

    @property
    def ended(self) -> bool:
        return self.final is not None or self.gap is not None

    # ---- inputs ---------------------------------------------------------------------------

    def live(self, ev: HistoryEvent) -> list[HistoryEvent]:
        """A live event from the inbox; returns what to deliver now."""
        if self.final is not None or self.gap is not None or self._stale(ev):
            return []
        if self.attaching or self.reading:
            self._hold(ev)
            return []
        if type(ev) is TokEvent:      # the usual case, the tokens right after the last delivered one
            n = len(ev.ids)
            if n and ev.seq - n == self.delivered:
                self.delivered = ev.seq
                return [ev]
        out: list[HistoryEvent] = []
        self._offer(ev, out, self._reads_started)
        return out

    def marker(self) -> None:
        """The worker's attach marker: everything before it is in the history; read it."""
        if self.attaching and not self.ended:
            self.attaching = False
            self.wants_read = True

    def start_read(self) -> int:
        """The caller starts a history read of everything after the returned seq."""
        self.reading = True
        self.wants_read = False
        self._reads_started += 1
        return self.delivered

    def history(self, events: list[HistoryEvent] | None) -> list[HistoryEvent]:
        """The result of the read in flight: every history event after `start_read()`'s seq, in
        order, or None when the history could not be read. Returns what to deliver now."""
        self.reading = False
        self._reads_done += 1
        out: list[HistoryEvent] = []
        if self.ended:
            return out
        if events is None:
            self._lose("the request's history could not be read", out)
            return out
        for ev in events:
            if self.ended:
                break
            if isinstance(ev, HISTORY_TYPES):
                self._note_epoch(ev)
                self._take(ev, out, from_history=True)
        if not self.attaching:
            held, self._held = self._held, []
            for stamp, ev in held:
                if self.ended:
                    break
                self._offer(ev, out, stamp)
        return out

    def end_here(self, final: FinalEvent) -> bool:
        """The gateway ends the request itself (cancel fallback, stall); False if it had ended."""
        if self.ended:
            return False
        self.final = final
        return True

    # ---- the rules --------------------------------------------------------------------------

    def _stale(self, ev: HistoryEvent) -> bool:
        ep = ev.epoch
        if ep < self.epoch:
            self.stale += 1
            return True
        self.epoch = ep
        return False

    def _note_epoch(self, ev: HistoryEvent) -> None:
        self.epoch = max(self.epoch, ev.epoch)

    def _hold(self, ev: HistoryEvent, stamp: int | None = None) -> None:
        self._held.append((self._reads_started if stamp is None else stamp, ev))

    def _offer(self, ev: HistoryEvent, out: list[HistoryEvent], stamp: int) -> None:
        """A live (or held) event: deliver it, drop it, or hold it for a history read."""
        if self._reaches(ev):
            self._take(ev, out, from_history=False)
        elif stamp < self._reads_done:
            # a read that started after this event arrived (reads run one at a time) has
            # completed without bringing what comes before it
            kind = "final" if ev.is_final else f"tokens {_first(ev)}-{ev.seq}"
            self._lose(f"tokens {self.delivered + 1}-{_first(ev) - 1} are missing from the request's history "
                       f"(before the {kind})", out)
        else:
            self._hold(ev, stamp)
            self.wants_read = True

    def _reaches(self, ev: HistoryEvent) -> bool:
        """Nothing lies between what was delivered and this event."""
        return _first(ev) <= self.delivered + 1

    def _take(self, ev: HistoryEvent, out: list[HistoryEvent], *, from_history: bool) -> None:
        seq = ev.seq
        if isinstance(ev, TokEvent):
            if seq <= self.delivered:
                return                                      # a duplicate
            first = _first(ev)
            if first <= self.delivered:       # a resume inside the event: deliver its tail
                cut = ev.tail(self.delivered) if self.delivered == self.start else None
                if cut is None:
                    self._lose(f"an event with tokens {first}-{seq} overlaps the {self.delivered} tokens already "
                               "delivered and cannot be cut there", out)
                else:
                    self.delivered = seq
                    out.append(cut)
            elif first > self.delivered + 1:
                if from_history:    # the history itself skips tokens
                    self._lose(f"tokens {self.delivered + 1}-{first - 1} are missing from the request's history", out)
                return
            else:
                self.delivered = seq
                out.append(ev)
        elif ev.is_final:
            if seq < self.start:    # a resume after more tokens than the request ever had
                self.final = ErrEvent.here(self.rid, seq, ErrorCode.INVALID_REQUEST,
                                           f"last_seq {self.start} is past the end of the request's output "
                                           f"({seq} tokens)")
                out.append(self.final)
                return
            if seq > self.delivered:
                if from_history:
                    self._lose(f"tokens {self.delivered + 1}-{seq} are missing from the request's history "
                               "(before its final event)", out)
                return
            self.final = ev
            out.append(ev)

    def _lose(self, why: str, out: list[HistoryEvent]) -> None:
        """The stream cannot go on exactly: end it with a retryable error after what was delivered."""
        self.gap = why
        self.final = ErrEvent.here(self.rid, self.delivered, ErrorCode.OUTPUT_LOST,
                                   f"part of the output can no longer be delivered ({why}); send the request again")
        out.append(self.final)


def _first(ev: HistoryEvent) -> int:
    """The first token seq an event covers (a final covers none: the one after its seq)."""
    if isinstance(ev, TokEvent):
        return ev.seq - len(ev.ids) + 1
    return ev.seq + 1

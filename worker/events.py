"""One request's output on its way to Redis: engine step outputs -> v2 events, queued until written.

Why a queue per request: a write can fail (Redis restarting, or refusing writes when full), and
an event may only leave the queue once Redis has it. Step outputs are appended to `pending`, the
token event being built (`TokEvent.add_output`: ids, text, and every other per-token field);
`freeze()` turns what is pending into ONE token event covering many tokens
(`seq` = tokens delivered so far, `n` tokens, their ids and text) and appends it to `unsent`,
where it stays, byte for byte, until a write confirms it. Freezing before writing matters: a
retried write must send exactly the event it tried before (same id `{seq}-0`, same tokens), or a
write whose reply was lost would be followed by an overlapping one.

A final output (done/err) is frozen right after the tokens of the same flush, as its own event
`{seq}-1` that carries no tokens. Event ids come from `seq`, so a history write is idempotent.
`epoch` (from meta.epoch, bumped by every worker that takes the request) is stamped on every
event so a gateway can refuse a stale writer's output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.errors import RETRYABLE, ErrorCode
from shared.events import AttachMarker, DoneEvent, DoneUsage, ErrEvent, HistoryEvent, TokEvent
from shared.streams import RequestEntry, history_id
from worker.engine import StepOutput


@dataclass
class Progress:
    """How far a request's history got (read back from its last event on claim)."""
    seq: int = 0
    finished: bool = False


def progress_from_last(last: HistoryEvent | None) -> Progress:
    """Progress from the newest event of a history stream (None: nothing written yet)."""
    if last is None:
        return Progress()
    return Progress(seq=last.seq, finished=last.is_final)


@dataclass
class Frozen:
    """An event fixed for writing: its history id, payload and the seq it brings history to."""
    entry_id: str
    payload: bytes
    seq: int
    final: bool


@dataclass
class InFlight:
    """A request this worker owns, from accept until its final event is in Redis and acked."""
    rid: str
    entry_id: str                        # request-stream entry (XACKed when the request ends)
    entry: RequestEntry | None           # None only for an undecodable entry being dead-lettered
    key_id: str = ""                     # API key id: whose concurrency lease to release at the end
    gw: str = ""                         # gateway whose inbox gets the live events ("" = history only)
    epoch: int = 0
    seq: int = 0                         # tokens put into events so far
    written_seq: int = 0                 # tokens confirmed in the history stream
    pending: TokEvent = field(default_factory=lambda: TokEvent("", 0, [], "", 0, 0))   # tokens not frozen yet
    pending_ms: int = 0                  # when the oldest pending output was produced
    first_token_ms: int = 0              # when the request's first token was produced (any run)
    # for the worker's metrics, set as outputs arrive (worker.metrics.request_finished)
    meaningful_ms: int = 0               # first token with non-whitespace text
    admitted_ms: int = 0                 # first scheduled in the engine (from the final output)
    final_ms: int = 0                    # the engine's final output
    completion_tokens: int = 0
    prompt_tokens: int = 0               # the prompt's size in tokens (on every token event: running usage)
    finish_reason: str = ""
    unsent: list[Frozen] = field(default_factory=list)
    marker_att: int | None = None        # an attach marker to send ahead of live events
    engine_done: bool = False            # the engine will produce nothing more for it
    final_written: bool = False
    failures: int = 0                    # consecutive refused writes
    retry_at: float = 0.0
    given_up: bool = False
    fenced: bool = False                 # another worker took it over: write nothing more
    lease_until: float = float("inf")    # time.monotonic() until which our ownership lease surely holds
    lease_lapsed: bool = False           # that deadline passed unrenewed: its output is held (worker.leases)
    lease_refused: bool = False          # the last keep-fresh round found Redis refusing to extend it (OOM)
    ttl_set: bool = False                # this run has set the history stream's TTL
    acked: bool = False                  # its request entry is acked (by the history script with its final)
    dead_letter: dict | None = None      # dead-letter fields, XADDed with the ack (after the final)
    worker: str = ""                     # this worker's id, named in the final event

    @classmethod
    def start(cls, rid: str, entry_id: str, entry: RequestEntry | None, progress: Progress, *,
              epoch: int = 0, gw: str = "", key_id: str = "", worker: str = "",
              lease_until: float = float("inf")) -> "InFlight":
        return cls(rid=rid, entry_id=entry_id, entry=entry, key_id=key_id or (entry.key_id if entry else ""),
                   gw=gw or (entry.gw if entry else ""), epoch=epoch, seq=progress.seq, written_seq=progress.seq,
                   worker=worker, lease_until=lease_until)

    def may_write(self, now: float) -> bool:
        """Whether our lease surely still holds (worker.ownership: `lease_until`): past it,
        unrenewed, nothing of this request is written until a keep-fresh round renews it."""
        return now < self.lease_until

    # ---- what the engine produced ----

    def add_output(self, out: StepOutput) -> None:
        if out.token_ids or out.text:
            if not self.pending.ids and not self.pending.text:
                self.pending_ms = out.emitted_ms
            if out.token_ids and not self.first_token_ms:
                self.first_token_ms = out.emitted_ms
            if not self.meaningful_ms and out.text and not out.text.isspace():
                self.meaningful_ms = out.emitted_ms
            self.prompt_tokens = out.prompt_tokens
            self.pending.add_output(out)
        if out.finished:
            self.final_ms, self.admitted_ms = out.emitted_ms, out.admitted_ms
            self.completion_tokens, self.finish_reason = out.completion_tokens, out.finish_reason or "stop"
            if out.finish_reason == "error":
                code = out.error_code or ErrorCode.INTERNAL
                self.finish_error(code, out.error_message or code.value, param=out.error_param)
            else:
                self.finish_done(out.finish_reason or "stop", out.prompt_tokens, out.completion_tokens,
                                 cached_tokens=out.cached_tokens)

    def finish_done(self, reason: str, prompt_tokens: int = 0, completion_tokens: int = 0, *,
                    cached_tokens: int = 0) -> None:
        self.freeze()
        now = _now_ms()
        created = self.entry.created_ms if self.entry else 0

        def since_submit(at: int) -> int | None:
            return at - created if at and created else None
        usage = DoneUsage(prompt_tokens, completion_tokens, cached_tokens, since_submit(self.first_token_ms),
                          since_submit(self.meaningful_ms), since_submit(self.final_ms or now))
        self._freeze_final(DoneEvent(self.rid, self.seq, reason, usage, self.epoch, now, self.worker, self.lane))

    def finish_error(self, code: ErrorCode, message: str, retryable: bool | None = None, *,
                     param: str | None = None) -> None:
        """`param`: the request field the error is about (None: the request as a whole)."""
        self.freeze()
        self._freeze_final(ErrEvent(self.rid, self.seq, code.value, message,
                                    code in RETRYABLE if retryable is None else retryable,
                                    self.epoch, _now_ms(), self.worker, self.lane, param))

    @property
    def lane(self) -> str:
        return self.entry.priority if self.entry else ""

    # ---- queue ----

    def freeze(self) -> None:
        """Pending tokens -> one frozen token event. Text that came without a token id cannot
        get a seq of its own: it waits for the next token (or rides on the final event)."""
        ev = self.pending
        if not ev.ids:
            return
        self.seq += len(ev.ids)
        ev.rid, ev.seq, ev.epoch, ev.ms = self.rid, self.seq, self.epoch, self.pending_ms
        ev.prompt_tokens = self.prompt_tokens
        self.unsent.append(Frozen(history_id(self.seq, False), ev.encode(), self.seq, False))
        self.pending = TokEvent(self.rid, 0, [], "", 0, 0)

    def _freeze_final(self, final: DoneEvent | ErrEvent) -> None:
        if self.engine_done:  # a second final (e.g. a cancel racing the last token): keep the first
            return
        if self.pending.text:  # text without a token id (detokenizer flush): keep it, on the final
            final.text = self.pending.text
            self.pending.text = ""
        self.engine_done = True
        self.unsent.append(Frozen(history_id(self.seq, True), final.encode(), self.seq, True))

    @property
    def has_news(self) -> bool:
        return bool(self.pending.ids or self.unsent or (self.marker_att is not None and self.gw))

    @property
    def urgent(self) -> bool:
        """Written without waiting for the flush tick: the first token, a final, a marker."""
        return ((self.marker_att is not None and bool(self.gw)) or (self.written_seq == 0 and self.seq == 0 and bool(self.pending.ids))
                or any(f.final for f in self.unsent))

    def confirm(self, frozen: list[Frozen]) -> None:
        """These events are in history now: drop them from the queue."""
        for f in frozen:
            if self.unsent and self.unsent[0] is f:
                self.unsent.pop(0)
                self.written_seq = max(self.written_seq, f.seq)
                self.final_written = self.final_written or f.final
        self.failures = 0
        self.retry_at = 0.0

    def marker(self) -> bytes:
        """Attach marker: everything <= written_seq is in history; the rest comes live."""
        return AttachMarker(self.rid, self.written_seq, self.epoch, self.marker_att or 0).encode()


def _now_ms() -> int:
    return int(time.time() * 1000)

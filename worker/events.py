"""StepOutput -> output-stream events, with the per-request counters that make `seq` continuous.

Each step output carrying tokens becomes one "tok" event: seq + 1, its text, `n` tokens and `t`,
the total tokens delivered so far. `t` lets a worker that takes over the request (failover)
know from the last event alone how many tokens to suppress when it replays it. A finished
output becomes "done" (finish_reason, usage) or "err" (code, message, retryable) with the
request's final seq, so a client resuming after last_seq sees each seq exactly once.

Every event has an explicit stream id derived from its seq: "{seq}-0" for a token event,
"{seq}-1" for the final one. That makes writes idempotent: when a MULTI/EXEC is retried after a
connection drop that hid its reply (Redis restarting), Redis rejects the already-written ids
instead of appending duplicates, and a worker replaying a request after failover continues
exactly where the stream ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import RETRYABLE, ErrorCode
from shared.streams import RequestEntry, encode_event
from worker.engine import StepOutput


@dataclass
class Progress:
    """How far a request's output stream got (read back from its last event on claim)."""
    seq: int = 0
    tokens: int = 0
    finished: bool = False


@dataclass
class InFlight:
    """A request this worker owns: its stream entry (acked when it finishes) and its counters."""
    rid: str
    entry_id: str
    entry: RequestEntry
    progress: Progress = field(default_factory=Progress)
    prompt_tokens: int = 0


Event = tuple[str, bytes]  # (stream entry id, payload)


def tok_id(seq: int) -> str:
    return f"{seq}-0"


def final_id(seq: int) -> str:
    return f"{seq}-1"


def step_events(req: InFlight, out: StepOutput) -> list[Event]:
    """Events for one step output of `req` (updates its counters)."""
    events = []
    p = req.progress
    if out.text or out.token_ids:
        p.seq += 1
        p.tokens += len(out.token_ids)
        events.append((tok_id(p.seq), encode_event("tok", p.seq, text=out.text, n=len(out.token_ids), t=p.tokens,
                                                    ms=out.emitted_ms)))
    if out.finished:
        p.finished = True
        if out.finish_reason == "error":
            code = out.error_code or ErrorCode.INTERNAL
            events.append(error_event(p.seq, code, out.error_message or code.value))
        else:
            events.append(done_event(p.seq, out.finish_reason, out.prompt_tokens, out.completion_tokens))
    return events


def error_event(seq: int, code: ErrorCode, message: str, retryable: bool | None = None) -> Event:
    return final_id(seq), encode_event("err", seq, code=code.value, message=message,
                        retryable=code in RETRYABLE if retryable is None else retryable)


def done_event(seq: int, reason: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> Event:
    return final_id(seq), encode_event("done", seq, finish_reason=reason,
                        usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})


def progress_from_last(last: dict | None) -> Progress:
    """Progress from the newest event of an output stream (None: nothing written yet)."""
    if not last:
        return Progress()
    seq = int(last.get("seq") or 0)
    if last.get("k") in ("done", "err"):
        return Progress(seq=seq, tokens=int(last.get("t") or 0), finished=True)
    return Progress(seq=seq, tokens=int(last.get("t") or seq))

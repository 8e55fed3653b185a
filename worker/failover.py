"""What a worker does with a request another worker already started (or that keeps failing).

A request entry stays pending in the consumer group until the worker that runs it acks it with
its final event. If that worker dies, another one claims the entry and reads the request's
history stream `p:{r:rid}:out` (every token event carries the token `ids` it delivered):

* nothing written yet: run it normally;
* a final event is there: the old worker finished but died before the ack; just ack;
* tokens were written: **continue** from prompt + the delivered token ids (the engine's
  `generated_ids`: one prefill of prompt and delivered tokens, then decoding goes on). The client
  keeps exactly what it was shown and `seq` continues; this is exact by construction whatever
  the sampling (random, seeded, greedy) and whatever the kernels do, and cheaper than decoding
  the delivered tokens again;
* the history is incomplete (trimmed or expired: its token ids do not cover 1..seq): there is
  nothing exact to continue from, so the request ends with a retryable `worker_lost` error.

Entries that cannot be decoded or validated, and entries delivered more than `max_deliveries`
times (a request that crashes every worker that takes it), go to the dead-letter stream
`p:{q}:dead` with the reason and the raw payload, are acked, and get a final `err` event when
their rid is known — they are never retried forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgpack

from shared.errors import ErrorCode
from shared.events import HistoryEvent, TokEvent
from shared.streams import RequestEntry
from worker.events import Progress

DEAD_MAXLEN = 10000


@dataclass
class Decision:
    action: Literal["run", "continue", "ack", "lost"]
    generated_ids: list[int] = field(default_factory=list)   # "continue": the delivered token ids


def delivered_ids(history: list[HistoryEvent]) -> list[int] | None:
    """The token ids of a history's token events, in order; None unless they cover tokens
    1..seq exactly (every event's ids end at its seq, no gap, no overlap)."""
    ids: list[int] = []
    for ev in history:
        if not isinstance(ev, TokEvent):
            continue
        got = ev.ids
        if not isinstance(got, list) or ev.seq != len(ids) + len(got):
            return None
        ids.extend(int(i) for i in got)
    return ids


def decide(entry: RequestEntry, progress: Progress, history: list[HistoryEvent]) -> Decision:
    """What to do with a request taken over with this history (its events, oldest first)."""
    if progress.finished:
        return Decision("ack")
    if progress.seq == 0:
        return Decision("run")
    ids = delivered_ids(history)
    if ids is None or len(ids) != progress.seq:
        return Decision("lost")
    return Decision("continue", generated_ids=ids)


LOST_MESSAGE = ("the worker running this request stopped mid-generation and the request's history "
                "is incomplete (expired or trimmed), so it cannot be continued exactly; send it again")


def _field_of_raw(raw: bytes | None, name: str) -> str | None:
    if not raw:
        return None
    try:
        obj = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    value = obj.get(name) if isinstance(obj, dict) else None
    return value if isinstance(value, str) and value and len(value) <= 200 else None


def rid_of_raw(raw: bytes | None) -> str | None:
    """Best-effort request id of an entry that failed validation, to tell its client."""
    return _field_of_raw(raw, "rid")


def key_id_of_raw(raw: bytes | None) -> str:
    """Best-effort API key id of such an entry, to release its concurrency lease."""
    return _field_of_raw(raw, "key_id") or ""


def dead_letter_fields(entry_id: str, reason: str, raw: bytes | None, worker_id: str, deliveries: int) -> dict:
    return {"entry_id": entry_id, "reason": reason, "raw": raw or b"", "worker": worker_id,
            "deliveries": deliveries}


DEAD_CODE = {
    "invalid": ErrorCode.INVALID_REQUEST,
    "deliveries": ErrorCode.WORKER_LOST,
}

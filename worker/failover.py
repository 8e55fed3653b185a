"""What a worker does with a request another worker already started (or that keeps failing).

A request entry stays pending in the consumer group until the worker that runs it acks it with
its final event. If that worker dies, another one claims the entry (XAUTOCLAIM after
`claim_idle_ms`) and looks at the request's history stream `p:{r:rid}:out` (its last event's `seq` = tokens delivered):

* nothing written yet: run it normally;
* a final event is there: the old worker finished but died before the ack; just ack;
* tokens were written and sampling is deterministic (greedy, or seeded): **replay** with
  `skip_tokens` = tokens already delivered. The engine regenerates the same tokens, suppresses
  the delivered ones, and `seq` continues, so the client sees one seamless stream;
* tokens were written and sampling is random: a replay would diverge from what the client has
  already shown, so the request ends with a retryable `worker_lost` error instead of a
  silently different continuation.

Entries that cannot be decoded or validated, and entries delivered more than `max_deliveries`
times (a request that crashes every worker that takes it), go to the dead-letter stream
`p:{q}:dead` with the reason and the raw payload, are acked, and get a final `err` event when
their rid is known — they are never retried forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgpack

from shared.errors import ErrorCode
from shared.streams import RequestEntry
from worker.events import Progress

DEAD_MAXLEN = 10000


@dataclass
class Decision:
    action: Literal["run", "replay", "ack", "lost"]
    skip_tokens: int = 0


def decide(entry: RequestEntry, progress: Progress) -> Decision:
    if progress.finished:
        return Decision("ack")
    if progress.seq == 0:
        return Decision("run")
    if entry.params.deterministic:
        return Decision("replay", skip_tokens=progress.seq)
    return Decision("lost")


LOST_MESSAGE = ("the worker running this request stopped mid-generation and sampling is random, so it "
                "cannot be continued identically; send it again")


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

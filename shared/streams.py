"""The gateway <-> worker hop: Redis key layout and the msgpack entries on each stream.

Every key starts with `Settings.stream_prefix` (default `llm`), written `{p}` below.

| key                    | type   | written by | read by  | what                                                       |
|------------------------|--------|------------|----------|------------------------------------------------------------|
| {p}:requests           | stream | gateway    | workers  | one entry per generate request; consumer group `workers`   |
| {p}:out:{rid}          | stream | worker     | gateways | token events, then one `done`; MAXLEN ~ output_maxlen, TTL |
| {p}:ctl:{worker_id}    | stream | gateway    | worker   | control (cancel) for the worker that owns a request        |
| {p}:owner:{rid}        | string | worker     | gateway  | worker id holding the request (TTL), to route cancels      |
| {p}:cancelled:{rid}    | string | gateway    | worker   | cancel flag for requests not yet claimed (TTL)             |
| {p}:alias:{key}:{id}   | string | gateway    | gateway  | client id -> request id, so `resume` works on any replica  |
| {p}:workers            | zset   | worker     | all      | worker id -> last heartbeat (ms)                           |
| {p}:worker:{worker_id} | hash   | worker     | all      | capacity and load of one worker (TTL = worker_ttl_s)       |
| {p}:dead               | stream | worker     | operator | dead-letter: entries that could not be decoded or validated|

Request entries carry one field `d` (msgpack of `RequestEntry`); output entries one field `d`
(msgpack of an `OutEvent`). Output entry ids are explicit: `{seq}-0` for a token event and
`{seq}-1` for the final one (see worker/events.py), which makes worker writes idempotent; only
workers write output streams. The request stream is trimmed with approximate MAXLEN; an entry is
XACKed only when its request has finished, so a dead worker's requests stay pending and are
claimed by another worker (XAUTOCLAIM after `claim_idle_ms`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import msgpack

from shared.protocol import PROTOCOL_VERSION

CONSUMER_GROUP = "workers"
ENTRY_FIELD = b"d"


@dataclass(frozen=True)
class Keys:
    prefix: str = "llm"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def out(self, rid: str) -> str:
        return f"{self.prefix}:out:{rid}"

    def ctl(self, worker_id: str) -> str:
        return f"{self.prefix}:ctl:{worker_id}"

    def owner(self, rid: str) -> str:
        return f"{self.prefix}:owner:{rid}"

    def cancelled(self, rid: str) -> str:
        return f"{self.prefix}:cancelled:{rid}"

    def alias(self, key_id: str, client_id: str) -> str:
        return f"{self.prefix}:alias:{key_id}:{client_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: a replay on another worker yields the same tokens."""
        return self.temperature == 0.0 or self.seed is not None


@dataclass
class RequestEntry:
    """One generate request as a worker receives it."""
    rid: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    created_ms: int = 0
    key_id: str = ""
    v: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "RequestEntry":
        """Raises ValueError on anything malformed (the caller dead-letters it)."""
        try:
            obj = msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            raise ValueError(f"undecodable entry: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("entry is not a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise ValueError(f"unsupported entry version {obj.get('v')!r}")
        try:
            params = SamplingParams(**obj.pop("params"))
            entry = cls(params=params, **obj)
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed entry: {exc}") from None
        if not isinstance(entry.rid, str) or not entry.rid:
            raise ValueError("entry has no rid")
        if (entry.prompt is None) == (entry.messages is None):
            raise ValueError("entry needs exactly one of prompt/messages")
        p = entry.params
        if not (isinstance(p.max_tokens, int) and p.max_tokens >= 1):
            raise ValueError("bad max_tokens")
        if not (isinstance(p.temperature, (int, float)) and 0 <= p.temperature <= 2):
            raise ValueError("bad temperature")
        if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
            raise ValueError("bad top_p")
        if not (isinstance(p.top_k, int) and p.top_k >= 0):
            raise ValueError("bad top_k")
        if not isinstance(p.stop, list) or not all(isinstance(s, str) and s for s in p.stop):
            raise ValueError("bad stop")
        return entry


# Output events. `seq` counts token events of the request from 1; `done`/`error` carry the
# final seq. Kinds: "tok" (text + n tokens), "done" (finish_reason + usage), "err" (code,
# message, retryable; also final).
OutKind = Literal["tok", "done", "err"]


def encode_event(kind: OutKind, seq: int, **fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "seq": seq, **fields}, use_bin_type=True)


def decode_event(raw: bytes) -> dict[str, Any]:
    return msgpack.unpackb(raw, raw=False)


def as_str(value: Any) -> str:
    """Redis replies are bytes unless a client decodes them; stream ids and names as str."""
    return value.decode() if isinstance(value, bytes) else str(value)

"""The worker -> gateway events, one class each, with their msgpack codec (transport v2).

Why typed: an event used to be a dict with short wire keys read at every site that handled it;
a field then had to be spelled (and defaulted) in each of them. Here each event is one
`__slots__` dataclass with readable names; `encode()` writes exactly the wire map it always was
(same keys, same order, so replicas of two versions interoperate during a rolling upgrade) and
`decode_event` / `decode_events` read a map back into its class, ignoring keys they do not
know (a newer writer's fields). A map of a kind this version does not know decodes to None and
is skipped.

| class          | `k`    | where                       | what                                          |
|----------------|--------|-----------------------------|-----------------------------------------------|
| `TokEvent`     | `tok`  | history `{seq}-0`, inbox    | tokens `seq-n+1 .. seq` (ids, text, logprobs, echo) |
| `DoneEvent`    | `done` | history `{seq}-1`, inbox    | the request's final: finish_reason and usage  |
| `ErrEvent`     | `err`  | history `{seq}-1`, inbox    | the request's final: a typed error            |
| `AttachMarker` | `att`  | inbox only                  | "everything <= seq is in the history"         |
| `TokenizeReply`| `tokr` | inbox only                  | a worker's answer to a tokenize/detokenize    |
| `Moved`        | `moved`| inbox only (gateway → gw)   | rid was resumed on another gateway            |

The gateway's own finals (a cancel no worker confirmed, a stall, a resume elsewhere, a hole in
the history) are `DoneEvent` / `ErrEvent` too, made with `local=True` (never on the wire).
docs/transport.md has the wire maps and the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack

from shared.errors import RETRYABLE, ErrorCode

EVENT_VERSION = 2

_packb = msgpack.packb
_unpackb = msgpack.unpackb


def _pack(obj: dict) -> bytes:
    return _packb(obj, use_bin_type=True)


@dataclass(slots=True)
class TokEvent:
    """Tokens `seq-n+1 .. seq` of a request (`seq` = tokens delivered so far); `text` may be ""
    while ids advance. `logprobs` (requests that ask): one entry per id, [token, logprob,
    [[token, logprob], ...top], text_offset] (worker.engine.logprobs). `prompt_tokens`: the
    prompt's size (what a stream's running usage reports before `done`; 0: not sent).
    `lens`: per token, how many characters of `text` were released with it (0 while the
    detokenizer holds bytes back; text that came with no id goes to the id before it, or to the
    first id), so a resume can cut the event at any token (`tail`). On the wire (`tl`) only
    when the event has more than one token, as a bin of one byte a token when every length
    fits (else an array); None in events written before it existed."""
    KIND: ClassVar[str] = "tok"
    is_final: ClassVar[bool] = False

    rid: str
    seq: int
    ids: list[int]
    text: str
    epoch: int
    ms: int                              # when the oldest of these tokens was produced (worker clock)
    logprobs: list | None = None
    prompt_tokens: int = 0
    lens: list[int] | bytes | None = None     # bytes: as decoded from the wire (one length a byte)
    # echo / prompt logprobs (`pr`): [prompt text or None, prompt token entries or None], on the
    # event holding a request's first token only (a `tail` has none: it was delivered before)
    prompt: list | None = None

    @property
    def n(self) -> int:
        return len(self.ids)

    def add_output(self, out) -> None:
        """Append one engine output's tokens (a worker.engine StepOutput: `token_ids`, `text`,
        `logprobs`): the one place that says how each per-token field accumulates into an event."""
        ids, text = out.token_ids, out.text
        lens = self.lens
        if lens is None:
            lens = self.lens = []
        if ids:
            # the output's text was released with its last id; text before the first id of
            # this event (it came with no id) rides with that first id
            lead = 0 if lens else len(self.text)
            lens.extend([0] * (len(ids) - 1))
            lens.append(lead + len(text))
            self.ids.extend(ids)
        elif text and lens:
            lens[-1] += len(text)
        self.text += text
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.logprobs)
        if out.prompt is not None:
            self.prompt = out.prompt

    @property
    def first(self) -> int:
        """The first token seq it covers."""
        return self.seq - len(self.ids) + 1

    def encode(self) -> bytes:
        event = {"v": EVENT_VERSION, "k": "tok", "rid": self.rid, "seq": self.seq, "n": len(self.ids),
                 "ids": self.ids, "text": self.text, "ep": self.epoch, "ms": self.ms}
        if self.prompt_tokens:
            event["pt"] = self.prompt_tokens
        if self.logprobs is not None:
            event["lp"] = self.logprobs
        if self.prompt is not None:
            event["pr"] = self.prompt
        lens = self.lens
        if len(self.ids) > 1 and lens is not None and len(lens) == len(self.ids):
            try:        # one byte a token (a bin decodes as one object, not a list of ints)
                event["tl"] = bytes(lens)
            except ValueError:      # a token released 256 characters or more
                event["tl"] = lens
        return _pack(event)

    def tail(self, after: int) -> "TokEvent | None":
        """The tokens after token `after` (`first <= after < seq`) as an event of their own: ids,
        text and logprobs cut at that token. None: the event cannot say where its text is cut
        (written before `lens`, with text, and no logprobs whose tokens spell it out)."""
        k = after - (self.seq - len(self.ids) + 1) + 1           # tokens to drop: 1 .. n-1
        lens = self.lens
        try:
            cut = sum(lens[:k]) if len(lens) == len(self.ids) and sum(lens) == len(self.text) else None
        except TypeError:       # None, or not a list of ints
            cut = None
        if cut is None:
            lens = _lens_without_field(self)
            if lens is None:
                return None
            cut = sum(lens[:k])
        lp = self.logprobs
        return TokEvent(self.rid, self.seq, self.ids[k:], self.text[cut:], self.epoch, self.ms,
                        lp[k:] if lp is not None else None, self.prompt_tokens, lens[k:])

    @classmethod
    def from_map(cls, d: dict) -> "TokEvent":
        try:        # the hot path: a map our own encoder wrote
            return cls(d["rid"], d["seq"], d["ids"], d["text"], d["ep"], d["ms"], d.get("lp"), d.get("pt", 0),
                       d.get("tl"), d.get("pr"))
        except KeyError:
            pass
        ids = d.get("ids")
        tl = d.get("tl")
        return cls(d.get("rid") or "", int(d.get("seq") or 0), ids if isinstance(ids, list) else [],
                   d.get("text") or "", int(d.get("ep") or 0), int(d.get("ms") or 0), d.get("lp"),
                   int(d.get("pt") or 0), tl if isinstance(tl, (list, bytes)) else None,
                   d.get("pr") if isinstance(d.get("pr"), list) else None)


def _lens_without_field(ev: TokEvent) -> list[int] | None:
    """Per-token text lengths of an event that has no `lens` (one token; written before the field
    existed): all 0 when it has no text, else those of its logprobs' token strings when they spell
    its text exactly (no bytes held back across tokens); None when nothing says where to cut."""
    n = len(ev.ids)
    if n == 1:
        return [len(ev.text)]
    if not ev.text:
        return [0] * n
    lp = ev.logprobs
    if lp is not None and len(lp) == n:
        try:
            pieces = [entry[0] for entry in lp]
        except (TypeError, IndexError):
            return None
        if all(isinstance(p, str) for p in pieces) and "".join(pieces) == ev.text:
            return [len(p) for p in pieces]
    return None


@dataclass(slots=True)
class DoneUsage:
    """A `done`'s usage. `cached_tokens`: prompt tokens the prefix cache served; `ttft_ms` /
    `ttfmt_ms` / `ttlt_ms`: submit (the entry's created_ms) -> first token / first
    non-whitespace token / the final, by the worker's clock (None: not known)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: int | None = None
    ttfmt_ms: int | None = None
    ttlt_ms: int | None = None

    def to_map(self) -> dict:
        usage: dict = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.cached_tokens:
            usage["cached_tokens"] = self.cached_tokens
        for name, value in (("ttft_ms", self.ttft_ms), ("ttfmt_ms", self.ttfmt_ms), ("ttlt_ms", self.ttlt_ms)):
            if value is not None:
                usage[name] = max(0, value)
        return usage

    @classmethod
    def from_map(cls, u: dict) -> "DoneUsage":
        return cls(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0),
                   int(u.get("cached_tokens") or 0), _ms_or_none(u.get("ttft_ms")),
                   _ms_or_none(u.get("ttfmt_ms")), _ms_or_none(u.get("ttlt_ms")))


def _ms_or_none(value: Any) -> int | float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(slots=True)
class DoneEvent:
    """A request's final answer; carries no tokens (tokens of the same flush are in a `TokEvent`
    before it). `usage` is None only on a final this gateway made itself. `worker` and `lane`
    (the request's priority) are for the gateway's per-request log line. `text`: rarely, text
    the detokenizer released with no new token id."""
    KIND: ClassVar[str] = "done"
    is_final: ClassVar[bool] = True

    rid: str
    seq: int
    finish_reason: str
    usage: DoneUsage | None
    epoch: int = 0
    ms: int = 0
    worker: str = ""
    lane: str = ""
    text: str = ""
    local: bool = False                  # made by this gateway, not by a worker (never encoded)

    def encode(self) -> bytes:
        event = {"v": EVENT_VERSION, "k": "done", "rid": self.rid, "seq": self.seq,
                 "finish_reason": self.finish_reason, "usage": (self.usage or DoneUsage()).to_map(),
                 "ep": self.epoch, "ms": self.ms}
        return _pack(_tail(event, self.worker, self.lane, self.text))

    @classmethod
    def from_map(cls, d: dict) -> "DoneEvent":
        usage = d.get("usage")
        return cls(d.get("rid") or "", int(d.get("seq") or 0), d.get("finish_reason") or "",
                   DoneUsage.from_map(usage) if usage and isinstance(usage, dict) else None,
                   int(d.get("ep") or 0), int(d.get("ms") or 0), d.get("wk") or "", d.get("lane") or "",
                   d.get("text") or "")

    @classmethod
    def here(cls, rid: str, seq: int, finish_reason: str) -> "DoneEvent":
        """A final this gateway makes itself (a cancel no worker confirmed in time)."""
        return cls(rid, seq, finish_reason, None, local=True)


@dataclass(slots=True)
class ErrEvent:
    """A request's final error. `code` is a shared.errors.ErrorCode value as written (one this
    version does not know is kept as is: `error_code` reads it as `internal`); `param` names the
    request field the error is about (e.g. `response_format` for a schema the engine could not
    compile), so nobody has to read it out of `message`."""
    KIND: ClassVar[str] = "err"
    is_final: ClassVar[bool] = True

    rid: str
    seq: int
    code: str
    message: str
    retryable: bool
    epoch: int = 0
    ms: int = 0
    worker: str = ""
    lane: str = ""
    param: str | None = None
    text: str = ""
    local: bool = False                  # made by this gateway, not by a worker (never encoded)

    def encode(self) -> bytes:
        event = {"v": EVENT_VERSION, "k": "err", "rid": self.rid, "seq": self.seq, "code": self.code,
                 "message": self.message, "retryable": self.retryable, "ep": self.epoch, "ms": self.ms}
        if self.param is not None:
            event["param"] = self.param
        return _pack(_tail(event, self.worker, self.lane, self.text))

    @classmethod
    def from_map(cls, d: dict) -> "ErrEvent":
        code = d.get("code")
        retryable = d.get("retryable")
        param = d.get("param")
        return cls(d.get("rid") or "", int(d.get("seq") or 0), code if isinstance(code, str) else "",
                   str(d.get("message") or error_code(code).value),
                   error_code(code) in RETRYABLE if retryable is None else bool(retryable), int(d.get("ep") or 0),
                   int(d.get("ms") or 0), d.get("wk") or "", d.get("lane") or "",
                   param if isinstance(param, str) else None, d.get("text") or "")

    @classmethod
    def here(cls, rid: str, seq: int, code: ErrorCode, message: str) -> "ErrEvent":
        """A final error this gateway makes itself (stalled, output_lost, resumed_elsewhere)."""
        return cls(rid, seq, code.value, message, code in RETRYABLE, local=True)


def error_code(value: Any) -> ErrorCode:
    """An event's code as an ErrorCode (one this version does not know: `internal`)."""
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL


def _tail(event: dict, worker: str, lane: str, text: str) -> dict:
    if worker:
        event["wk"] = worker
    if lane:
        event["lane"] = lane
    if text:
        event["text"] = text
    return event


@dataclass(slots=True)
class AttachMarker:
    """Inbox only: rid's live events come to this inbox from now on; everything <= `seq` is in
    the history (None: the writing worker does not hold rid; read the history to its end).
    `att`: the attach counter of the resume it answers."""
    KIND: ClassVar[str] = "att"
    is_final: ClassVar[bool] = False

    rid: str
    seq: int | None
    epoch: int
    att: int

    def encode(self) -> bytes:
        return _pack({"v": EVENT_VERSION, "k": "att", "rid": self.rid, "seq": self.seq, "ep": self.epoch,
                      "att": self.att})

    @classmethod
    def from_map(cls, d: dict) -> "AttachMarker":
        seq = d.get("seq")
        return cls(d.get("rid") or "", None if seq is None else int(seq), int(d.get("ep") or 0),
                   int(d.get("att") or 0))


@dataclass(slots=True)
class Moved:
    """Inbox only, written by a GATEWAY into the inbox of the gateway that served rid before:
    a client resumed rid there (attach counter `att`); the old gateway's session that still
    has it ends it with `resumed_elsewhere` instead of leaving it silent (gateway.submit.attach)."""
    KIND: ClassVar[str] = "moved"
    is_final: ClassVar[bool] = False

    rid: str
    att: int

    def encode(self) -> bytes:
        return _pack({"v": EVENT_VERSION, "k": "moved", "rid": self.rid, "att": self.att})

    @classmethod
    def from_map(cls, d: dict) -> "Moved":
        return cls(d.get("rid") or "", int(d.get("att") or 0))


@dataclass(slots=True)
class ReplyError:
    """A worker's refusal of a tokenize request (the `error` of a `TokenizeReply`)."""
    code: str
    message: str
    param: str | None = None

    def to_map(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param}


@dataclass(slots=True)
class TokenizeReply:
    """Inbox only: the answer to a `tokenize` / `detokenize` control entry (worker.tokenization)
    for one-shot reply id `rid`: `tokens` + `token_strs` + `max_model_len` (tokenize), `prompt`
    (detokenize), or `error`."""
    KIND: ClassVar[str] = "tokr"
    is_final: ClassVar[bool] = False

    rid: str
    tokens: list[int] | None = None
    token_strs: list[str] | None = None
    max_model_len: int | None = None
    prompt: str | None = None
    error: ReplyError | None = None

    def encode(self) -> bytes:
        return _pack({"v": EVENT_VERSION, "k": "tokr", "rid": self.rid, **self.answer()})

    def answer(self) -> dict:
        """The reply's fields as worker.tokenization.answer returns them."""
        if self.error is not None:
            return {"error": self.error.to_map()}
        if self.prompt is not None:
            return {"prompt": self.prompt}
        return {"tokens": self.tokens, "token_strs": self.token_strs, "max_model_len": self.max_model_len}

    @classmethod
    def from_answer(cls, reply_id: str, answer: dict) -> "TokenizeReply":
        return cls.from_map({**answer, "rid": reply_id})

    @classmethod
    def from_map(cls, d: dict) -> "TokenizeReply":
        err = d.get("error")
        error = None
        if isinstance(err, dict):
            param = err.get("param")
            error = ReplyError(str(err.get("code") or ErrorCode.INTERNAL.value), str(err.get("message") or ""),
                               param if isinstance(param, str) else None)
        tokens, strs = d.get("tokens"), d.get("token_strs")
        return cls(d.get("rid") or "", list(tokens) if tokens is not None else None,
                   list(strs) if strs is not None else None, d.get("max_model_len"), d.get("prompt"), error)


Event = Union[TokEvent, DoneEvent, ErrEvent, AttachMarker, TokenizeReply, Moved]
FinalEvent = Union[DoneEvent, ErrEvent]
HistoryEvent = Union[TokEvent, DoneEvent, ErrEvent]      # what a request's history stream holds
HISTORY_TYPES = (TokEvent, DoneEvent, ErrEvent)

_BY_KIND: dict[str, Any] = {c.KIND: c.from_map for c in (TokEvent, DoneEvent, ErrEvent, AttachMarker, TokenizeReply,
                                                         Moved)}


def event_from_map(obj: Any) -> Event | None:
    """A decoded wire map -> its event (None: not a map, or a kind this version does not know)."""
    if type(obj) is not dict:
        return None
    from_map = _BY_KIND.get(obj.get("k"))
    return from_map(obj) if from_map is not None else None


def decode_event(raw: bytes) -> Event | None:
    """One event (a history entry's `d`)."""
    return event_from_map(_unpackb(raw, raw=False))


def decode_events(raw: bytes) -> list[Event]:
    """The events of one inbox entry (a msgpack list of maps), those this version knows."""
    obj = _unpackb(raw, raw=False)
    if type(obj) is not list:
        obj = [obj]
    by_kind = _BY_KIND
    out = []
    for d in obj:
        if type(d) is dict:
            from_map = by_kind.get(d.get("k"))
            if from_map is not None:
                out.append(from_map(d))
    return out

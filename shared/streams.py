"""The gateway <-> worker hop (transport v2): Redis key layout and the msgpack entries on it.

Every key starts with `Settings.stream_prefix` (`p`, default `llm`) and carries a hash tag, so
each multi-key command, MULTI or Lua script touches ONE Redis Cluster slot:

| key                      | type   | slot    | what                                                        |
|--------------------------|--------|---------|-------------------------------------------------------------|
| p:{q}:requests           | stream | {q}     | request entries; consumer group `workers`                   |
| p:{q}:dead               | stream | {q}     | dead letters (XADD + XACK in one MULTI)                     |
| p:{q}:conc:<key_id>      | zset   | {q}     | per-API-key concurrency leases, rid -> expiry ms            |
| p:{q}:rate:<key_id>:<m>  | string | {q}     | per-key rate-limit counter of minute m                      |
| p:{q}:idem:<owner>:<h>   | string | {q}     | rid of the request an idempotency key started (TTL)         |
| p:{r:<rid>}:out          | stream | {r:rid} | the request's HISTORY: ids `{seq}-0` tokens, `{seq}-1` final |
| p:{r:<rid>}:meta         | hash   | {r:rid} | key, gw, owner, lease, epoch, att, bg, tm (META_*); TTL output_ttl_s |
| p:{r:<rid>}:cancel       | string | {r:rid} | cancel flag for a request not yet running (TTL)             |
| p:{g:<gw>}:inbox         | stream | {g:gw}  | LIVE events of the requests gateway `gw` serves (MAXLEN ~)  |
| p:{g:<gw>}:reqs          | set    | {g:gw}  | rids gateway `gw` serves (takeover when it dies); TTL beats |
| p:{w:<worker>}:ctl       | stream | {w:id}  | control for one worker: cancel / attach / take / tokenize   |
| p:{w:<worker>}:info      | hash   | {w:id}  | a worker's registry details (TTL worker_ttl_s)              |
| p:{reg}:workers          | zset   | {reg}   | worker id -> last heartbeat ms                              |
| p:{reg}:gateways         | zset   | {reg}   | gateway id -> last heartbeat ms                             |
| p:{reg}:orphans          | zset   | {reg}   | "rid|att" -> deadline of a parked orphan                    |
| p:{f:<id>}:file          | hash   | {f:id}  | a Batch API file: object, owner, bytes (gateway.batch)       |
| p:{b:<id>}:batch|results|attempts|lease | hash, hash, hash, string | {b:id} | a batch, its answers, its retries, its runner |
| p:{files}:<owner>, p:{batches}:<owner> | zset | {files}, {batches} | an owner's files / batches for listing |
| p:{batches}:active       | zset   | {batches} | batches not final yet, which every gateway's runner picks from |

Request entries carry one field `d` (msgpack of `RequestEntry`, which names its gateway `gw`).
History entries carry `d` = msgpack of ONE event; inbox entries `d` = a msgpack LIST of events
(one XADD per gateway per worker flush, many requests in it). Events are v2 maps (shared.events); see
docs/transport.md for the whole data path, resume and the reasons.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgpack

from shared.events import EVENT_VERSION
from shared.protocol import MAX_TOP_LOGPROBS, PROTOCOL_VERSION
from shared.sampling import NEUTRAL, SamplingParams, invalid_control

CONSUMER_GROUP = "workers"
ENTRY_FIELD = b"d"
INBOX_MAXLEN = 10000     # entries of a gateway's inbox (approximate MAXLEN): each holds one flush's events

# fields of p:{r:rid}:meta
META_KEY = "key"        # API key id of the request's owner (resume must present the same key)
META_GW = "gw"          # gateway whose inbox gets the live events
META_OWNER = "owner"    # worker running the request (absent when none)
META_LEASE = "lease"    # ms on Redis's clock until which owner's claim holds (refreshed by it; worker.ownership)
META_EPOCH = "epoch"    # bumped by every worker that takes the request (first run = 1)
META_ATT = "att"        # attach counter: bumped by every resume
META_BG = "bg"          # "1": a background response (nobody need listen: never cancelled as an orphan)
META_ORPHANED = "orph"  # "1": an orphan sweep cancelled it (nobody resumed it within the grace; gateway.submit)
META_TOOLS = "tm"       # how a chat answer is read for tool calls (auto | forced; absent: plain text), so
                        # a resume on any replica parses it as the first stream did


@dataclass(frozen=True)
class Keys:
    prefix: str = "llm"

    # ---- slot {q}: the request queue and everything admission touches ----
    @property
    def requests(self) -> str:
        return f"{self.prefix}:{{q}}:requests"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:{{q}}:dead"

    def conc(self, key_id: str) -> str:
        return f"{self.prefix}:{{q}}:conc:{key_id}"

    def rate(self, key_id: str, minute: int) -> str:
        return f"{self.prefix}:{{q}}:rate:{key_id}:{minute}"

    def idem(self, owner: str, digest: str) -> str:
        return f"{self.prefix}:{{q}}:idem:{owner}:{digest}"

    # ---- slot {r:rid}: one request ----
    def out(self, rid: str) -> str:
        return f"{self.prefix}:{{r:{rid}}}:out"

    def meta(self, rid: str) -> str:
        return f"{self.prefix}:{{r:{rid}}}:meta"

    def cancel(self, rid: str) -> str:
        return f"{self.prefix}:{{r:{rid}}}:cancel"

    # ---- slot {resp:hex}: one stored Responses API response (gateway.openai.responses_store) ----
    def response(self, hex_id: str) -> str:
        return f"{self.prefix}:{{resp:{hex_id}}}:resp"

    # ---- slot {g:gw}: one gateway ----
    def inbox(self, gw: str) -> str:
        return f"{self.prefix}:{{g:{gw}}}:inbox"

    def gw_reqs(self, gw: str) -> str:
        return f"{self.prefix}:{{g:{gw}}}:reqs"

    # ---- slot {w:id}: one worker ----
    def ctl(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:ctl"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:info"

    # ---- slot {reg}: liveness registries ----
    @property
    def workers(self) -> str:
        return f"{self.prefix}:{{reg}}:workers"

    @property
    def gateways(self) -> str:
        return f"{self.prefix}:{{reg}}:gateways"

    @property
    def orphans(self) -> str:
        return f"{self.prefix}:{{reg}}:orphans"

    # ---- the Batch API (gateway.batch): slot {f:id} one file, {b:id} one batch ----
    def file(self, file_id: str) -> str:
        return f"{self.prefix}:{{f:{file_id}}}:file"

    def files(self, owner: str) -> str:
        return f"{self.prefix}:{{files}}:{owner}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:batch"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:results"

    def batch_attempts(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:attempts"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:lease"

    def batches(self, owner: str) -> str:
        return f"{self.prefix}:{{batches}}:{owner}"

    @property
    def batches_active(self) -> str:
        return f"{self.prefix}:{{batches}}:active"


@dataclass
class RequestEntry:
    """One generate request as a worker receives it."""
    rid: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict] | None = None    # chat: the functions the model may call (rendered by its chat template)
    priority: Literal["interactive", "batch"] = "interactive"
    created_ms: int = 0
    key_id: str = ""
    gw: str = ""         # id of the gateway that submitted it: live events go to its inbox
    route: str = ""      # the worker whose prefix cache should serve it ("": any; shared.routing)
    # prefix-cache scope: salts the root of its KV block hash chain, so it shares cached blocks
    # only with requests of the same scope ("": deployment-wide; gateway.cache_scope)
    cache_salt: str = ""
    prompt_ids: list[int] | None = None    # a prompt given as token ids (completions), instead of prompt/messages
    v: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        fields = asdict(self)
        if not fields["route"]:
            del fields["route"]     # what workers older than routing can read
        if not fields["cache_salt"]:
            del fields["cache_salt"]    # what workers older than cache scopes can read
        if fields["tools"] is None:
            del fields["tools"]
        if fields["params"]["grammar"] is None:
            del fields["params"]["grammar"]   # a worker older than structured output can read it
        if fields["params"]["logprobs"] is None:
            del fields["params"]["logprobs"]    # what workers older than logprobs can read
        if not fields["params"]["ignore_eos"]:
            del fields["params"]["ignore_eos"]  # what workers older than ignore_eos can read
        for name, neutral in NEUTRAL.items():   # what workers older than these controls can read
            if fields["params"][name] == neutral:
                del fields["params"][name]
        for name, usual in (("prompt_logprobs", None), ("echo", False)):   # older workers read it without
            if fields["params"][name] == usual:
                del fields["params"][name]
        if fields["prompt_ids"] is None:
            del fields["prompt_ids"]
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "RequestEntry":
        """Raises ValueError on anything malformed (the caller dead-letters it)."""
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)   # logit_bias: int keys
        except Exception as exc:
            raise ValueError(f"undecodable entry: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("entry is not a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise ValueError(f"unsupported entry version {obj.get('v')!r}")
        try:
            params = SamplingParams(**obj.pop("params"))
            # fields a newer gateway adds are ignored, so workers can be upgraded after gateways
            entry = cls(params=params, **{k: v for k, v in obj.items() if k in _ENTRY_FIELDS})
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed entry: {exc}") from None
        if not isinstance(entry.rid, str) or not entry.rid:
            raise ValueError("entry has no rid")
        if [entry.prompt, entry.messages, entry.prompt_ids].count(None) != 2:
            raise ValueError("entry needs exactly one of prompt/messages/prompt_ids")
        if entry.prompt_ids is not None and not (isinstance(entry.prompt_ids, list) and entry.prompt_ids
                                                 and all(type(t) is int for t in entry.prompt_ids)):
            raise ValueError("bad prompt_ids")
        p = entry.params
        if p.prompt_logprobs is not None and not (type(p.prompt_logprobs) is int
                                                  and 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError("bad prompt_logprobs")
        if type(p.echo) is not bool:
            raise ValueError("bad echo")
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
        if p.grammar is not None and not isinstance(p.grammar, dict):
            raise ValueError("bad grammar")
        if p.logprobs is not None and not (type(p.logprobs) is int and 0 <= p.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError("bad logprobs")
        if not isinstance(entry.cache_salt, str):
            raise ValueError("bad cache_salt")
        if type(p.ignore_eos) is not bool:
            raise ValueError("bad ignore_eos")
        if (bad := invalid_control(p)) is not None:
            raise ValueError(f"bad {bad[0]}")
        return entry


_ENTRY_FIELDS = {f for f in RequestEntry.__dataclass_fields__ if f != "params"}


# ---- events (v2) ---------------------------------------------------------------------------
# The worker -> gateway events (tok, done, err, the att marker, tokr) and their codec are
# shared.events (one class each); what is here is how they sit on Redis: history entries hold
# one event, inbox entries a list of them (`pack_event_list`), ids from `history_id`.

def decode_event(raw: bytes) -> dict[str, Any]:
    """One event (a history entry's `d`) as its wire map, for tests and tools that look at the
    wire itself; the services read events typed (shared.events.decode_event)."""
    return msgpack.unpackb(raw, raw=False)


def pack_event_list(payloads: list[bytes]) -> bytes:
    """An inbox entry's `d`: a msgpack array of already-packed events. Built by concatenation
    (array header + the packed maps), so each event is encoded once for history and inbox."""
    n = len(payloads)
    if n < 16:
        header = bytes([0x90 | n])
    elif n < 1 << 16:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    return header + b"".join(payloads)


def decode_event_list(raw: bytes) -> list[dict[str, Any]]:
    """The events of one inbox entry as wire maps (tests and tools; typed: shared.events.decode_events)."""
    events = msgpack.unpackb(raw, raw=False)
    return events if isinstance(events, list) else [events]


def history_id(seq: int, final: bool) -> str:
    """History entry id from seq: idempotent writes (a retried XADD of the same event is refused
    as "equal or smaller") and a stream a resume can XRANGE by seq."""
    return f"{seq}-{1 if final else 0}"


# ---- control entries (p:{w:id}:ctl, field `d`) ----
def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_cancel(rid: str) -> bytes:
    return _pack({"v": EVENT_VERSION, "k": "cancel", "rid": rid})


def encode_take(rid: str, entry_id: str, deliveries: int) -> bytes:
    """Routing: "request entry `entry_id` (of rid) is in your pending list now: run it" (a
    worker that read an entry routed to this one handed it over; worker.intake)."""
    return _pack({"v": EVENT_VERSION, "k": "take", "rid": rid, "entry": entry_id, "deliveries": deliveries})


def encode_attach(rid: str, gw: str, att: int) -> bytes:
    """Resume: "send rid's live events to gateway `gw` from now on, after an att marker"."""
    return _pack({"v": EVENT_VERSION, "k": "attach", "rid": rid, "gw": gw, "att": att})


TOKENIZE_KINDS = ("tokenize", "detokenize")


def encode_tokenize(kind: Literal["tokenize", "detokenize"], reply_id: str, gw: str, fields: dict) -> bytes:
    """vLLM's /tokenize or /detokenize, for a worker's tokenizer (worker.tokenization): `fields`
    are a prompt or messages (+ tools and options), or `tokens`; the answer goes to gateway
    `gw`'s inbox as a `tokr` event for `reply_id`."""
    return _pack({"v": EVENT_VERSION, "k": kind, "rid": reply_id, "gw": gw, **fields})


def as_str(value: Any) -> str:
    """Redis replies are bytes unless a client decodes them; stream ids and names as str."""
    return value.decode() if isinstance(value, bytes) else str(value)

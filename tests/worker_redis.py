"""Talking to workers the way a gateway does: XADD a request entry, read its history stream
(`p:{r:rid}:out`) or a gateway inbox (`p:{g:gw}:inbox`) directly, with transport v2 events."""

from __future__ import annotations

import time
import uuid

from gateway.stream_join import StreamJoin
from shared.sampling import SamplingParams
from shared.events import event_from_map
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, decode_event, decode_event_list
from tests.gateway_client import eventually


def new_rid() -> str:
    return uuid.uuid4().hex


async def submit(redis, keys: Keys, rid: str | None = None, *, prompt: str = "Tell me a story about a cat.",
                 messages=None, gw: str = "", key_id: str = "", **params) -> str:
    rid = rid or new_rid()
    params.setdefault("max_tokens", 16)
    params.setdefault("temperature", 0.0)
    entry = RequestEntry(rid=rid, params=SamplingParams(**params), prompt=None if messages else prompt,
                         messages=messages, created_ms=int(time.time() * 1000), gw=gw, key_id=key_id)
    await redis.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
    return rid


async def history(redis, keys: Keys, rid: str) -> list[dict]:
    """rid's history as it is now (each event with its stream id under "_id"); `read_events`
    waits for its final."""
    events = []
    for entry_id, fields in await redis.xrange(keys.out(rid)):
        ev = decode_event(fields[ENTRY_FIELD])
        ev["_id"] = entry_id.decode()
        events.append(ev)
    return events


async def read_events(redis, keys: Keys, rid: str, *, after: str = "0-0", timeout: float = 60.0,
                      until_final: bool = True) -> list[dict]:
    """History events of `rid` (each with its stream id under "_id") until the final one, or timeout."""
    events: list[dict] = []
    last = after
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = await redis.xread({keys.out(rid): last}, block=200, count=500)
        for _key, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                ev = decode_event(fields[ENTRY_FIELD])
                ev["_id"] = last
                ev["_t"] = time.monotonic()
                events.append(ev)
                if until_final and ev["k"] in ("done", "err"):
                    return events
        if not until_final and events:
            return events
    raise AssertionError(f"no final event for {rid} within {timeout}s; got {len(events)} events")


async def read_inbox(redis, keys: Keys, gw: str, rids: set[str], *, timeout: float = 60.0,
                     after: str = "0-0") -> tuple[dict[str, list[dict]], list[int]]:
    """Live events of `rids` from gateway `gw`'s inbox until each has a final event, as a gateway
    reads them. Also returns the number of events in each inbox entry."""
    per_rid: dict[str, list[dict]] = {rid: [] for rid in rids}
    open_rids = set(rids)
    sizes: list[int] = []
    last = after
    deadline = time.monotonic() + timeout
    while open_rids and time.monotonic() < deadline:
        resp = await redis.xread({keys.inbox(gw): last}, block=200, count=500)
        for _key, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                events = decode_event_list(fields[ENTRY_FIELD])
                sizes.append(len(events))
                for ev in events:
                    ev["_t"] = time.monotonic()
                    ev["_written_ms"] = int(last.split("-")[0])    # Redis clock at the XADD
                    if ev["rid"] in per_rid:
                        per_rid[ev["rid"]].append(ev)
                        if ev["k"] in ("done", "err"):
                            open_rids.discard(ev["rid"])
    if open_rids:
        raise AssertionError(f"no final event in inbox {gw} for {sorted(open_rids)} within {timeout}s")
    return per_rid, sizes


def history_after(history: list[dict], after: int) -> list[dict]:
    """What a gateway's history read returns (gateway.submit.Submitter.read_history): the token
    events after token `after` and a final at or after it."""
    return [e for e in history if (e["k"] == "tok" and e["seq"] > after) or (e["k"] != "tok" and e["seq"] >= after)]


def client_view(live: list[dict], history: list[dict] | None = None, *, after: int = 0) -> list[dict]:
    """What a client receives from these live events through the gateway's own join
    (gateway.stream_join.StreamJoin), which reads `history` (the request's history as finally
    written; none: an empty one) whenever live has a hole: every token event once and in
    order, then the final, or the `output_lost` error where the history cannot fill a hole.
    `after`: the client already has tokens up to here."""
    join = StreamJoin(after)
    given: dict[int, dict] = {}         # the join takes typed events (shared.events); this view gives back the maps
    keep: list = []

    def typed(maps: list[dict]) -> list:
        events = [event_from_map(e) for e in maps]
        keep.extend(events)
        given.update((id(ev), e) for ev, e in zip(events, maps))
        return events

    def as_maps(events: list) -> list[dict]:     # a gap's output_lost final is the join's own
        return [given.get(id(ev)) or {"k": ev.KIND, "seq": ev.seq, "code": ev.code, "message": ev.message,
                                      "retryable": ev.retryable, "local": True} for ev in events]
    out: list[dict] = []
    for ev in live:
        if ev.get("k") == "att":
            continue                    # attach markers matter to a resuming join only
        out += as_maps(join.live(typed([ev])[0]))
        while join.wants_read and not join.ended:
            out += as_maps(join.history(typed(history_after(history or [], join.start_read()))))
    return out


async def silent_worker(redis, keys: Keys) -> None:
    """A registered worker that never reads its queue: admission lets requests through, and the
    test plays the worker (writes history and inbox entries itself) or lets them wait."""
    await redis.zadd(keys.workers, {"silent": int(time.time() * 1000) + 600_000})


async def last_seq(redis, keys: Keys, rid: str) -> int:
    last = await redis.xrevrange(keys.out(rid), count=1)
    return decode_event(last[0][1][ENTRY_FIELD])["seq"] if last else 0


async def wait_for_tokens(redis, keys: Keys, rid: str, n: int, timeout: float = 60.0) -> None:
    """Until the history holds at least `n` tokens of `rid`."""
    async def reached() -> bool:
        return await last_seq(redis, keys, rid) >= n
    assert await eventually(reached, timeout=timeout, interval=0.01), f"{rid} did not reach {n} tokens"


async def owner_of(redis, keys: Keys, rid: str) -> str | None:
    owner = await redis.hget(keys.meta(rid), "owner")
    return owner.decode() if owner else None


def text_of(events: list[dict]) -> str:
    return "".join(e.get("text", "") for e in events if e["k"] == "tok")


def check_seqs(events: list[dict]) -> None:
    """Token events cover tokens 1..S without gaps or repeats (seq = tokens so far, n tokens
    each, n ids); the final event carries the last seq and comes last."""
    seq = 0
    for ev in events[:-1]:
        assert ev["k"] == "tok", ev
        assert ev["n"] >= 1 and len(ev["ids"]) == ev["n"] and ev["seq"] == seq + ev["n"], (seq, ev)
        seq = ev["seq"]
    assert events[-1]["k"] in ("done", "err") and events[-1]["seq"] == seq, events[-1]


async def check_client_stream(redis, keys: Keys, rid: str, chunks: list[dict], done: dict) -> list[dict]:
    """The fault tests' exactness check of one stream as its client received it (`chunks`, then
    `done`) against the worker's record of it (its history in Redis): the same text, nothing
    lost and nothing twice, every seq once and in order, as many tokens as the usage says.
    Returns the history."""
    events = await history(redis, keys, rid)
    assert "".join(ch["text"] for ch in chunks) == text_of(events), rid
    seqs = [ch["seq"] for ch in chunks]
    assert seqs == sorted(set(seqs)) and done["seq"] == sum(e["n"] for e in events if e["k"] == "tok"), rid
    tokens = sum(ch["tokens"] for ch in chunks)
    assert tokens == done["usage"]["completion_tokens"] == events[-1]["usage"]["completion_tokens"], rid
    return events


async def pending_after_acks(redis, keys: Keys, timeout: float = 10.0) -> int:
    """Pending entries once the workers' acks have landed: a worker acks in the round trip
    AFTER the final event (different slots), so a reader that just saw a final may be early."""
    from shared.streams import CONSUMER_GROUP

    async def none_pending() -> bool:
        return not (await redis.xpending(keys.requests, CONSUMER_GROUP))["pending"]
    await eventually(none_pending, timeout=timeout, interval=0.05)
    return (await redis.xpending(keys.requests, CONSUMER_GROUP))["pending"]


async def worker_info(redis, keys: Keys, worker: str) -> dict[str, str]:
    """A worker's registry hash (`p:{w:<id>}:info`, refreshed with every heartbeat) as strings."""
    return {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.worker(worker))).items()}


async def beats_after(redis, keys: Keys, worker: str, after_ms: int, *, count: int = 1, timeout: float = 30.0) -> None:
    """Wait until `worker` has written `count` registry heartbeats after `after_ms` (wall clock):
    its event loop has run that many heartbeat rounds since (a wait on the worker's own
    progress, not on a guessed time)."""
    last = after_ms
    for _ in range(count):
        async def newer() -> bool:
            return int((await worker_info(redis, keys, worker)).get("heartbeat_ms", 0)) > last
        assert await eventually(newer, timeout=timeout, interval=0.05), f"worker {worker} stopped beating"
        last = int((await worker_info(redis, keys, worker))["heartbeat_ms"])


async def meta_of(redis, keys: Keys, rid: str) -> dict[str, str]:
    """rid's meta hash (owner, epoch, lease, gw, ...) as strings."""
    return {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.meta(rid))).items()}

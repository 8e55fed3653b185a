"""Talking to workers the way a gateway does: XADD a request entry, read its output stream."""

from __future__ import annotations

import asyncio
import time
import uuid

from shared.streams import ENTRY_FIELD, Keys, RequestEntry, SamplingParams, decode_event


def new_rid() -> str:
    return uuid.uuid4().hex


async def submit(redis, keys: Keys, rid: str | None = None, *, prompt: str = "Tell me a story about a cat.",
                 messages=None, **params) -> str:
    rid = rid or new_rid()
    params.setdefault("max_tokens", 16)
    params.setdefault("temperature", 0.0)
    entry = RequestEntry(rid=rid, params=SamplingParams(**params), prompt=None if messages else prompt,
                         messages=messages, created_ms=int(time.time() * 1000))
    await redis.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
    return rid


async def read_events(redis, keys: Keys, rid: str, *, after: str = "0-0", timeout: float = 60.0,
                      until_final: bool = True) -> list[dict]:
    """Events of `rid` (each with its stream id under "_id") until the final one, or timeout."""
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


async def wait_for_tokens(redis, keys: Keys, rid: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await redis.xlen(keys.out(rid)) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} did not reach {n} events")


def text_of(events: list[dict]) -> str:
    return "".join(e.get("text", "") for e in events if e["k"] == "tok")


def check_seqs(events: list[dict]) -> None:
    """Token events count 1, 2, 3... without gaps or repeats; the final event carries the last seq."""
    toks = [e["seq"] for e in events if e["k"] == "tok"]
    assert toks == list(range(1, len(toks) + 1)), toks
    assert events[-1]["seq"] == len(toks)

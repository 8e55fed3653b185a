"""Stored Responses API responses: one Redis hash a response (`Keys.response`), bound to the API
key that made it, kept RESPONSES_TTL_S.

What is stored is what the request was (its fixed fields, its input items, the conversation it
continues, how its output is read); what it answered is not written as it runs. Its status and
output are derived from the request's own history stream and meta (`current`), through the same
pure event sequence a stream is (gateway.openai.response_events), so any replica answers a poll,
also after the gateway that started it died, and a poll agrees with a stream. The first reader
that sees the response finished stores the finished object (`final`), which then outlives the
request's history (OUTPUT_TTL_S) up to RESPONSES_TTL_S.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.auth import may_resume
from gateway.frames import token_logprob
from gateway.openai.response_events import ResponseEvents
from gateway.submit import Submitter
from shared.events import ErrEvent, HistoryEvent, TokEvent
from shared.streams import META_EPOCH, Keys, as_str

PREFIX = "resp_"


@dataclass
class Stored:
    hex: str                      # the request id (the response id is resp_<hex>)
    key_id: str
    base: dict
    conversation: list[dict]      # the chat messages before its output, instructions excluded
    input: list[dict]             # its input items, as listed
    mode: str | None              # tool mode of its output
    logprobs: bool
    final: dict | None
    cancelled: bool

    def events(self) -> ResponseEvents:
        return ResponseEvents(self.base, tool_mode=self.mode, logprobs=self.logprobs)


def feed(events: ResponseEvents, ev: HistoryEvent) -> list[dict]:
    """One history event (shared.events: tokens, or the final) into the event sequence. A final's
    own `text` is left out, as the live path (gateway.requests) leaves it out."""
    if isinstance(ev, TokEvent):
        lp = [token_logprob(e).model_dump(exclude={"text_offset"}) for e in ev.logprobs] if ev.logprobs else None
        return events.text(ev.text or "", lp)
    if isinstance(ev, ErrEvent):
        return events.finish("error", error={"code": ev.code, "message": ev.message})
    u = ev.usage
    return events.finish(ev.finish_reason or "stop", prompt_tokens=u.prompt_tokens if u else 0,
                         completion_tokens=u.completion_tokens if u else 0, cached_tokens=u.cached_tokens if u else 0)


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, submitter: Submitter, ttl_s: int):
        self.redis, self.keys, self.submitter, self.ttl_s = redis, keys, submitter, ttl_s

    async def save(self, s: Stored) -> None:
        key = self.keys.response(s.hex)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"key": s.key_id, "base": json.dumps(s.base), "conv": json.dumps(s.conversation),
                                    "input": json.dumps(s.input), "mode": s.mode or "",
                                    "lp": "1" if s.logprobs else ""})
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def load(self, resp_id: str, key_id: str) -> Stored | None:
        """The stored response `resp_id` if `key_id` made it (None otherwise: no hint it exists)."""
        if not resp_id.startswith(PREFIX):
            return None
        hex_id = resp_id[len(PREFIX):]
        raw = await self.redis.hgetall(self.keys.response(hex_id))
        data = {as_str(k): as_str(v) for k, v in raw.items()}
        if not data or not may_resume(data.get("key"), key_id):     # (anonymous: any anonymous client)
            return None
        return Stored(hex=hex_id, key_id=data["key"], base=json.loads(data["base"]),
                      conversation=json.loads(data["conv"]),
                      input=json.loads(data["input"]), mode=data.get("mode") or None, logprobs=bool(data.get("lp")),
                      final=json.loads(data["final"]) if data.get("final") else None,
                      cancelled=bool(data.get("cancelled")))

    async def delete(self, s: Stored) -> None:
        await self.redis.delete(self.keys.response(s.hex))

    async def save_final(self, s: Stored, response: dict) -> None:
        s.final = response
        await self.redis.hset(self.keys.response(s.hex), "final", json.dumps(response))

    async def current(self, s: Stored) -> dict:
        """The response as it stands: from its history and meta, unless already stored finished."""
        if s.final is not None:
            return s.final
        events = s.events()
        events.start()
        history = await self.submitter.read_history(s.hex, 0)
        for ev in history:
            feed(events, ev)
            if events.ended:
                await self.save_final(s, events.response())
                return s.final
        response = events.response()
        meta = await self.submitter.lookup(s.hex)
        if s.cancelled:
            response["status"] = "cancelled"     # cancelled before a worker took it: no worker writes its end
        elif meta is None:
            response["status"] = "failed"
            response["error"] = {"code": "output_lost", "message": "the response's output is no longer retained"}
        elif not history and not meta.get(META_EPOCH):
            response["status"] = "queued"        # no worker has taken it yet
        return response

    async def cancel(self, s: Stored) -> None:
        """Stop it as every cancel does (the flag, and a cancel to the owning worker)."""
        s.cancelled = True
        await self.redis.hset(self.keys.response(s.hex), "cancelled", "1")
        await self.submitter.cancel(s.hex)

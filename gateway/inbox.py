"""This gateway's inbox: ONE XREAD BLOCK loop on one key, dispatching live events by request id.

Workers append every live event of the requests this gateway serves to `p:{g:<gw>}:inbox`
(many requests' events in one entry, a msgpack list), so the read's cost grows with event
batches, not with the number of open streams: no key list to build, no CLIENT UNBLOCK when a
stream starts, one decode per batch. The per-request history `p:{r:<rid>}:out` is only read on
resume (gateway.resume).

Each event goes to the subscriber registered for its `rid` through a synchronous callback that
only buffers (it never awaits), so one slow socket cannot stall the loop. What of it reaches the
client (order, duplicates, stale writers' epochs, holes) is the request's join's business
(gateway.stream_join), not the reader's.

The read position is an explicit entry id, kept across reconnects: after a Redis restart (AOF)
the loop re-reads from where it stopped, so nothing written while it was away is missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.aio import cancel_and_wait
from shared.events import Event, decode_events
from shared.streams import ENTRY_FIELD, as_str
from shared.logs import rid_of

log = logging.getLogger("gateway.inbox")

EventCallback = Callable[[Event], None]


class Subscriber:
    """The receiving end of one request's live events on this gateway."""
    __slots__ = ("rid", "callback", "on_taken", "closed")

    def __init__(self, rid: str, callback: EventCallback, on_taken: Callable[[], None] | None = None):
        self.rid = rid
        self.callback = callback
        self.on_taken = on_taken    # told when another session of this gateway takes the request over
        self.closed = False


class Inbox:
    def __init__(self, redis: aioredis.Redis, key: str, *, block_ms: int = 2000, count: int = 256,
                 on_unclaimed: EventCallback | None = None):
        self.redis = redis          # a dedicated client: it sits in XREAD BLOCK
        self.key = key
        self.block_ms = block_ms
        self.count = count
        self._subs: dict[str, Subscriber] = {}
        # events of requests no session here subscribes to (a cancelled request whose client
        # left: gateway.request_log.CancelWatch); never called for a subscribed request
        self.on_unclaimed = on_unclaimed
        self._last_id = f"{int(time.time() * 1000)}-0"
        self._task: asyncio.Task | None = None
        self.healthy = False
        self.events_delivered = 0
        self.batches = 0

    @property
    def active_streams(self) -> int:
        return len(self._subs)

    def subscribe(self, rid: str, callback: EventCallback, on_taken: Callable[[], None] | None = None) -> Subscriber:
        """Route rid's live events to `callback` from now on; a previous subscriber (an older
        socket of a client that resumed on this same replica) is closed, told (`on_taken`), and
        gets nothing more."""
        old = self._subs.get(rid)
        sub = Subscriber(rid, callback, on_taken)
        self._subs[rid] = sub
        if old is not None:
            old.closed = True
            if old.on_taken is not None:
                old.on_taken()
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.closed = True
        if self._subs.get(sub.rid) is sub:
            del self._subs[sub.rid]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="inbox-reader")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                # a short first read (and after an error) marks the reader healthy at once
                block = self.block_ms if self.healthy else 1
                reply = await self.redis.xread({self.key: self._last_id}, count=self.count, block=block)
                self.healthy = True
                backoff = 0.05
                for _key, entries in reply or ():
                    for entry_id, fields in entries:
                        self._last_id = as_str(entry_id)
                        self._deliver(fields.get(ENTRY_FIELD) or fields.get(ENTRY_FIELD.decode()))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.healthy = False
                log.warning("inbox reader: %s; retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except Exception:  # a bug here must not silently stop every stream
                log.exception("inbox reader crashed; restarting")
                await asyncio.sleep(0.1)

    def _deliver(self, raw: bytes | None) -> None:
        self.batches += 1
        try:
            events = decode_events(raw) if raw else []
        except Exception:
            log.error("undecodable inbox entry on %s", self.key)
            return
        for ev in events:
            sub = self._subs.get(ev.rid)
            if sub is None or sub.closed:
                if self.on_unclaimed is not None:
                    try:
                        self.on_unclaimed(ev)
                    except Exception:
                        log.exception("unclaimed-event callback failed")
                continue
            self.events_delivered += 1
            try:
                sub.callback(ev)
            except Exception:
                log.exception("inbox callback failed for %s", sub.rid, extra=rid_of(sub.rid))

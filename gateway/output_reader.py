"""One XREAD BLOCK loop per gateway process, fanning output events out to subscribers.

A connection per request would cost a Redis connection and a blocked client per stream; a
single reader blocks on all active `{p}:out:{rid}` streams at once (like redis-py's pubsub
worker, but for streams) and hands each event to the subscriber's callback, which only buffers
and never awaits, so one slow socket can never stall the reader.

When a new stream is subscribed while the reader is blocked on the old key set, the reader is
woken with `CLIENT UNBLOCK` on its dedicated connection (the reply is then a timeout, and the
next XREAD includes the new key) instead of polling with a short block, which would add up to
the block time to every new request's TTFT.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.streams import ENTRY_FIELD, as_str, decode_event

log = logging.getLogger("gateway.output")

EventCallback = Callable[[str, dict], None]   # (stream entry id, event)


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    __slots__ = ("key", "callback", "last_id", "closed")

    def __init__(self, key: str, callback: EventCallback, last_id: str):
        self.key = key
        self.callback = callback
        self.last_id = last_id
        self.closed = False


class OutputReader:
    def __init__(self, redis_url: str, *, block_ms: int = 5000, count: int = 512):
        # A dedicated single connection: it sits in XREAD BLOCK, and CLIENT UNBLOCK needs its id.
        # Its read timeout must outlast the BLOCK time, or every idle XREAD ends in a timeout.
        self.redis = aioredis.from_url(redis_url, single_connection_client=True,
                                       socket_timeout=block_ms / 1000 + 10)
        self.control = aioredis.from_url(redis_url)
        self.block_ms = block_ms
        self.count = count
        self._subs: dict[str, set[Subscription]] = {}
        self._client_id: int | None = None
        self._blocked = False
        self._unblock_sent = False
        self._generation = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.healthy = False
        self.events_delivered = 0

    @property
    def active_streams(self) -> int:
        return len(self._subs)

    def subscribe(self, key: str, callback: EventCallback, after_id: str = "0-0") -> Subscription:
        sub = Subscription(key, callback, after_id)
        self._subs.setdefault(key, set()).add(sub)
        self._wake()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.closed = True
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]

    def _wake(self) -> None:
        self._changed.set()
        if self._blocked and not self._unblock_sent and self._client_id is not None:
            self._unblock_sent = True
            asyncio.get_running_loop().create_task(self._unblock(self._client_id, self._generation))

    async def _unblock(self, client_id: int, generation: int) -> None:
        # The XREAD may not have reached Redis yet (it goes over another connection): then
        # CLIENT UNBLOCK answers 0 and is retried until that same XREAD is really blocked.
        for _ in range(200):
            try:
                if await self.control.client_unblock(client_id):
                    return
            except RedisError as exc:
                log.warning("CLIENT UNBLOCK failed: %s", exc)
                return
            if not self._blocked or self._generation != generation:
                return
            await asyncio.sleep(0.001)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="output-reader")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.redis.aclose()
        await self.control.aclose()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._client_id is None:
                    self._client_id = int(await self.redis.client_id())
                self.healthy = True
                if not self._subs:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                streams = {key: min((s.last_id for s in subs), key=_id_tuple)
                           for key, subs in self._subs.items()}
                self._generation += 1
                self._blocked, self._unblock_sent = True, False
                try:
                    reply = await self.redis.xread(streams, count=self.count, block=self.block_ms)
                finally:
                    self._blocked = False
                backoff = 0.05
                for raw_key, entries in reply or ():
                    self._deliver(as_str(raw_key), entries)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.healthy = False
                self._client_id = None    # a reconnect gets a new client id
                log.warning("output reader: %s; retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug here must not silently stop every stream
                log.exception("output reader crashed; restarting")
                await asyncio.sleep(0.1)

    def _deliver(self, key: str, entries: list) -> None:
        subs = list(self._subs.get(key, ()))
        for entry_id, fields in entries:
            eid = as_str(entry_id)
            raw = fields.get(ENTRY_FIELD) or fields.get(ENTRY_FIELD.decode())
            try:
                event = decode_event(raw)
            except Exception:
                log.error("undecodable output event on %s/%s", key, eid)
                event = None
            tid = _id_tuple(eid)
            for sub in subs:
                if sub.closed or _id_tuple(sub.last_id) >= tid:
                    continue
                sub.last_id = eid
                if event is not None:
                    self.events_delivered += 1
                    try:
                        sub.callback(eid, event)
                    except Exception:
                        log.exception("output callback failed for %s", key)

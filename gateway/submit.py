"""Everything the gateway writes to Redis about a request: submit, cancel, attach, orphan.

* submit: XADD the `RequestEntry` to `{p}:requests` (approximate MAXLEN, so trimming is cheap),
  plus the alias `{p}:alias:{key}:{id}` -> rid so a `resume` can find it from any replica.
* cancel: the worker that owns a request reads its own `{p}:ctl:{worker}` stream between decode
  steps, so a cancel is routed there (owner read from `{p}:owner:{rid}`). The flag
  `{p}:cancelled:{rid}` is always set too: it covers a request not yet claimed, or one being
  re-claimed by another worker after a failover.
* attach epoch `{p}:gw:attach:{rid}`: incremented by every socket that (re)attaches to a request.
  A dropped socket parks its requests in the zset `{p}:gw:orphans` as "rid|epoch" with a
  deadline; whichever replica's sweeper pops it first cancels it only if nobody re-attached
  meanwhile (epoch unchanged). This makes the resume grace work across replicas and survive
  the replica that parked it exiting.
"""

from __future__ import annotations

import time

import msgpack
import redis.asyncio as aioredis

from shared.protocol import PROTOCOL_VERSION
from shared.streams import ENTRY_FIELD, Keys, RequestEntry

CTL_MAXLEN = 10000


def encode_control(kind: str, rid: str) -> bytes:
    """A control entry on `{p}:ctl:{worker}` (field `d`): {"v": 1, "k": "cancel", "rid": rid}."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "rid": rid}, use_bin_type=True)


class Submitter:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, request_maxlen: int, output_ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.request_maxlen = request_maxlen
        self.ttl = output_ttl_s

    def attach_key(self, rid: str) -> str:
        return f"{self.keys.prefix}:gw:attach:{rid}"

    @property
    def orphans_key(self) -> str:
        return f"{self.keys.prefix}:gw:orphans"

    async def submit(self, entry: RequestEntry, client_id: str) -> int:
        """Queue the request; returns its attach epoch (1)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.alias(entry.key_id, client_id), entry.rid, ex=self.ttl)
            pipe.set(self.attach_key(entry.rid), 1, ex=self.ttl)
            pipe.xadd(self.keys.requests, {ENTRY_FIELD: entry.encode()},
                      maxlen=self.request_maxlen, approximate=True)
            await pipe.execute()
        return 1

    async def lookup_alias(self, key_id: str, client_id: str) -> str | None:
        rid = await self.redis.get(self.keys.alias(key_id, client_id))
        return rid.decode() if rid is not None else None

    async def attach(self, rid: str) -> int:
        """A socket takes over a request (resume): bumps the epoch so parked orphans are spared."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(self.attach_key(rid))
            pipe.expire(self.attach_key(rid), self.ttl)
            epoch, _ = await pipe.execute()
        return int(epoch)

    async def cancel(self, rid: str) -> str | None:
        """Route a cancel to the owning worker (if any) and set the flag. Returns the owner."""
        owner = await self.redis.get(self.keys.owner(rid))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.cancelled(rid), 1, ex=self.ttl)
            if owner is not None:
                pipe.xadd(self.keys.ctl(owner.decode()), {ENTRY_FIELD: encode_control("cancel", rid)},
                          maxlen=CTL_MAXLEN, approximate=True)
            await pipe.execute()
        return owner.decode() if owner is not None else None

    async def park_orphans(self, items: list[tuple[str, int]], grace_s: float) -> None:
        if not items:
            return
        deadline = time.time() + grace_s
        await self.redis.zadd(self.orphans_key, {f"{rid}|{epoch}": deadline for rid, epoch in items})

    async def sweep_orphans(self, limit: int = 200) -> list[str]:
        """Cancel parked requests whose grace is over and that nobody re-attached. Returns them."""
        due = await self.redis.zrangebyscore(self.orphans_key, "-inf", time.time(), start=0, num=limit)
        cancelled = []
        for member in due:
            if not await self.redis.zrem(self.orphans_key, member):
                continue  # another replica took it
            rid, _, epoch = member.decode().rpartition("|")
            current = await self.redis.get(self.attach_key(rid))
            if current is not None and int(current) == int(epoch):
                await self.cancel(rid)
                cancelled.append(rid)
        return cancelled

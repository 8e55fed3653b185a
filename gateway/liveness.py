"""Gateway liveness: a heartbeat in `p:{reg}:gateways`, and taking over a dead gateway's requests.

A SIGKILLed gateway cannot park its own requests, so without this they would run to
completion with nobody listening, holding GPU time and per-key concurrency slots (issue 13
item 8). Every replica heartbeats (zset gw id -> last beat ms); the housekeeping loop of each
survivor looks for gateways silent longer than `gateway_ttl_s`. The first survivor whose ZREM
of the dead id succeeds owns the takeover: it parks every request in the dead gateway's
`p:{g:<gw>}:reqs` set that still points at it (meta.gw) as an orphan with the resume grace,
exactly as a clean socket close would, and lets its inbox and set expire shortly after (a
worker may still append a request's final event meanwhile). Silence during a Redis outage
(or a pause of our own) is not held against a peer: shared.peer_liveness gives every gateway a
fresh window when Redis comes back, so a Redis restart never parks a live gateway's streams.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.submit import Submitter
from shared.peer_liveness import PeerLiveness, server_run_id
from shared.streams import META_ATT, META_GW, Keys, as_str

log = logging.getLogger("gateway.liveness")

EXPIRE_AFTER_TAKEOVER_S = 60


class Liveness:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gw_id: str, submitter: Submitter, *, ttl_s: float,
                 grace_s: float):
        self.redis = redis
        self.keys = keys
        self.gw_id = gw_id
        self.submitter = submitter
        self.grace_s = grace_s
        self.peers = PeerLiveness(ttl_s, what="peer gateways")

    async def beat(self) -> None:
        try:
            await self.redis.zadd(self.keys.gateways, {self.gw_id: int(time.time() * 1000)})
        except (RedisError, OSError):
            self.peers.interrupted()
            raise

    async def leave(self) -> None:
        """Clean exit: our requests were parked by their sockets; the inbox goes soon."""
        await self.redis.zrem(self.keys.gateways, self.gw_id)
        await self._expire_inbox(self.gw_id)

    async def take_over_dead(self) -> dict[str, int]:
        """Park the requests of every gateway whose heartbeat is too old. Returns {gw: parked}."""
        try:
            sent_at = self.peers.clock()
            self.peers.observe(await server_run_id(self.redis, self.keys.gateways), sent_at)
            cutoff = self.peers.cutoff_ms()
            return {} if cutoff is None else await self._take_over_before(cutoff)
        except (RedisError, OSError):
            self.peers.interrupted()
            raise

    async def _take_over_before(self, cutoff: int) -> dict[str, int]:
        dead = await self.redis.zrangebyscore(self.keys.gateways, "-inf", cutoff)
        taken: dict[str, int] = {}
        for member in dead:
            gw = as_str(member)
            if gw == self.gw_id or not await self.redis.zrem(self.keys.gateways, member):
                continue  # ourselves (a long pause: just beat again), or another survivor took it
            taken[gw] = await self._park_requests_of(gw)
            log.warning("gateway %s is dead: parked %d of its requests for resume", gw, taken[gw])
        return taken

    async def _park_requests_of(self, gw: str) -> int:
        rids = [as_str(r) for r in await self.redis.smembers(self.keys.gw_reqs(gw))]
        if not rids:
            await self._expire_inbox(gw)
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.hmget(self.keys.meta(rid), [META_GW, META_ATT])
            metas = await pipe.execute()
        orphans = [(rid, int(att or 0)) for rid, (cur_gw, att) in zip(rids, metas)
                   if cur_gw is not None and as_str(cur_gw) == gw]   # not resumed elsewhere, not expired
        if self.grace_s > 0:
            await self.submitter.park_orphans(orphans, self.grace_s)
        else:
            for rid, _ in orphans:
                await self.submitter.cancel_orphan(rid)
        await self._expire_inbox(gw)
        return len(orphans)

    async def _expire_inbox(self, gw: str) -> None:
        ttl = int(self.grace_s) + EXPIRE_AFTER_TAKEOVER_S
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(self.keys.inbox(gw), ttl)
            pipe.expire(self.keys.gw_reqs(gw), ttl)
            await pipe.execute()

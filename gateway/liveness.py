"""Gateway liveness: a heartbeat in `p:{reg}:gateways`, and taking over a dead gateway's requests.

A SIGKILLed gateway cannot park its own requests, so without this they would run to
completion with nobody listening, holding GPU time and per-key concurrency slots (issue 13
item 8). Every replica heartbeats (zset gw id -> last beat ms); the housekeeping loop of each
survivor looks for gateways silent longer than `gateway_ttl_s`. The first survivor whose ZREM
of the dead id succeeds owns the takeover: it parks every request in the dead gateway's
`p:{g:<gw>}:reqs` set that still points at it (meta.gw) as an orphan with the resume grace,
exactly as a clean socket close would, deletes its set and lets its inbox expire shortly after
(a worker may still append a request's final event meanwhile). The set also carries a TTL of
its own (`reqs_ttl_s`, set with every SADD and refreshed by every heartbeat), so the set of a
gateway that no survivor ever takes over (the last replica killed, a deployment scaled to a
new set of gateways) goes by itself instead of staying in Redis for good. Silence during a Redis outage
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


def reqs_ttl_s(gateway_ttl_s: float, grace_s: float) -> int:
    """TTL of a gateway's `reqs` set: it must outlive the gateway by the time a survivor needs
    to declare it dead and read the set (gateway_ttl_s plus a sweep), with room to spare."""
    return int(gateway_ttl_s + grace_s) + EXPIRE_AFTER_TAKEOVER_S


class Liveness:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gw_id: str, submitter: Submitter, *, ttl_s: float,
                 grace_s: float):
        self.redis = redis
        self.keys = keys
        self.gw_id = gw_id
        self.submitter = submitter
        self.grace_s = grace_s
        self.peers = PeerLiveness(ttl_s, what="peer gateways")
        self.reqs_ttl_s = reqs_ttl_s(ttl_s, grace_s)

    async def beat(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zadd(self.keys.gateways, {self.gw_id: int(time.time() * 1000)})
                pipe.expire(self.keys.gw_reqs(self.gw_id), self.reqs_ttl_s)   # ours: gone with us
                await pipe.execute()
        except (RedisError, OSError):
            self.peers.interrupted()
            raise

    async def leave(self) -> None:
        """Clean exit: our requests were parked by their sockets; the inbox goes soon."""
        await self.redis.zrem(self.keys.gateways, self.gw_id)
        await self._forget_gateway(self.gw_id)

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
            await self._forget_gateway(gw)
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
            for rid, att in orphans:
                await self.submitter.cancel_orphan(rid, att)
        await self._forget_gateway(gw)
        return len(orphans)

    async def _forget_gateway(self, gw: str) -> None:
        """After `gw`'s requests are parked: its set has served (deleted), its inbox may still
        get a request's last events from a worker (expires)."""
        ttl = int(self.grace_s) + EXPIRE_AFTER_TAKEOVER_S
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(self.keys.inbox(gw), ttl)
            pipe.delete(self.keys.gw_reqs(gw))
            await pipe.execute()

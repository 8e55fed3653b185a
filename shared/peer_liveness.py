"""Judging peers dead from their heartbeats in Redis, without counting Redis's own outage, or
ours, against them.

Workers and gateways heartbeat into a zset (member -> wall-clock ms of the last beat) and a
survivor takes over the work of a peer whose beat is older than a TTL. A bare "score older
than TTL" test turns every Redis restart into a claim storm: while Redis is down nobody can
beat, so when it comes back (from its AOF, or as a promoted replica) every score is stale and
every survivor judges every peer dead at once, claims their requests and stalls their streams.

The rule here: a peer is dead when its last beat is older than the TTL *and* we have watched
Redis without interruption for at least one TTL, so a live peer has had a full window to beat
again. An interruption is anything that kept us from watching: a failed Redis call, a different
Redis server (its `run_id` changed: a restart or a failover), a round trip or a gap between our
own rounds longer than half the TTL (Redis stalled, or this process was paused or starved).
A peer that really died is therefore claimed one TTL after we could first have seen it beat:
the normal failover time, measured from when Redis is back.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("shared.peer_liveness")


async def server_run_id(redis, key: str) -> str:
    """`run_id` of the Redis server holding `key` (a new id = a restarted or promoted server).
    On a Redis Cluster, the node that owns `key`'s slot."""
    from redis.asyncio.cluster import RedisCluster
    if isinstance(redis, RedisCluster):
        info = await redis.info("server", target_nodes=redis.get_node_from_key(key))
    else:
        info = await redis.info("server")
    return str(info["run_id"])


class PeerLiveness:
    def __init__(self, ttl_s: float, *, what: str = "peers", clock=time.monotonic, wall=time.time):
        self.ttl_ms = int(ttl_s * 1000)
        self.what = what
        self.clock, self.wall = clock, wall     # (tests drive both)
        self.run_id: str | None = None
        # We only just started watching: every peer gets a full window first.
        self._watching_since = clock()
        self._last_round = self._watching_since
        self._interrupted = False

    def interrupted(self) -> None:
        """A Redis call of ours failed: whatever we read next may be stale."""
        self._interrupted = True

    def observe(self, run_id: str, sent_at: float) -> bool:
        """Record a successful round whose first call was sent at `sent_at` (on `clock`) and saw
        server `run_id`. Returns True when this is a different server than the last round saw
        (restarted or failed over)."""
        now = self.clock()
        half_ttl = self.ttl_ms / 2000
        new_server = self.run_id is not None and run_id != self.run_id
        reason = ("redis restarted or failed over" if new_server else
                  "redis was unreachable" if self._interrupted else
                  "redis answered slowly" if now - sent_at > half_ttl else
                  "our own rounds were late (paused or starved)" if sent_at - self._last_round > half_ttl else "")
        if reason:
            log.warning("%s: giving %s a fresh %.1f s heartbeat window before judging any dead",
                        reason, self.what, self.ttl_ms / 1000)
            self._watching_since = now
        self.run_id = run_id
        self._interrupted = False
        self._last_round = now
        return new_server

    def judging(self) -> bool:
        """Whether we have watched long enough (one TTL, uninterrupted) to call a peer dead."""
        return not self._interrupted and (self.clock() - self._watching_since) * 1000 >= self.ttl_ms

    def cutoff_ms(self) -> int | None:
        """Peers whose last beat (wall-clock ms) is at or below this are dead; None: judge
        nobody yet."""
        return int(self.wall() * 1000) - self.ttl_ms if self.judging() else None

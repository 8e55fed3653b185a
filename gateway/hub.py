"""Process-wide state of one gateway replica, shared by all its sockets.

Holds the Redis clients, the single output reader, the submitter, limits, admission, metrics,
the set of open connections, and one housekeeping loop (orphan sweep, concurrency-lease refresh,
slow-consumer watchdog). Nothing here is needed by another replica: losing the process loses
no request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.auth import KeyChecker, KeyLimits, OriginPolicy
from gateway.metrics import GatewayMetrics
from gateway.output_reader import OutputReader
from gateway.settings import GatewaySettings
from gateway.socket_caps import SocketCaps
from gateway.submit import Submitter
from shared.streams import Keys

if TYPE_CHECKING:
    from gateway.connection import Connection

log = logging.getLogger("gateway")


class Hub:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.keys = Keys(settings.stream_prefix)
        self.metrics = GatewayMetrics()
        self.key_checker = KeyChecker.from_settings(settings)
        self.origins = OriginPolicy(settings.allowed_origins)
        self.socket_caps = SocketCaps(per_key=settings.max_sockets_per_key, per_address=settings.max_sockets_per_address)
        self.connections: set[Connection] = set()
        self.draining = False
        self.redis: aioredis.Redis | None = None
        self.reader: OutputReader | None = None
        self._housekeeping: asyncio.Task | None = None

    async def start(self) -> None:
        s = self.settings
        # a bounded pool that waits for a free connection under bursts (the plain pool raises
        # "Too many connections" instead, which would turn a burst into client errors)
        pool = aioredis.BlockingConnectionPool.from_url(s.redis_url, max_connections=64, timeout=10,
                                                        health_check_interval=30)
        self.redis = aioredis.Redis(connection_pool=pool)
        self.reader = OutputReader(s.redis_url)
        self.submitter = Submitter(self.redis, self.keys, request_maxlen=s.request_stream_maxlen,
                                   output_ttl_s=s.output_ttl_s)
        self.limits = KeyLimits(self.redis, self.keys.prefix, concurrency=s.per_key_concurrency,
                                rate_per_min=s.per_key_rate_per_min, lease_s=s.concurrency_lease_s)
        self.admission = Admission(self.redis, self.keys, max_depth=s.max_queue_depth,
                                   worker_ttl_s=s.worker_ttl_s, cache_ms=s.admission_cache_ms)
        self.reader.start()
        self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep(), name="gateway-housekeeping")

    async def stop(self) -> None:
        if self._housekeeping:
            self._housekeeping.cancel()
            try:
                await self._housekeeping
            except asyncio.CancelledError:
                pass
        if self.reader:
            await self.reader.stop()
        if self.redis:
            await self.redis.aclose()

    async def ready(self) -> bool:
        try:
            return bool(await self.redis.ping()) and self.reader.healthy and not self.draining
        except (RedisError, OSError):
            return False

    async def drain(self, timeout: float = 5.0) -> None:
        """Tell every socket to reconnect elsewhere (SHUTTING_DOWN, close 1012) and wait for them.

        Their unfinished requests are parked as orphans with the resume grace, so the client can
        `resume` on another replica, and another replica's sweeper cancels them if it does not.
        """
        self.draining = True
        for conn in list(self.connections):
            conn.shut_down()
        deadline = time.monotonic() + timeout
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _housekeep(self) -> None:
        s = self.settings
        interval = max(0.05, min(s.sweep_interval_s, 1.0))
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.check_slow(now)
            try:
                cancelled = await self.submitter.sweep_orphans()
                if cancelled:
                    log.info("cancelled %d orphaned request(s) after the resume grace", len(cancelled))
                if now - last_refresh >= s.concurrency_lease_s / 3:
                    last_refresh = now
                    held: dict[str, list[str]] = {}
                    for conn in list(self.connections):
                        for key_id, rid in conn.held_slots():
                            held.setdefault(key_id, []).append(rid)
                    await self.limits.refresh(held)
            except (RedisError, OSError) as exc:
                log.warning("housekeeping: %s", exc)
            except Exception:
                log.exception("housekeeping failed")

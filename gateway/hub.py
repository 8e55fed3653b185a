"""Process-wide state of one gateway replica, shared by all its sockets.

Holds this replica's random id (`gw_id`: its inbox `p:{g:<gw_id>}:inbox` and liveness entry),
the Redis clients, the inbox reader, the submitter, admission, metrics, the set of open
connections, and one housekeeping loop (liveness heartbeat and takeover of dead gateways'
requests, orphan sweep, concurrency-lease refresh, slow-consumer watchdog). Nothing here is
needed by another replica: losing the process loses no request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import uuid

from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.auth import KeyChecker, OriginPolicy
from gateway.heartbeats import HeartbeatWheel
from gateway.inbox import Inbox
from gateway.liveness import Liveness
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.socket_caps import SocketCaps
from gateway.submit import Submitter
from shared.aio import cancel_and_wait
from shared.redis_client import connect
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
        # sockets whose sender task runs (something to send, a request in flight): the only
        # ones the slow-consumer and stall watchdogs need to look at; idle sockets cost nothing
        self.busy: set[Connection] = set()
        self.heartbeats = HeartbeatWheel(settings.heartbeat_s)
        self.draining = False
        self.gw_id = uuid.uuid4().hex[:16]      # random per process: a restart is a new gateway
        self.redis = None
        self.reader: Inbox | None = None
        self._reader_redis = None
        self._housekeeping: asyncio.Task | None = None

    async def start(self) -> None:
        s = self.settings
        self.redis = connect(s.redis_url, max_connections=64)
        # the inbox reader sits in XREAD BLOCK on its own connection; its read timeout outlasts the block
        self._reader_redis = connect(s.redis_url, socket_timeout=s.inbox_block_ms / 1000 + 10)
        self.reader = Inbox(self._reader_redis, self.keys.inbox(self.gw_id), block_ms=s.inbox_block_ms,
                            on_stale=self.metrics.stale_events.inc)
        self.submitter = Submitter(self.redis, self.keys, self.gw_id, request_maxlen=s.request_stream_maxlen,
                                   output_ttl_s=s.output_ttl_s, concurrency=s.per_key_concurrency,
                                   rate_per_min=s.per_key_rate_per_min, lease_s=s.concurrency_lease_s)
        self.liveness = Liveness(self.redis, self.keys, self.gw_id, self.submitter, ttl_s=s.gateway_ttl_s,
                                 grace_s=s.resume_grace_s)
        self.admission = Admission(self.redis, self.keys, max_depth=s.max_queue_depth,
                                   worker_ttl_s=s.worker_ttl_s, cache_ms=s.admission_cache_ms)
        try:
            await self.liveness.beat()
        except (RedisError, OSError) as exc:
            log.warning("first liveness beat failed (%s); housekeeping retries", exc)
        self.reader.start()
        self.heartbeats.start()
        self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep(), name="gateway-housekeeping")
        log.info("gateway %s started (inbox %s)", self.gw_id, self.keys.inbox(self.gw_id))

    async def stop(self) -> None:
        await self.heartbeats.stop()
        await cancel_and_wait(self._housekeeping)
        if self.reader:
            await self.reader.stop()
        if self.redis:
            try:
                await asyncio.wait_for(self.liveness.leave(), 2.0)
            except (RedisError, OSError, asyncio.TimeoutError):
                pass  # survivors take over after gateway_ttl_s
            await self.redis.aclose()
        if self._reader_redis:
            await self._reader_redis.aclose()

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
        interval = max(0.05, min(s.sweep_interval_s, 1.0, s.gateway_heartbeat_s))
        last_refresh = last_beat = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            stalled: list[str] = []
            for conn in list(self.busy):
                conn.check_slow(now)
                if s.request_stall_s > 0:
                    stalled += conn.end_stalled(now, s.request_stall_s)
            try:
                if stalled:
                    self.metrics.stalled.inc(len(stalled))
                    log.warning("ended %d request(s) with no progress for %gs", len(stalled), s.request_stall_s)
                    for rid in stalled:       # a worker that wakes up must not go on for nobody
                        await self.submitter.cancel_if_here(rid)
                if now - last_beat >= s.gateway_heartbeat_s:
                    last_beat = now
                    await self.liveness.beat()
                    for parked in (await self.liveness.take_over_dead()).values():
                        self.metrics.taken_over.inc(parked)
                cancelled = await self.submitter.sweep_orphans()
                if cancelled:
                    log.info("cancelled %d orphaned request(s) after the resume grace", len(cancelled))
                if now - last_refresh >= s.concurrency_lease_s / 3:
                    last_refresh = now
                    held: dict[str, list[str]] = {}
                    for conn in list(self.connections):
                        for key_id, rid in conn.held_slots():
                            held.setdefault(key_id, []).append(rid)
                    await self.submitter.refresh_leases(held)
            except (RedisError, OSError) as exc:
                log.warning("housekeeping: %s", exc)
            except Exception:
                log.exception("housekeeping failed")

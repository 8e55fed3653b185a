"""Redis connections for the worker, and the retry loop every Redis call path goes through.

redis-py's own `Retry(ExponentialBackoff)` rides out a single dropped connection inside one
command; `with_backoff` covers longer outages (a Redis restart takes seconds): it retries the
whole operation with capped exponential backoff and jitter until it succeeds or the worker
stops, so no loop ever dies on a connection error and nothing spins hot while Redis is down.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from shared.redis_client import connect as shared_connect

log = logging.getLogger("worker.redis")

T = TypeVar("T")

# Errors that mean "Redis is (temporarily) not there"; anything else is a real bug or bad data.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)

# Redis calls that failed, by kind (worker.metrics exports them): connection, timeout, loading
# (a restarted Redis still reading its AOF), refused (Redis answered with an error, e.g. OOM)
REDIS_ERRORS: dict[str, int] = {}


def count_error(exc: BaseException) -> None:
    kind = ("loading" if isinstance(exc, BusyLoadingError) else
            "timeout" if isinstance(exc, (RedisTimeoutError, TimeoutError)) else
            "connection" if isinstance(exc, TRANSIENT) else "refused")
    REDIS_ERRORS[kind] = REDIS_ERRORS.get(kind, 0) + 1


BLOCKING_READ_TIMEOUT_S = 11.0   # socket timeout of the blocking readers: beyond their BLOCK (1 s)


def connect(url: str, *, socket_timeout: float | None = 10.0):
    """A client (single node, or Redis Cluster for `redis+cluster://`) whose single commands
    survive a dropped connection (3 quick retries); see shared.redis_client."""
    return shared_connect(url, socket_timeout=socket_timeout)


@dataclass
class RedisClients:
    """The worker's clients (connections open on first use). The blocking readers have their
    own, so a read blocked for a second never holds up a claim, a heartbeat or a write."""
    main: Any        # claims, meta, registry, hand-back: short commands
    intake: Any      # XREADGROUP ... BLOCK on the request stream
    control: Any     # XREAD ... BLOCK on this worker's control stream
    output: Any      # the output writer's: no per-reply timeout (it bounds each round trip itself)

    @classmethod
    def connect(cls, url: str) -> "RedisClients":
        return cls(main=connect(url), intake=connect(url, socket_timeout=BLOCKING_READ_TIMEOUT_S),
                   control=connect(url, socket_timeout=BLOCKING_READ_TIMEOUT_S), output=connect(url, socket_timeout=None))

    async def aclose(self) -> None:
        for client in (self.main, self.intake, self.control, self.output):
            await client.aclose()


class Backoff:
    """Capped exponential backoff with full jitter (the AWS architecture-blog variant)."""

    def __init__(self, base: float = 0.05, cap: float = 2.0):
        self.base = base
        self.cap = cap
        self.failures = 0

    def reset(self) -> None:
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        return random.uniform(0, min(self.cap, self.base * 2 ** self.failures))


async def with_backoff(op: Callable[[], Awaitable[T]], what: str, stopping: Callable[[], bool] = lambda: False,
                       backoff: Backoff | None = None) -> T:
    """Run `op` until it succeeds; transient Redis errors are retried, others raised.
    Raises asyncio.CancelledError if `stopping()` turns true while Redis is down."""
    backoff = backoff or Backoff()
    while True:
        try:
            result = await op()
            if backoff.failures:
                log.warning("redis back after %d failed attempts (%s)", backoff.failures, what)
            backoff.reset()
            return result
        except TRANSIENT as exc:
            count_error(exc)
            if stopping():
                raise asyncio.CancelledError(f"stopping while redis is down ({what})") from exc
            delay = backoff.next_delay()
            if backoff.failures in (1, 5) or backoff.failures % 20 == 0:
                log.warning("redis unavailable during %s (%s: %s); retry %d in %.2fs",
                            what, type(exc).__name__, exc, backoff.failures, delay)
            await asyncio.sleep(delay)

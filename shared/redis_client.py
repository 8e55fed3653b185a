"""One place that turns REDIS_URL into an asyncio Redis client: a single node, or a Redis Cluster.

`redis://` / `rediss://` / `unix://` give a plain client. `redis+cluster://host:port` (or
`rediss+cluster://`) gives redis-py's `RedisCluster`, which learns the slot map from that seed
node and routes each command by its key's hash tag; every multi-key command, MULTI and Lua
script of this service touches one slot (shared/streams.py), so both clients run the same code.

Both retry a command once on a fresh connection after a connection error, so connections
pooled before a Redis restart are replaced on first use instead of failing a client's
request (issue 13 item 5). Retried commands are idempotent or made so (the submit script
checks the request's lease first; history ids are explicit).

Commands are packed by hiredis' C packer (`HiredisPacking`): redis-py's blocking client does
that when hiredis is installed, its asyncio client packs every argument in Python, which was a
quarter of a pipelined command's client CPU (bench/RESULTS.md, "Worker output path at GPU pace").
"""

from __future__ import annotations

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (BusyLoadingError, ConnectionError as RedisConnectionError, DataError,
                              TimeoutError as RedisTimeoutError)

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
RETRY_ON = [RedisConnectionError, RedisTimeoutError, BusyLoadingError]


class HiredisPacking:
    """Mixin for redis-py asyncio connections: pack commands with `hiredis.pack_command` (C)
    instead of redis-py's Python packer; same bytes on the wire (str as UTF-8, int and float
    as their repr), same DataError for what Redis cannot take."""

    def pack_command(self, *args) -> list[bytes]:
        if isinstance(args[0], str):  # "CLIENT SETNAME"-style names carry their subcommand
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a bytearray (which hiredis refuses), or what Redis cannot take
            args = tuple(bytes(a) if isinstance(a, bytearray) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:  # e.g. None or a bool, which redis-py refuses too
            raise DataError(f"cannot send {args[0]!r} with these arguments: {exc}") from None

    def pack_commands(self, commands) -> list[bytes]:
        return [b"".join(self.pack_command(*cmd)[0] for cmd in commands)]


class HiredisConnection(HiredisPacking, aioredis.Connection):
    pass


class HiredisSSLConnection(HiredisPacking, aioredis.SSLConnection):
    pass


class HiredisUnixConnection(HiredisPacking, aioredis.UnixDomainSocketConnection):
    pass


FAST_PACKING = {aioredis.Connection: HiredisConnection, aioredis.SSLConnection: HiredisSSLConnection,
                aioredis.UnixDomainSocketConnection: HiredisUnixConnection}


def _fast_packing(pool: aioredis.ConnectionPool) -> aioredis.ConnectionPool:
    """The pool's connection class (chosen by the URL's scheme) with hiredis packing."""
    pool.connection_class = FAST_PACKING.get(pool.connection_class, pool.connection_class)
    return pool


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def _plain_url(url: str) -> str:
    return url.replace("+cluster://", "://", 1)


def connect(url: str, *, socket_timeout: float | None = 10.0, max_connections: int | None = None,
            retries: int = 3) -> aioredis.Redis | RedisCluster:
    """A client whose single commands survive a dropped connection (`retries` quick retries)."""
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.02), retries)
    if is_cluster_url(url):
        kwargs = {"max_connections": max_connections} if max_connections else {}
        return RedisCluster.from_url(_plain_url(url), socket_timeout=socket_timeout, socket_connect_timeout=2.0,
                                     retry=retry, retry_on_error=RETRY_ON, **kwargs)
    if max_connections:
        # a bounded pool that waits for a free connection under bursts (the plain pool raises
        # "Too many connections" instead, which would turn a burst into client errors)
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=10, socket_timeout=socket_timeout,
            socket_connect_timeout=2.0, health_check_interval=15, retry=retry, retry_on_error=RETRY_ON)
        return aioredis.Redis(connection_pool=_fast_packing(pool))
    return aioredis.Redis.from_pool(_fast_packing(aioredis.ConnectionPool.from_url(
        url, socket_timeout=socket_timeout, socket_connect_timeout=2.0, health_check_interval=15, retry=retry,
        retry_on_error=RETRY_ON)))


def connect_sync(url: str):
    """A blocking client for the same URL (tests, scripts and operator tools)."""
    import redis
    from redis.cluster import RedisCluster as SyncRedisCluster
    if is_cluster_url(url):
        return SyncRedisCluster.from_url(_plain_url(url))
    return redis.Redis.from_url(url)

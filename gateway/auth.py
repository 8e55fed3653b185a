"""Who may use the gateway, and how much: API keys, Origin allow-list, per-key limits.

Keys are configured as `name:sha256hex` (`API_KEYS`), so the configuration and logs never hold a
usable secret; a presented key is hashed and compared in constant time. Browsers cannot set
headers on a WebSocket, so a key is accepted from `Authorization: Bearer`, `?api_key=`, or a
first `{type: "auth"}` message.

Limits live in Redis so every replica enforces the same numbers:
* rate: a fixed one-minute window per key (INCR + EXPIRE), the simplest counter that bounds
  bursts at 2x the rate across a window edge;
* concurrency: a sorted set of the key's active request ids scored by lease expiry, checked and
  added in one Lua script (atomic across replicas). Leases are refreshed while a request runs,
  so a crashed replica's slots free themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.errors import ErrorCode, ProtocolError

ANONYMOUS = "anon"


def anonymous_identity() -> str:
    """Each unauthenticated socket acts for its own identity ("anon:<random>"), so that one
    anonymous client's per-key limits, sockets and requests are never another's."""
    return f"{ANONYMOUS}:{secrets.token_hex(8)}"


def is_anonymous(key_id: str) -> bool:
    return key_id == ANONYMOUS or key_id.startswith(ANONYMOUS + ":")


def may_resume(owner_key: str | None, key_id: str) -> bool:
    """May `key_id` resume a request started by `owner_key` (the caller already presented the
    request's secret request_id)? The same API key may; an anonymous request may be resumed by any
    anonymous socket, since an anonymous client gets a new identity on every connection."""
    if owner_key is None:
        return False
    return owner_key == key_id or (is_anonymous(owner_key) and is_anonymous(key_id))

_ACQUIRE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[3])
  return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
return 1
"""


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def parse_key_list(spec: str) -> dict[str, str]:
    """'name:hex,name2:hex' -> {hex: name}. Raises ValueError on a malformed entry."""
    table: dict[str, str] = {}
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        name, sep, digest = item.rpartition(":")
        digest = digest.lower()
        if not sep or not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"API_KEYS entry {item!r} is not 'name:sha256hex'")
        if is_anonymous(name):
            raise ValueError(f"API_KEYS entry {item!r}: the name {ANONYMOUS!r} is reserved for anonymous clients")
        table[digest] = name
    return table


@dataclass
class KeyChecker:
    table: dict[str, str]
    required: bool

    @classmethod
    def from_settings(cls, settings) -> "KeyChecker":
        table = parse_key_list(settings.api_keys)
        return cls(table, required=bool(table) or settings.auth_required)

    def identify(self, api_key: str | None) -> str:
        """The key's name, a fresh anonymous identity when auth is off, or ProtocolError(UNAUTHORIZED)."""
        if not self.required:
            return self.identify_optional(api_key)
        if not api_key:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "an API key is required (Authorization: Bearer, "
                                                        "?api_key=, or a first {\"type\": \"auth\"} message)")
        name = self._lookup(api_key)
        if name is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "invalid API key")
        return name

    def identify_optional(self, api_key: str | None) -> str:
        return (self._lookup(api_key) if api_key else None) or anonymous_identity()

    def _lookup(self, api_key: str) -> str | None:
        digest = hash_key(api_key)
        found = None
        for known, name in self.table.items():  # constant time per entry, no early exit
            if hmac.compare_digest(known, digest):
                found = name
        return found


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class OriginPolicy:
    """Browsers always send Origin on a WebSocket; non-browser clients usually do not."""

    def __init__(self, spec: str):
        items = {o.strip().rstrip("/") for o in spec.split(",") if o.strip()}
        self.any = "*" in items
        self.allowed = items - {"*"}

    def check(self, origin: str | None, host: str | None) -> None:
        if origin is None or self.any:
            return
        origin = origin.rstrip("/")
        if origin in self.allowed:
            return
        # the gateway's own page (same origin) is always allowed
        if host and origin.split("://", 1)[-1] == host:
            return
        raise ProtocolError(ErrorCode.ORIGIN_NOT_ALLOWED, f"origin {origin!r} is not allowed")


class KeyLimits:
    def __init__(self, redis: aioredis.Redis, prefix: str, *, concurrency: int, rate_per_min: int, lease_s: float):
        self.redis = redis
        self.prefix = prefix
        self.concurrency = concurrency
        self.rate_per_min = rate_per_min
        self.lease_ms = int(lease_s * 1000)
        self._acquire = redis.register_script(_ACQUIRE)

    def _conc_key(self, key_id: str) -> str:
        return f"{self.prefix}:gw:conc:{key_id}"

    async def check_rate(self, key_id: str) -> None:
        if self.rate_per_min <= 0:
            return
        window = int(time.time() // 60)
        rkey = f"{self.prefix}:gw:rate:{key_id}:{window}"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(rkey)
            pipe.expire(rkey, 120)
            count, _ = await pipe.execute()
        if int(count) > self.rate_per_min:
            retry = 60 - int(time.time()) % 60
            raise ProtocolError(ErrorCode.RATE_LIMITED,
                                f"rate limit of {self.rate_per_min} requests/min reached; retry in {retry}s")

    async def acquire(self, key_id: str, rid: str) -> None:
        if self.concurrency <= 0:
            return
        ok = await self._acquire(keys=[self._conc_key(key_id)], args=[self.concurrency, self.lease_ms, rid])
        if not ok:
            raise ProtocolError(ErrorCode.CONCURRENCY_LIMIT,
                                f"{self.concurrency} requests of this key are already running")

    async def release(self, key_id: str, rid: str) -> None:
        if self.concurrency > 0:
            await self.redis.zrem(self._conc_key(key_id), rid)

    async def refresh(self, held: dict[str, list[str]]) -> None:
        """Extend the leases of requests still running on this replica."""
        if self.concurrency <= 0 or not held:
            return
        deadline = int(time.time() * 1000) + self.lease_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, rids in held.items():
                if rids:
                    pipe.zadd(self._conc_key(key_id), {rid: deadline for rid in rids}, xx=True)
                    pipe.pexpire(self._conc_key(key_id), self.lease_ms * 2)
            await pipe.execute()

"""Who may use the gateway: API keys and the Origin allow-list (per-key limits: gateway.submit).

Keys are configured as `name:sha256hex` (`API_KEYS`), so the configuration and logs never hold a
usable secret; a presented key is hashed and compared in constant time. Browsers cannot set
headers on a WebSocket, so a key is accepted from `Authorization: Bearer`, `?api_key=`, or a
first `{type: "auth"}` message.

The per-key limits live in Redis so every replica enforces the same numbers; they are checked
in the same Lua script that queues the request (gateway.submit): a fixed one-minute rate
window per key, and a concurrency lease per request held until the request ends.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

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

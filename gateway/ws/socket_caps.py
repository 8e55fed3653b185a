"""Caps on the sockets one API key and one client address may hold open on this replica.

A socket costs memory whether or not it streams (see docs/operations.md, "Idle sockets"), so an
unbounded number of them from one key or one address is a way to exhaust a replica. The counts
are per replica (a process-local dict, no Redis round trip on connect); with N replicas behind a
balancer the effective cap is up to N times the setting. Anonymous sockets have no key, so only
the address cap applies to them.
"""

from __future__ import annotations

from collections import Counter

from gateway.auth import is_anonymous
from shared.errors import ErrorCode, ProtocolError


class SocketCaps:
    def __init__(self, *, per_key: int, per_address: int):
        self.per_key = per_key
        self.per_address = per_address
        self.by_key: Counter[str] = Counter()
        self.by_address: Counter[str] = Counter()

    def open(self, address: str) -> "SocketClaim":
        if self.per_address > 0 and self.by_address[address] >= self.per_address:
            raise ProtocolError(ErrorCode.TOO_MANY_SOCKETS,
                                f"this address already holds {self.per_address} sockets on this server")
        self.by_address[address] += 1
        return SocketClaim(self, address)


class SocketClaim:
    """One socket's place in the counts; `close()` gives it back (idempotent)."""

    __slots__ = ("caps", "address", "key_id", "closed")

    def __init__(self, caps: SocketCaps, address: str):
        self.caps = caps
        self.address = address
        self.key_id: str | None = None
        self.closed = False

    def identify(self, key_id: str) -> None:
        """The socket now acts for `key_id`: count it there (or refuse it)."""
        if key_id == self.key_id:
            return
        if is_anonymous(key_id):
            self._release_key()
            return
        caps = self.caps
        if caps.per_key > 0 and caps.by_key[key_id] >= caps.per_key:
            raise ProtocolError(ErrorCode.TOO_MANY_SOCKETS,
                                f"this API key already holds {caps.per_key} sockets on this server")
        self._release_key()
        caps.by_key[key_id] += 1
        self.key_id = key_id

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._release_key()
        _decrement(self.caps.by_address, self.address)

    def _release_key(self) -> None:
        if self.key_id is not None:
            _decrement(self.caps.by_key, self.key_id)
            self.key_id = None


def _decrement(counter: Counter, name: str) -> None:
    counter[name] -= 1
    if counter[name] <= 0:
        del counter[name]

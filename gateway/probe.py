"""`GatewayProbe`: one documented window on a running gateway replica, for tests and operations.

Nothing on a request's path uses it. Tests reach a gateway through its public surfaces (the
WebSocket protocol, the HTTP API, `/metrics`) and, where those cannot show or provoke
something, through this object only, never through the gateway's parts: counts of open
sessions, requests and subscriptions; the Prometheus samples `/metrics` renders; `drain()`
(what SIGTERM starts); the worker snapshot routing uses; and fault injection (a submit
interceptor, an orphan-sweep interceptor, a failing send, dropped connections, the rate limit's
clock). The composition root
(gateway.hub) builds it; `app.state.probe` holds it and tests/stack_fixtures.py exposes it as
`InProcessGateway.probe`.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from gateway.inbox import Inbox
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sessions import DRAIN_TIMEOUT_S, Sessions
from gateway.submit import Submitter
from gateway.ws.socket_caps import SocketCaps

SubmitFn = Callable[..., Awaitable[str | None]]
OrphanCancelFn = Callable[..., Awaitable[bool]]


class GatewayProbe:
    def __init__(self, *, sessions: Sessions, metrics: GatewayMetrics, reader: Inbox, router: Router,
                 submitter: Submitter, socket_caps: SocketCaps, drain: Callable[[float], Awaitable[None]]):
        self._sessions = sessions
        self._metrics = metrics
        self._reader = reader
        self._router = router
        self._submitter = submitter
        self._socket_caps = socket_caps
        self._drain = drain

    # ---- what is open ---------------------------------------------------------------------

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample as `/metrics` shows it (e.g. `gateway_slow_consumer_closes_total`); 0 if absent."""
        return self._metrics.registry.get_sample_value(name, labels or None) or 0.0

    @property
    def sessions(self) -> int:
        """Open sessions: WebSockets and streaming HTTP responses."""
        return len(self._sessions.all)

    def requests(self) -> list[tuple[str, str]]:
        """(key id, request id) of every request open on this replica's sessions."""
        return [(r.key_id, r.rid) for session in list(self._sessions.all) for r in session.requests.values()]

    @property
    def subscriptions(self) -> int:
        """Request ids (or one-shot reply ids) the inbox reader routes to a subscriber."""
        return self._reader.active_streams

    def sockets_of_key(self, key_id: str) -> int:
        """WebSockets open under `key_id` (the MAX_SOCKETS_PER_KEY count)."""
        return self._socket_caps.by_key.get(key_id, 0)

    # ---- routing's view of the workers ------------------------------------------------------

    @property
    def routed_workers(self) -> list[str]:
        """The worker ids in the registry snapshot cache-aware routing picks from."""
        return [w.worker_id for w in self._router.workers]

    async def live_workers(self) -> list[str]:
        """The worker ids the gateway takes as live (refreshing its snapshot when it is old)."""
        return [w.worker_id for w in await self._router.live()]

    def keep_worker_snapshot(self, seconds: float = 3600) -> None:
        """Take the current registry snapshot as fresh for `seconds` (a worker that left stays listed)."""
        self._router.refreshed_at = time.monotonic() + seconds

    # ---- operations -------------------------------------------------------------------------

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """What SIGTERM starts: every session told to reconnect elsewhere, new work refused."""
        await self._drain(timeout)

    # ---- fault injection --------------------------------------------------------------------

    def intercept_submit(self, wrap: Callable[[SubmitFn], SubmitFn]) -> None:
        """Replace the submit round trip by `wrap(the real one)` (a slow reply, a gateway that dies)."""
        self._submitter.submit = wrap(self._submitter.submit)

    def intercept_orphan_cancel(self, wrap: Callable[[OrphanCancelFn], OrphanCancelFn]) -> None:
        """Replace the orphan sweep's cancel of one due orphan (`cancel_orphan(rid, att)`: the
        check that nobody resumed it and the cancel, one script) by `wrap(the real one)`: hold
        the sweep at the moment it decides (a resume landing just before or just after it)."""
        self._submitter.cancel_orphan = wrap(self._submitter.cancel_orphan)

    def set_rate_clock(self, clock: Callable[[], float]) -> None:
        """The wall clock whose minute is the per-key rate limit's window."""
        self._submitter.clock = clock

    def fail_next_send(self, exc: Exception) -> list:
        """The next send on any open session raises `exc` (once); returns the list that then
        holds what that send was given."""
        failed: list = []
        for session in list(self._sessions.all):
            writer = session.socket
            real = writer.send_payload

            async def broken_once(payload, real=real):
                if not failed:
                    failed.append(payload)
                    raise exc
                await real(payload)

            writer.send_payload = broken_once
        return failed

    def drop_connections(self) -> None:
        """Drop every session's connection at once (TCP abort: what a SIGKILL looks like to clients)."""
        for session in list(self._sessions.all):
            session.socket.abort()

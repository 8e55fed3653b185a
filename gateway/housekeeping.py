"""The gateway's periodic duties, each an independent task with its own interval.

One loop running every duty in one `try` let a failing duty (Redis refusing one command, a bug
in one watchdog) skip all the others for that tick. Here each `Duty` runs on its own: a failure
is logged, counted in `gateway_housekeeping_failures_total{duty=...}`, and that duty runs again
at its next interval; the others never notice.

The duties (`gateway_duties`), each over exactly the parts it needs:
* cancel_watch    log the cancelled requests whose final never came (request_log.CancelWatch);
* slow_consumers  close sessions whose send is stuck (the sender's slow-consumer watchdog);
* stalls          end requests without progress for REQUEST_STALL_S, and cancel them in Redis;
* liveness        this replica's heartbeat, and taking over dead gateways' requests;
* routing         the worker registry snapshot cache-aware routing picks from;
* backlog         the queue depth and live workers, for dashboards and alerts;
* orphans         cancel parked requests nobody resumed within the grace;
* leases          extend the concurrency leases of the requests this replica serves;
* batches         renew the leases of the batches this replica runs, claim free ones (gateway.batch.runner).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from redis.exceptions import RedisError

from gateway.liveness import Liveness
from gateway.metrics import GatewayMetrics
from gateway.request_log import CancelWatch
from gateway.router import Router
from gateway.sessions import Sessions
from gateway.settings import GatewaySettings
from gateway.submit import Submitter
from shared.aio import cancel_and_wait

log = logging.getLogger("gateway")

BACKLOG_METRICS_S = 5.0


@dataclass(frozen=True)
class Duty:
    name: str
    interval_s: float
    run: Callable[[float], Awaitable[None] | None]     # called with time.monotonic()
    first_after_s: float | None = None                  # the first run (default: one interval) after start


class Housekeeping:
    def __init__(self, duties: list[Duty], metrics: GatewayMetrics):
        self.duties = duties
        self.metrics = metrics
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop(d), name=f"gateway-housekeeping-{d.name}") for d in self.duties]

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []

    async def _loop(self, duty: Duty) -> None:
        await asyncio.sleep(duty.interval_s if duty.first_after_s is None else duty.first_after_s)
        while True:
            await self.run_once(duty)
            await asyncio.sleep(duty.interval_s)

    async def run_once(self, duty: Duty) -> None:
        """One run of `duty`; a failure is logged and counted, never raised."""
        try:
            result = duty.run(time.monotonic())
            if inspect.isawaitable(result):
                await result
        except (RedisError, OSError) as exc:
            self.metrics.housekeeping_failures.labels(duty.name).inc()
            log.warning("housekeeping (%s): %s", duty.name, exc)
        except Exception:
            self.metrics.housekeeping_failures.labels(duty.name).inc()
            log.exception("housekeeping (%s) failed", duty.name)


def gateway_duties(s: GatewaySettings, *, sessions: Sessions, cancel_watch: CancelWatch, submitter: Submitter,
                   liveness: Liveness, router: Router, metrics: GatewayMetrics,
                   read_backlog: Callable[[], Awaitable[None]],
                   batches: Callable[[float], Awaitable[None]] | None = None) -> list[Duty]:
    """The gateway's duties and their intervals (the module docstring lists them)."""
    tick = max(0.05, min(s.sweep_interval_s, 1.0, s.gateway_heartbeat_s))

    def slow_consumers(now: float) -> None:
        for conn in list(sessions.busy):
            conn.check_slow(now)

    async def stalls(now: float) -> None:
        stalled: list[str] = []
        for conn in list(sessions.busy):
            stalled += conn.end_stalled(now, s.request_stall_s)
        if stalled:
            metrics.stalled.inc(len(stalled))
            log.warning("ended %d request(s) with no progress for %gs", len(stalled), s.request_stall_s)
            for rid in stalled:       # a worker that wakes up must not go on for nobody
                if await submitter.cancel_if_here(rid):
                    metrics.cancels.labels("stall").inc()

    async def beat(now: float) -> None:
        await liveness.beat()
        for parked in (await liveness.take_over_dead()).values():
            metrics.taken_over.inc(parked)

    async def route(now: float) -> None:
        if router.due(now):
            await router.refresh()

    async def orphans(now: float) -> None:
        cancelled = await submitter.sweep_orphans()
        if cancelled:
            metrics.cancels.labels("orphan").inc(len(cancelled))
            log.info("cancelled %d orphaned request(s) after the resume grace", len(cancelled))

    async def leases(now: float) -> None:
        held: dict[str, list[str]] = {}
        for conn in list(sessions.all):
            for key_id, rid in conn.held_slots():
                held.setdefault(key_id, []).append(rid)
        await submitter.refresh_leases(held)

    duties = [
        Duty("cancel_watch", tick, cancel_watch.expire),
        Duty("slow_consumers", tick, slow_consumers),
        Duty("liveness", s.gateway_heartbeat_s, beat),      # the first beat is at start
        Duty("routing", tick, route),
        Duty("backlog", BACKLOG_METRICS_S, lambda now: read_backlog(), first_after_s=tick),
        Duty("orphans", tick, orphans),
        Duty("leases", s.concurrency_lease_s / 3, leases),
    ]
    if batches is not None:
        duties.append(Duty("batches", tick, batches))
    if s.request_stall_s > 0:
        duties.insert(2, Duty("stalls", tick, stalls))
    return duties

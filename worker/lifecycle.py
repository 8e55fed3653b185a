"""A worker's life: registry heartbeat, graceful drain, hand back, and loops that never die.

Why its own module: what happens on SIGTERM, when the engine dies, or when a loop hits an
unexpected error is one policy, and it is here rather than spread over the I/O loops.

SIGTERM: intake and claiming stop, running requests get `shutdown_grace_s` to finish, the
rest are handed back (cancelled here, their tokens so far written, then XCLAIMed to ourselves
with a huge IDLE so the next XAUTOCLAIM elsewhere takes them at once and continues them).
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared.config import Settings
from shared.streams import Keys
from worker import registry
from worker.engine_client import Cancel, EngineClient
from worker.inflight import InFlightTable, Stats
from worker.intake import Intake
from worker.intake.forwarding import VIEW_REFRESH_S
from worker.leases import Leases
from worker.output_writer import OutputWriter
from worker.redis_io import TRANSIENT, Backoff, with_backoff

log = logging.getLogger("worker.lifecycle")

VIEW_MARGIN_S = 0.2    # beyond a peer's view refresh interval: its round's own time


class Lifecycle:
    def __init__(self, *, redis, keys: Keys, settings: Settings, worker_id: str, table: InFlightTable,
                 engine: EngineClient, writer: OutputWriter, intake: Intake, leases: Leases, stats: Stats,
                 stop: asyncio.Event, model_name: str = ""):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.table = table
        self.engine = engine
        self.writer = writer
        self.intake = intake
        self.leases = leases
        self.stats = stats
        self.stop = stop
        self.model_name = model_name
        self.started_ms = int(time.time() * 1000)
        self.grace_s = settings.shutdown_grace_s   # 0 once the engine died: nothing left to wait for
        self.fatal = False                         # the engine died: exit non-zero

    def stopping(self) -> bool:
        return self.stop.is_set()

    def request_stop(self) -> None:
        self.stop.set()
        self.table.wake()

    async def supervised(self, name: str, loop_fn) -> None:
        """Run a loop forever: transient Redis errors are retried inside it; anything else
        (e.g. NOGROUP after Redis lost its data, OOM) is logged and the loop restarted, so no
        part of the worker silently stops."""
        while True:
            try:
                await loop_fn()
                if self.stopping():
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s loop failed; restarting it in 1 s", name)
                await asyncio.sleep(1.0)
                try:
                    await self.intake.ensure_group()
                except Exception:
                    pass

    # ---- registry ---------------------------------------------------------------------------

    def registry_fields(self) -> dict:
        e, unhealthy = self.engine, self.table.unhealthy
        return registry.registry_fields(
            capacity=self.table.capacity, running=e.running, waiting=e.waiting, in_flight=self.table.running_count(),
            kv_used=e.kv_used, kv_total=e.kv_total, model=self.model_name, started_ms=self.started_ms,
            steps=e.steps, state="draining" if self.stopping() else "unhealthy" if unhealthy else "ready",
            reason=unhealthy, preemptions=e.preemptions, fenced=self.writer.stats["fenced"],
            dropped=self.stats.dropped, yielded=self.stats.yielded)

    async def heartbeat_once(self) -> None:
        await registry.heartbeat(self.redis, self.keys, self.worker_id, self.registry_fields(),
                                 self.settings.worker_ttl_s)

    async def heartbeat_loop(self) -> None:
        interval = self.settings.worker_heartbeat_s
        while True:
            await asyncio.sleep(interval)
            if not self.engine.is_alive() and not self.stopping():
                # never advertise capacity we cannot serve: hand everything back and exit non-zero
                log.critical("the engine died; handing back %d requests and exiting", len(self.table))
                self.fatal = True
                self.grace_s = 0.0
                self.request_stop()
                return
            # retried at the heartbeat's own pace during an outage (the same load on Redis as
            # beating), so a restarted Redis sees us beat within one interval: peers give us a
            # window of one worker TTL from when they see Redis back (shared.peer_liveness)
            await with_backoff(self.heartbeat_once, "heartbeat", backoff=Backoff(cap=interval))

    # ---- stopping ---------------------------------------------------------------------------

    async def drain(self) -> None:
        """Graceful stop: finish what runs within the grace period, hand back the rest."""
        deadline = time.monotonic() + self.grace_s
        announced = await self._announce_draining()
        while self.table.running_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        running = [st.rid for st in self.table.running()]
        if running:
            await self.hand_back(running)
        try:   # entries we were waiting on (another worker's lease): claimable by others at once
            await asyncio.wait_for(self.intake.release_contested(), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not give back the entries we were waiting on (redis down)")
        await self._flush("write the last outputs")
        await self._let_routing_views_catch_up(announced)
        try:
            await asyncio.wait_for(with_backoff(lambda: registry.deregister(self.redis, self.keys, self.worker_id),
                                                "deregister"), 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not deregister (redis down); the registry entry expires by itself")

    async def _announce_draining(self) -> float:
        """Beat now with state "draining" (no free slots), not at the next interval: peers stop
        handing routed entries to us from their next view of the registry. When it was sent."""
        sent = time.monotonic()
        try:
            await asyncio.wait_for(self.heartbeat_once(), 2)
        except (asyncio.TimeoutError, *TRANSIENT):
            log.warning("could not announce the drain (redis down); peers see it at the next beat")
        return sent

    async def _let_routing_views_catch_up(self, announced: float) -> None:
        """Stay (our control loop handing back whatever is forwarded to us) until every peer's
        routing view, read every VIEW_REFRESH_S, shows us draining: an entry a peer forwards to
        a worker that has exited waits claim_idle_ms. Only where there are peers, and only the
        part of that window the drain has not already taken."""
        if self.intake.knows_peers():
            left = announced + VIEW_REFRESH_S + VIEW_MARGIN_S - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)

    async def release_leftovers(self) -> None:
        """The last step of a stop, once keep-fresh and the control loop have ended (nothing of
        ours claims an entry back any more): what is still pending under us (handed to us after
        our control loop stopped, or whose idle time a keep-fresh round reset while it crossed
        a hand back) becomes claimable by others at once, instead of after claim_idle_ms."""
        try:
            left = await asyncio.wait_for(self.leases.pending_ids(), 5)
        except (asyncio.TimeoutError, *TRANSIENT):
            return
        if left:
            log.warning("%d entries still pending under us at exit: handing them back", len(left))
            await self.leases.hand_back(left)

    async def _flush(self, what: str) -> None:
        try:
            await asyncio.wait_for(with_backoff(lambda: self.writer.flush_all(self.engine.take_outputs,
                                                                              self.table.view), what), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not %s (redis down)", what)

    async def hand_back(self, rids: list[str]) -> None:
        """Stop running `rids` here and make them claimable by another worker right away."""
        engine = self.engine
        for rid in rids:
            engine.submit(Cancel(rid, silent=True))
        # let the engine apply the cancels, then write the tokens it produced before them, so
        # the next worker's skip count includes every delivered token
        deadline = time.monotonic() + 5
        while (engine.is_alive() and (engine.running or engine.waiting)
               and time.monotonic() < deadline):   # a dead engine's last figures never change
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        await self._flush("write outputs before handing back")
        states = self.table.remove(rids)
        if not states:
            return
        await self.leases.hand_back([st.entry_id for st in states], states)
        log.info("handed back %d requests: %s", len(states), [st.rid for st in states])

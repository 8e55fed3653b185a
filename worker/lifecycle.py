"""A worker's life: registry heartbeat, graceful drain, hand back, and loops that never die.

Why its own module: what happens on SIGTERM, when the engine thread dies, or when a loop hits
an unexpected error is one policy, and it is here rather than spread over the I/O loops.

SIGTERM: intake and claiming stop, running requests get `shutdown_grace_s` to finish, the
rest are handed back (cancelled here, their tokens so far written, then XCLAIMed to ourselves
with a huge IDLE so the next XAUTOCLAIM elsewhere takes them at once and replays them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from shared.streams import CONSUMER_GROUP, META_OWNER
from worker import registry
from worker.engine_thread import Cancel
from worker.redis_io import Backoff, with_backoff

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger("worker.lifecycle")


class Lifecycle:
    def __init__(self, svc: "WorkerService"):
        self.svc = svc

    async def supervised(self, name: str, loop_fn) -> None:
        """Run a loop forever: transient Redis errors are retried inside it; anything else
        (e.g. NOGROUP after Redis lost its data, OOM) is logged and the loop restarted, so no
        part of the worker silently stops."""
        while True:
            try:
                await loop_fn()
                if self.svc.stopping:
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s loop failed; restarting it in 1 s", name)
                await asyncio.sleep(1.0)
                try:
                    await self.svc.intake.ensure_group()
                except Exception:
                    pass

    # ---- registry ---------------------------------------------------------------------------

    async def heartbeat_once(self) -> None:
        svc = self.svc
        await registry.heartbeat(svc.redis, svc.keys, svc.worker_id, svc.registry_fields(),
                                 svc.settings.worker_ttl_s)

    async def heartbeat_loop(self) -> None:
        svc = self.svc
        while True:
            await asyncio.sleep(svc.settings.worker_heartbeat_s)
            if not svc.thread.is_alive() and not svc.stopping:
                # never advertise capacity we cannot serve: hand everything back and exit non-zero
                log.critical("the engine died; handing back %d requests and exiting", len(svc.inflight))
                svc.fatal = True
                svc.settings = svc.settings.model_copy(update={"shutdown_grace_s": 0.0})
                svc.request_stop()
                return
            # retried at the heartbeat's own pace during an outage (the same load on Redis as
            # beating), so a restarted Redis sees us beat within one interval: peers give us a
            # window of one worker TTL from when they see Redis back (shared.peer_liveness)
            await with_backoff(self.heartbeat_once, "heartbeat", backoff=Backoff(cap=svc.settings.worker_heartbeat_s))

    # ---- stopping ---------------------------------------------------------------------------

    async def drain(self) -> None:
        """Graceful stop: finish what runs within the grace period, hand back the rest."""
        svc = self.svc
        deadline = time.monotonic() + svc.settings.shutdown_grace_s
        while svc.running_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        running = [rid for rid, st in svc.inflight.items() if not st.engine_done]
        if running:
            await self.hand_back(running)
        await self._flush("write the last outputs")
        try:
            await asyncio.wait_for(with_backoff(lambda: registry.deregister(svc.redis, svc.keys, svc.worker_id),
                                                "deregister"), 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not deregister (redis down); the registry entry expires by itself")

    async def _flush(self, what: str) -> None:
        svc = self.svc
        try:
            await asyncio.wait_for(with_backoff(lambda: svc.writer.flush_all(svc.thread.take_outputs, svc.inflight),
                                                what), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not %s (redis down)", what)

    async def hand_back(self, rids: list[str]) -> None:
        """Stop running `rids` here and make them claimable by another worker right away."""
        svc = self.svc
        for rid in rids:
            svc.thread.submit(Cancel(rid, silent=True))
        # let the engine apply the cancels, then write the tokens it produced before them, so
        # the next worker's skip count includes every delivered token
        deadline = time.monotonic() + 5
        while (svc.thread.is_alive() and (svc.thread.running or svc.thread.waiting)
               and time.monotonic() < deadline):   # a dead engine's last figures never change
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        await self._flush("write outputs before handing back")
        states = [svc.inflight.pop(rid) for rid in rids if rid in svc.inflight]
        if not states:
            return
        await self.release_entries([st.entry_id for st in states], [st.rid for st in states])
        log.info("handed back %d requests: %s", len(states), [st.rid for st in states])

    async def release_entries(self, entry_ids: list[str], rids: list[str] = ()) -> None:
        """Make entries we hold claimable by any other worker right away: XCLAIM them to
        ourselves with an IDLE far above claim_idle_ms (the next XAUTOCLAIM elsewhere takes
        them), and clear ourselves as the owner of `rids`."""
        svc = self.svc
        idle_ms = max(10 * svc.settings.claim_idle_ms, 3_600_000)

        async def op():
            async with svc.redis.pipeline(transaction=False) as pipe:
                pipe.xclaim(svc.keys.requests, CONSUMER_GROUP, svc.worker_id, 0, entry_ids, idle=idle_ms,
                            justid=True)
                for rid in rids:
                    pipe.hdel(svc.keys.meta(rid), META_OWNER)
                await pipe.execute()
        try:
            await asyncio.wait_for(with_backoff(op, "hand back"), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not hand back %d entries; they are claimed after claim_idle_ms", len(entry_ids))
        svc.stats["handed_back"] += len(entry_ids)

"""The worker process's Redis side around the engine: wires the parts together and runs them.

Where to look (one concern a file):
* worker.intake        — reading, claiming and keeping request entries (ownership, dead letters)
* worker.output_writer — every output write and the one commit that ends a request (coalescing)
* worker.control       — cancel / attach messages from gateways
* worker.lifecycle     — heartbeat, drain, hand back, supervised loops
* worker.engine_thread — the engine's own thread (steps, add/cancel inbox, output buffer)
* worker.engine_process — that thread in a child process (own GIL), the default

Tasks on one asyncio loop, the engine in its own process (or thread: ENGINE_PROCESS=false). Every Redis call path retries transient
errors (worker.redis_io.with_backoff), so a Redis restart only pauses the loops: the engine keeps
stepping, its outputs wait in a bounded buffer and then in the per-request queues, and are
written when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from shared.aio import cancel_and_wait
from shared.config import Settings
from shared.streams import Keys
from worker import registry
from worker.control import Control
from worker.engine_process import EngineProcess
from worker.engine_thread import Cancel, EngineThread, notify_loop
from worker.events import InFlight
from worker.intake import Intake
from worker.lifecycle import Lifecycle
from worker.output_writer import OutputWriter
from worker.redis_io import connect, with_backoff

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger("worker.service")

BLOCKING_READ_TIMEOUT_S = 11.0   # socket timeout of the blocking readers: beyond their BLOCK_MS


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerService:
    def __init__(self, settings: Settings, engine: Engine | EngineProcess, *, worker_id: str | None = None, model_name: str = ""):
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id or settings.worker_id or default_worker_id()
        self.keys = Keys(settings.stream_prefix)
        self.model_name = model_name
        self.capacity = settings.max_batch
        # every request this worker owns until its final is written and acked
        self.inflight: dict[str, InFlight] = {}
        self.stopping = False
        self.fatal = False
        self.started_ms = int(time.time() * 1000)
        self.stats = {"finished": 0, "continued": 0, "lost": 0, "dead": 0, "claimed": 0, "handed_back": 0,
                      "dropped": 0}
        self.stop_event = asyncio.Event()
        self.capacity_event = asyncio.Event()
        self.outputs_event = asyncio.Event()
        self.thread: EngineThread | None = None
        self.intake = Intake(self)
        self.control = Control(self)
        self.lifecycle = Lifecycle(self)

    # ---- shared state ------------------------------------------------------------------------

    def running_count(self) -> int:
        """Requests the engine is still working on (the others only wait for their last write)."""
        return sum(1 for st in self.inflight.values() if not st.engine_done)

    def free_slots(self) -> int:
        """Room for new or claimed work: the running batch plus WORKER_QUEUE_DEPTH queued in the
        engine, whose admission and prefill follow lanes (interactive first, batch aged); with
        an empty engine queue a lane could only order what happens to be read together. None
        while the engine is unhealthy."""
        if self.unhealthy:
            return 0
        return self.capacity + self.settings.worker_queue_depth - self.running_count()

    @property
    def unhealthy(self) -> str:
        """Why the engine cannot serve ("" when it can): every step fails."""
        return self.thread.unhealthy_reason if self.thread else ""

    def _on_done(self, done: list[InFlight]) -> None:
        for st in done:
            if self.inflight.get(st.rid) is st:
                del self.inflight[st.rid]
                self.stats["finished"] += 1
        self.capacity_event.set()

    def drop(self, st: InFlight) -> None:
        """Another worker owns rid now (it was claimed away, or our write was fenced): forget it
        here without a final and without an ack; the engine stops it silently."""
        st.fenced = True
        if self.inflight.get(st.rid) is st:
            del self.inflight[st.rid]
            self.stats["dropped"] += 1
            if not st.engine_done:
                self.thread.submit(Cancel(st.rid, silent=True))
        self.capacity_event.set()

    def _on_give_up(self, st: InFlight) -> None:
        """Redis keeps refusing rid's output: stop generating it; its slot is free again."""
        self.thread.submit(Cancel(st.rid, silent=True))
        self.capacity_event.set()

    def registry_fields(self) -> dict:
        t = self.thread
        return registry.registry_fields(
            capacity=self.capacity, running=t.running, waiting=t.waiting, in_flight=self.running_count(),
            kv_used=t.kv_used, kv_total=t.kv_total, model=self.model_name, started_ms=self.started_ms,
            steps=t.steps, state="draining" if self.stopping else "unhealthy" if self.unhealthy else "ready",
            reason=self.unhealthy, preemptions=t.preemptions)

    # ---- running -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stopping = True
        self.stop_event.set()
        self.capacity_event.set()

    async def run(self) -> None:
        s = self.settings
        self.redis = connect(s.redis_url)
        # the blocking readers get their own connections, with a read timeout beyond BLOCK_MS
        self.intake_redis = connect(s.redis_url, socket_timeout=BLOCKING_READ_TIMEOUT_S)
        self.ctl_redis = connect(s.redis_url, socket_timeout=BLOCKING_READ_TIMEOUT_S)
        # the writer bounds each round trip itself (a per-reply timeout costs a timer per request)
        self.output_redis = connect(s.redis_url, socket_timeout=None)
        self.writer = OutputWriter(self.output_redis, self.keys, s, self.worker_id,
                                   on_give_up=self._on_give_up, on_done=self._on_done, on_fenced=self.drop)
        loop = asyncio.get_running_loop()
        # an EngineProcess was launched (its engine built) before; a plain engine gets a thread here
        self.thread = self.engine if isinstance(self.engine, EngineProcess) else \
            EngineThread(self.engine, max_prompt_tokens=s.max_prompt_tokens, buffer_max=s.output_buffer_max)
        await with_backoff(self.intake.ensure_group, "create consumer group", lambda: self.stopping)
        await with_backoff(self.lifecycle.heartbeat_once, "register", lambda: self.stopping)
        # the engine process delivers on this loop; the engine thread from its own thread
        self.thread.start(self.outputs_event.set if isinstance(self.thread, EngineProcess)
                          else notify_loop(loop, self.outputs_event))
        log.info("worker %s ready (capacity %d, flush every %d ms)", self.worker_id, self.capacity,
                 s.worker_flush_ms)
        supervised = self.lifecycle.supervised
        tasks = [asyncio.create_task(supervised(name, fn), name=name) for name, fn in (
            ("writer", lambda: with_backoff(lambda: self.writer.run(self.thread.take_outputs, self.inflight,
                                                                    self.outputs_event), "write outputs")),
            ("control", self.control.loop), ("heartbeat", self.lifecycle.heartbeat_loop),
            ("keep-fresh", self.intake.keep_fresh_loop),
        )]
        feeders = [asyncio.create_task(supervised("intake", self.intake.intake_loop), name="intake"),
                   asyncio.create_task(supervised("claimer", self.intake.claim_loop), name="claimer")]
        try:
            await self.stop_event.wait()
            # stop reading now, not when the current XREADGROUP BLOCK returns: an entry already
            # delivered to us but not yet accepted stays pending and is claimed by another worker
            for task in feeders:
                task.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)
            await self.lifecycle.drain()
        finally:
            await asyncio.gather(*(cancel_and_wait(task) for task in feeders + tasks))
            self.thread.stop()
            for client in (self.redis, self.intake_redis, self.ctl_redis, self.output_redis):
                await client.aclose()
        log.info("worker %s stopped: %s %s", self.worker_id, self.stats, self.writer.stats)

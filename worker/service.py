"""The worker process's Redis side around the engine: builds the parts, each given what it uses, and runs them.

Where to look (one concern a file):
* worker.intake        — taking work in: reading, claiming, taking ownership (the epoch fences),
                         routing hand-overs, contested entries, dead letters (one module a concern)
* worker.ownership     — who runs a request: the take / keep / release scripts
* worker.leases        — keeping what we own fresh (keep-fresh), and handing it back
* worker.output_writer — every output write and the one commit that ends a request (coalescing)
* worker.control       — cancel / attach messages from gateways
* worker.lifecycle     — heartbeat, drain, hand back, supervised loops
* worker.inflight      — the requests this worker runs (shared by the parts above) and its counters
* worker.engine_client — the engine interface: worker.engine_thread (a thread) or
                         worker.engine_process (a child process, the default)

Tasks on one asyncio loop, the engine in its own process (or thread: ENGINE_PROCESS=false). Every Redis call path retries transient
errors (worker.redis_io.with_backoff), so a Redis restart only pauses the loops: the engine keeps
stepping, its outputs wait in a bounded buffer and then in the per-request queues, and are
written when Redis is back.

Who gets what: every part is built here, in the constructor, from explicit arguments (the
settings, the key layout, its Redis clients, the in-flight table, the engine client, the
writer, the counters, the stop event); no part holds the service or reaches into another part's
attributes, and none imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from shared.aio import cancel_and_wait
from shared.config import Settings
from shared.streams import Keys
from worker.control import Control
from worker.engine_client import EngineClient
from worker.inflight import InFlightTable, Stats
from worker.intake import Intake
from worker.leases import Leases
from worker.lifecycle import Lifecycle
from worker.metrics import WorkerMetrics
from worker.output_writer import OutputWriter
from worker.ownership import Ownership
from worker.redis_io import REDIS_ERRORS, RedisClients, with_backoff

log = logging.getLogger("worker.service")

METRICS_PUMP_S = 0.5      # how often the engine's step and cancel records become metrics
HIT_RATE_LOG_S = 60.0     # how often the prefix cache's hit rate is logged (while it sees traffic)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerService:
    def __init__(self, settings: Settings, engine: EngineClient, *, worker_id: str | None = None,
                 model_name: str = ""):
        self.settings = s = settings
        self.engine = engine
        self.worker_id = worker_id = worker_id or settings.worker_id or default_worker_id()
        self.keys = keys = Keys(settings.stream_prefix)
        self.redis = RedisClients.connect(settings.redis_url)   # connections open on first use
        self.stats = stats = Stats()
        self.stop = asyncio.Event()
        self.outputs_event = asyncio.Event()     # the engine has outputs to take
        self.metrics = metrics = WorkerMetrics(sources=lambda: {
            "engine": engine, "stats": stats, "writer_stats": self.writer.stats, "redis_errors": REDIS_ERRORS,
            "kv_block_tokens": s.kv_block_size, "max_batch": s.max_batch,
            "lease_lapsed": self.table.lease_lapsed(time.monotonic())})
        self.table = table = InFlightTable(engine, capacity=s.max_batch, queue_depth=s.worker_queue_depth,
                                           stats=stats, on_finished=metrics.request_finished)
        # the engine paces its outputs to WORKER_FLUSH_MS (EngineThread.pace_s; `start` below)
        self.writer = writer = OutputWriter(self.redis.output, keys, s, worker_id, paced=True, on_give_up=table.give_up,
                                            on_done=table.finished, on_fenced=table.drop, on_commit=metrics.commit,
                                            on_lapsed=lambda st: self.leases.renew_soon(st))
        ownership = Ownership(self.redis.main, keys, s, worker_id)
        self.leases = leases = Leases(redis=self.redis.main, keys=keys, settings=s, worker_id=worker_id,
                                      ownership=ownership, table=table, engine=engine, stats=stats,
                                      mark_lapsed=writer.mark_lapsed)
        self.intake = Intake(redis=self.redis.main, blocking_redis=self.redis.intake, keys=keys, settings=s,
                             worker_id=worker_id, table=table, engine=engine, writer=writer, stats=stats,
                             stop=self.stop, ownership=ownership, leases=leases)
        self.control = Control(blocking_redis=self.redis.control, keys=keys, worker_id=worker_id, table=table,
                               engine=engine, writer=writer, on_take=self.intake.take_forwarded)
        self.lifecycle = Lifecycle(redis=self.redis.main, keys=keys, settings=s, worker_id=worker_id, table=table,
                                   engine=engine, writer=writer, intake=self.intake, leases=leases, stats=stats,
                                   stop=self.stop, model_name=model_name)

    @property
    def fatal(self) -> bool:
        """The engine died: the process should exit non-zero (its orchestrator restarts it)."""
        return self.lifecycle.fatal

    def request_stop(self) -> None:
        self.lifecycle.request_stop()

    async def pump_metrics(self) -> None:
        """The engine's step and cancel records into the metrics (also while nobody scrapes:
        that is what keeps the engine's record lists short), and a log line of the prefix
        cache's hit rate every HIT_RATE_LOG_S while it sees traffic."""
        logged_at, seen = time.monotonic(), (0, 0)
        while True:
            await asyncio.sleep(METRICS_PUMP_S)
            self.metrics.pump(self.engine.take_telemetry())
            now = time.monotonic()
            if now - logged_at >= HIT_RATE_LOG_S:
                queries, hits = self.engine.prefix_cache_queries, self.engine.prefix_cache_hits
                if queries > seen[0]:
                    log.info("prefix cache: %.1f%% of prompt tokens served from the cache in the last %.0f s "
                             "(%d of %d; %.1f%% since start)", 100 * (hits - seen[1]) / (queries - seen[0]),
                             now - logged_at, hits - seen[1], queries - seen[0], 100 * hits / queries)
                logged_at, seen = now, (queries, hits)

    async def run(self) -> None:
        stopping = self.lifecycle.stopping
        if self.settings.worker_metrics_port:
            port = self.metrics.serve(self.settings.worker_metrics_host, self.settings.worker_metrics_port,
                                      self.settings.admin_token.get_secret_value())
            if port:
                log.info("metrics on http://%s:%d/metrics", self.settings.worker_metrics_host, port)
        await with_backoff(self.intake.ensure_group, "create consumer group", stopping)
        await with_backoff(self.lifecycle.heartbeat_once, "register", stopping)
        self.engine.start(self.outputs_event.set, pace_s=self.settings.worker_flush_s)
        log.info("worker %s ready (capacity %d, flush every %g ms)", self.worker_id, self.table.capacity,
                 1000 * self.settings.worker_flush_s)
        supervised = self.lifecycle.supervised

        async def write() -> None:
            await with_backoff(lambda: self.writer.run(self.engine.take_outputs, self.table.view,
                                                       self.outputs_event), "write outputs")
        tasks = [asyncio.create_task(supervised(name, fn), name=name) for name, fn in (
            ("writer", write), ("control", self.control.loop), ("heartbeat", self.lifecycle.heartbeat_loop),
            ("keep-fresh", self.leases.keep_fresh_loop), ("metrics", self.pump_metrics),
        )]
        feeders = [asyncio.create_task(supervised("intake", self.intake.read_loop), name="intake"),
                   asyncio.create_task(supervised("claimer", self.intake.claim_loop), name="claimer")]
        try:
            await self.stop.wait()
            # stop reading now, not when the current XREADGROUP BLOCK returns: an entry already
            # delivered to us but not yet accepted stays pending and is claimed by another worker
            for task in feeders:
                task.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)
            await self.lifecycle.drain()
        finally:
            await asyncio.gather(*(cancel_and_wait(task) for task in feeders + tasks))
            if self.lifecycle.stopping():
                await self.lifecycle.release_leftovers()
            self.engine.stop()
            self.metrics.close()
            await self.redis.aclose()
        log.info("worker %s stopped: %s %s", self.worker_id, self.stats.as_dict(), self.writer.stats)

"""The worker's Redis loop around the engine: intake, output writing, cancels, failover, registry.

Tasks on one asyncio loop, the engine in its own thread (worker.engine_thread):

* intake: XREADGROUP only as many new requests as the engine has free slots (an idle worker
  elsewhere gets the rest instead of this one hoarding them);
* writer: after every engine step, all its outputs go to Redis in ONE MULTI/EXEC pipeline
  (XADD `{p}:out:{rid}` MAXLEN ~, EXPIRE; on finish also XACK the request entry and DEL its
  owner key), so a final event and its ack land together or not at all;
* control: XREAD BLOCK on `{p}:ctl:{worker_id}`; a cancel goes straight into the engine inbox
  and takes effect at the next step boundary;
* keep-fresh: XCLAIM ... JUSTID of this worker's own pending entries resets their idle time, so
  a slow but healthy worker's requests are never claimed away; it also notices requests claimed
  away anyway (after a long stall) and drops them, and polls `{p}:cancelled:{rid}` flags;
* claimer: XAUTOCLAIM of entries idle for `claim_idle_ms` (their worker died) — see
  worker.failover — and a safe trim of the request stream (XTRIM MINID below the oldest entry
  still pending or unread);
* heartbeat: the registry entry (worker.registry).

Every Redis call path goes through `with_backoff`, so a Redis restart only pauses the loops:
the engine keeps stepping, its outputs wait in a bounded buffer and are written when Redis is
back. SIGTERM: stop intake and claiming, let running requests finish for `shutdown_grace_s`,
then hand the rest back (XCLAIM with a large IDLE, so the next XAUTOCLAIM elsewhere takes them
at once) and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import msgpack
from redis.exceptions import ResponseError

from shared.config import Settings
from shared.errors import ErrorCode
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, as_str, decode_event
from worker import failover, registry
from worker.engine import Engine
from worker.engine_thread import Add, Cancel, EngineThread, notify_loop
from worker.events import Event, InFlight, done_event, error_event, progress_from_last, step_events
from worker.redis_io import connect, with_backoff

log = logging.getLogger("worker.service")

BLOCK_MS = 1000          # XREAD BLOCK of the intake and control loops (bounds SIGTERM reaction)
TRIM_EVERY_S = 10.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def check_written(results: list) -> None:
    """Raise the first real error of an output pipeline. "ID equal or smaller" means the event
    was already written (a retried write whose first reply was lost): that is success."""
    for result in results:
        if isinstance(result, Exception) and "equal or smaller" not in str(result):
            raise result


async def trim_finished(redis, keys: Keys, *, approximate: bool = True) -> str | None:
    """XTRIM MINID below everything still pending or not yet delivered: only entries whose
    request finished (acked) are removed. The gateway's MAXLEN is only the hard cap.
    Returns the MINID used (None when the group does not exist)."""
    groups = await redis.xinfo_groups(keys.requests)
    group = next((g for g in groups if as_str(g.get("name")) == CONSUMER_GROUP), None)
    if group is None:
        return None
    summary = await redis.xpending(keys.requests, CONSUMER_GROUP)
    if summary and summary.get("pending"):
        minid = as_str(summary["min"])
    else:
        ms, _, seq = as_str(group.get("last-delivered-id", "0-0")).partition("-")
        minid = f"{ms}-{int(seq or 0) + 1}"
    await redis.xtrim(keys.requests, minid=minid, approximate=approximate)
    return minid


class WorkerService:
    def __init__(self, settings: Settings, engine: Engine, *, worker_id: str | None = None, model_name: str = ""):
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id or settings.worker_id or default_worker_id()
        self.keys = Keys(settings.stream_prefix)
        self.model_name = model_name
        self.capacity = settings.max_batch
        self.inflight: dict[str, InFlight] = {}
        self.stopping = False
        self.fatal = False
        self.started_ms = int(time.time() * 1000)
        self.stats = {"finished": 0, "replayed": 0, "lost": 0, "dead": 0, "claimed": 0, "handed_back": 0}
        self._stop = asyncio.Event()
        self._capacity = asyncio.Event()
        self._outputs = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self.thread: EngineThread | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stopping = True
        self._stop.set()
        self._capacity.set()

    async def run(self) -> None:
        s = self.settings
        self.redis = connect(s.redis_url)
        # the blocking readers get their own connections, with a read timeout beyond BLOCK_MS
        self.intake_redis = connect(s.redis_url, socket_timeout=BLOCK_MS / 1000 + 10)
        self.ctl_redis = connect(s.redis_url, socket_timeout=BLOCK_MS / 1000 + 10)
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.engine, max_prompt_tokens=s.max_prompt_tokens,
                                   buffer_max=s.output_buffer_max, on_output=notify_loop(loop, self._outputs))
        await with_backoff(self._ensure_group, "create consumer group", lambda: self.stopping)
        await with_backoff(self._heartbeat_once, "register", lambda: self.stopping)
        self.thread.start()
        log.info("worker %s ready (capacity %d)", self.worker_id, self.capacity)
        tasks = [asyncio.create_task(self._supervised(name, loop_fn), name=name) for name, loop_fn in (
            ("writer", self._writer_loop), ("control", self._control_loop),
            ("heartbeat", self._heartbeat_loop), ("keep-fresh", self._keep_fresh_loop),
        )]
        feeders = [asyncio.create_task(self._intake_loop(), name="intake"),
                   asyncio.create_task(self._claim_loop(), name="claimer")]
        try:
            await self._stop.wait()
            # stop reading now, not when the current XREADGROUP BLOCK returns: an entry already
            # delivered to us but not yet accepted stays pending and is claimed by another worker
            for task in feeders:
                task.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)
            await self._drain()
        finally:
            for task in feeders + tasks:
                task.cancel()
            await asyncio.gather(*feeders, *tasks, return_exceptions=True)
            self.thread.stop()
            for client in (self.redis, self.intake_redis, self.ctl_redis):
                await client.aclose()
        log.info("worker %s stopped: %s", self.worker_id, self.stats)

    async def _supervised(self, name: str, loop_fn) -> None:
        """Run a loop forever: transient Redis errors are retried inside it; anything else
        (e.g. NOGROUP after Redis lost its data) is logged and the loop restarted, so no part
        of the worker silently stops."""
        while True:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s loop failed; restarting it in 1 s", name)
                await asyncio.sleep(1.0)
                if name == "keep-fresh" or name == "writer":
                    try:
                        await self._ensure_group()
                    except Exception:
                        pass

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _drain(self) -> None:
        """Graceful stop: finish what runs within the grace period, hand back the rest."""
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            await self._hand_back(list(self.inflight))
        try:
            await asyncio.wait_for(self._flush(), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not write the last outputs (redis down)")
        try:
            await asyncio.wait_for(with_backoff(lambda: registry.deregister(self.redis, self.keys, self.worker_id),
                                                "deregister"), 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not deregister (redis down); the registry entry expires by itself")

    async def _hand_back(self, rids: list[str]) -> None:
        """Stop running `rids` here and make them claimable by another worker right away."""
        for rid in rids:
            self.thread.submit(Cancel(rid, silent=True))
        # let the engine apply the cancels, then write the tokens it produced before them, so
        # the next worker's skip count includes every delivered token
        deadline = time.monotonic() + 5
        while (self.thread.running or self.thread.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        try:
            await asyncio.wait_for(self._flush(), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not write outputs before handing back (redis down)")
        states = [self.inflight.pop(rid) for rid in rids if rid in self.inflight]
        if not states:
            return
        idle_ms = max(10 * self.settings.claim_idle_ms, 3_600_000)

        async def op():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0,
                            [st.entry_id for st in states], idle=idle_ms, justid=True)
                for st in states:
                    pipe.delete(self.keys.owner(st.rid))
                await pipe.execute()
        try:
            await asyncio.wait_for(with_backoff(op, "hand back"), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("could not hand back %d requests; they are claimed after claim_idle_ms", len(states))
        self.stats["handed_back"] += len(states)
        log.info("handed back %d requests: %s", len(states), [st.rid for st in states])

    # ---- intake and claiming --------------------------------------------------------------

    def free_slots(self) -> int:
        return self.capacity - len(self.inflight)

    async def _intake_loop(self) -> None:
        while not self.stopping:
            free = self.free_slots()
            if free <= 0:
                self._capacity.clear()
                if self.free_slots() <= 0:
                    await self._capacity.wait()
                continue
            try:
                resp = await with_backoff(
                    lambda: self.intake_redis.xreadgroup(CONSUMER_GROUP, self.worker_id, {self.keys.requests: ">"},
                                                         count=free, block=BLOCK_MS),
                    "read requests", lambda: self.stopping)
            except asyncio.CancelledError:
                return
            except ResponseError as exc:  # NOGROUP: the stream was deleted under us
                log.warning("xreadgroup failed (%s); recreating the group", exc)
                await with_backoff(self._ensure_group, "create consumer group", lambda: self.stopping)
                continue
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    await self._accept(as_str(entry_id), fields, deliveries=1)

    async def _claim_loop(self) -> None:
        # scanning is cheap (XAUTOCLAIM walks the pending list from 0-0), and a short interval
        # is what makes a hand-back from a draining worker land elsewhere within a second
        interval = max(0.2, min(1.0, self.settings.claim_idle_ms / 2000))
        last_trim = 0.0
        while not self.stopping:
            try:
                await asyncio.wait_for(self._stop.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass
            try:
                free = self.free_slots()
                if free > 0:
                    await with_backoff(lambda: self._claim_once(free), "claim", lambda: self.stopping)
                if time.monotonic() - last_trim > TRIM_EVERY_S:
                    await with_backoff(self._trim_requests, "trim", lambda: self.stopping)
                    last_trim = time.monotonic()
            except asyncio.CancelledError:
                return
            except ResponseError as exc:
                log.warning("claim loop: %s", exc)

    async def _claim_once(self, count: int) -> None:
        _next, entries, deleted = (await self.redis.xautoclaim(
            self.keys.requests, CONSUMER_GROUP, self.worker_id, self.settings.claim_idle_ms,
            start_id="0-0", count=count))[:3]
        if deleted:
            log.warning("pending entries trimmed before anyone finished them: %s", deleted)
        entries = [(as_str(i), f) for i, f in entries if f]
        if not entries:
            return
        # delivery counts (XAUTOCLAIM has already counted this delivery)
        pending = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min=entries[0][0],
                                                  max=entries[-1][0], count=len(entries) + 100,
                                                  consumername=self.worker_id)
        deliveries = {as_str(p["message_id"]): int(p["times_delivered"]) for p in pending}
        for entry_id, fields in entries:
            if entry_id in {st.entry_id for st in self.inflight.values()}:
                continue
            self.stats["claimed"] += 1
            await self._accept(entry_id, fields, deliveries=deliveries.get(entry_id, 2))

    async def _trim_requests(self) -> None:
        await trim_finished(self.redis, self.keys)

    async def _accept(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """Take ownership of one delivered entry: validate, check cancel flag and progress, run."""
        raw = fields.get(ENTRY_FIELD) if fields else None
        try:
            entry = RequestEntry.decode(raw if raw is not None else b"")
        except ValueError as exc:
            await self._dead_letter(entry_id, str(exc), raw, deliveries, "invalid")
            return
        if deliveries > self.settings.max_deliveries:
            await self._dead_letter(entry_id, f"delivered {deliveries} times without finishing", raw,
                                    deliveries, "deliveries", rid=entry.rid)
            return
        if entry.rid in self.inflight:
            return
        keys = self.keys

        async def claim():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(keys.owner(entry.rid), self.worker_id, ex=self.settings.output_ttl_s)
                pipe.exists(keys.cancelled(entry.rid))
                pipe.xrevrange(keys.out(entry.rid), count=1)
                return await pipe.execute()
        _, cancelled, last = await with_backoff(claim, "claim request")
        progress = progress_from_last(decode_event(last[0][1][ENTRY_FIELD]) if last else None)
        state = InFlight(rid=entry.rid, entry_id=entry_id, entry=entry, progress=progress)
        decision = failover.decide(entry, progress)
        if decision.action == "ack":
            await self._finish_now(state, [])
            return
        if cancelled:
            await self._finish_now(state, [done_event(progress.seq, "cancelled")])
            return
        if decision.action == "lost":
            self.stats["lost"] += 1
            await self._finish_now(state, [error_event(progress.seq, ErrorCode.WORKER_LOST, failover.LOST_MESSAGE)])
            return
        if decision.action == "replay":
            self.stats["replayed"] += 1
            log.info("replaying %s from token %d (seq %d)", entry.rid, decision.skip_tokens, progress.seq)
        self.inflight[entry.rid] = state
        self.thread.submit(Add(entry, skip_tokens=decision.skip_tokens))

    async def _finish_now(self, state: InFlight, events: list[Event]) -> None:
        """Final events for a request that never reaches the engine, with its ack."""
        async def op():
            async with self.redis.pipeline(transaction=True) as pipe:
                self._queue_events(pipe, state.rid, events)
                pipe.xack(self.keys.requests, CONSUMER_GROUP, state.entry_id)
                pipe.delete(self.keys.owner(state.rid))
                check_written(await pipe.execute(raise_on_error=False))
        await with_backoff(op, "finish request")

    async def _dead_letter(self, entry_id: str, reason: str, raw: bytes | None, deliveries: int, kind: str,
                           rid: str | None = None) -> None:
        rid = rid or failover.rid_of_raw(raw)
        self.stats["dead"] += 1
        log.warning("dead-lettering entry %s (rid %s): %s", entry_id, rid, reason)
        seq = 0
        if rid is not None:  # the final event must follow whatever earlier attempts wrote
            last = await with_backoff(lambda: self.redis.xrevrange(self.keys.out(rid), count=1), "read progress")
            progress = progress_from_last(decode_event(last[0][1][ENTRY_FIELD]) if last else None)
            if progress.finished:
                rid = None
            seq = progress.seq

        async def op():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(self.keys.dead, failover.dead_letter_fields(entry_id, reason, raw, self.worker_id, deliveries),
                          maxlen=failover.DEAD_MAXLEN, approximate=True)
                if rid is not None:
                    code = failover.DEAD_CODE[kind]
                    self._queue_events(pipe, rid, [error_event(seq, code, f"request rejected by the worker: {reason}",
                                                               retryable=False)])
                    pipe.delete(self.keys.owner(rid))
                pipe.xack(self.keys.requests, CONSUMER_GROUP, entry_id)
                check_written(await pipe.execute(raise_on_error=False))
        await with_backoff(op, "dead-letter")

    # ---- outputs ---------------------------------------------------------------------------

    def _queue_events(self, pipe, rid: str, events: list[Event]) -> None:
        if not events:
            return
        key = self.keys.out(rid)
        for entry_id, payload in events:
            pipe.xadd(key, {ENTRY_FIELD: payload}, id=entry_id, maxlen=self.settings.output_maxlen, approximate=True)
        pipe.expire(key, self.settings.output_ttl_s)

    async def _writer_loop(self) -> None:
        while True:
            await self._outputs.wait()
            self._outputs.clear()
            await self._flush()

    async def _flush(self) -> None:
        """Write everything the engine produced since the last flush in one MULTI/EXEC."""
        async with self._write_lock:
            outs = self.thread.take_outputs()
            if not outs:
                return
            per_rid: dict[str, list[Event]] = {}
            finished: list[InFlight] = []
            for out in outs:
                state = self.inflight.get(out.rid)
                if state is None:  # dropped (handed back, claimed away) meanwhile
                    continue
                per_rid.setdefault(out.rid, []).extend(step_events(state, out))
                if out.finished:
                    finished.append(state)

            async def op():
                async with self.redis.pipeline(transaction=True) as pipe:
                    for rid, events in per_rid.items():
                        self._queue_events(pipe, rid, events)
                    for st in finished:
                        pipe.xack(self.keys.requests, CONSUMER_GROUP, st.entry_id)
                        pipe.delete(self.keys.owner(st.rid))
                    check_written(await pipe.execute(raise_on_error=False))
            if per_rid or finished:
                await with_backoff(op, "write outputs")
            for st in finished:
                if self.inflight.get(st.rid) is st:
                    del self.inflight[st.rid]
                    self.stats["finished"] += 1
            if finished:
                self._capacity.set()

    # ---- control, freshness, registry ------------------------------------------------------

    async def _control_loop(self) -> None:
        key = self.keys.ctl(self.worker_id)
        # An explicit id, not "$": with "$" every XREAD that times out would restart from the
        # then-newest entry, dropping a cancel that lands between two calls.
        last_id = f"{int(time.time() * 1000)}-0"
        while True:
            resp = await with_backoff(lambda: self.ctl_redis.xread({key: last_id}, count=256, block=BLOCK_MS),
                                      "read control")
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    last_id = as_str(entry_id)
                    self._on_control(fields.get(ENTRY_FIELD))

    def _on_control(self, raw: bytes | None) -> None:
        try:
            msg = msgpack.unpackb(raw, raw=False)
            kind, rid = msg["k"], msg["rid"]
        except Exception:
            log.warning("ignoring malformed control entry %r", raw[:100] if raw else raw)
            return
        if kind == "cancel" and rid in self.inflight:
            self.thread.submit(Cancel(rid))

    async def _keep_fresh_loop(self) -> None:
        interval = max(0.1, min(self.settings.worker_heartbeat_s, self.settings.claim_idle_ms / 3000))
        while True:
            await asyncio.sleep(interval)
            if self.inflight:
                await with_backoff(self._keep_fresh_once, "keep fresh")

    async def _keep_fresh_once(self) -> None:
        states = list(self.inflight.values())
        if not states:
            return
        mine = await self.redis.xpending_range(self.keys.requests, CONSUMER_GROUP, min="-", max="+",
                                               count=len(states) + self.capacity + 100,
                                               consumername=self.worker_id)
        pending = {as_str(p["message_id"]) for p in mine}
        kept = []
        for st in states:
            if st.entry_id in pending:
                kept.append(st)
            elif self.inflight.get(st.rid) is st and st.entry_id not in pending:
                # claimed by another worker (we stalled past claim_idle_ms): it owns it now
                log.warning("request %s was claimed by another worker; dropping it here", st.rid)
                del self.inflight[st.rid]
                self.thread.submit(Cancel(st.rid, silent=True))
                self._capacity.set()
        if not kept:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xclaim(self.keys.requests, CONSUMER_GROUP, self.worker_id, 0, [st.entry_id for st in kept],
                        justid=True)
            for st in kept:
                pipe.exists(self.keys.cancelled(st.rid))
                pipe.expire(self.keys.owner(st.rid), self.settings.output_ttl_s)
            results = await pipe.execute()
        for i, st in enumerate(kept):
            if results[1 + 2 * i] and st.rid in self.inflight:
                self.thread.submit(Cancel(st.rid))

    def registry_fields(self) -> dict:
        t = self.thread
        return registry.registry_fields(
            capacity=self.capacity, running=t.running, waiting=t.waiting, in_flight=len(self.inflight),
            kv_used=t.kv_used, kv_total=t.kv_total, model=self.model_name, started_ms=self.started_ms,
            steps=t.steps, state="draining" if self.stopping else "ready")

    async def _heartbeat_once(self) -> None:
        await registry.heartbeat(self.redis, self.keys, self.worker_id, self.registry_fields(),
                                 self.settings.worker_ttl_s)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.worker_heartbeat_s)
            if not self.thread.is_alive() and not self.stopping:
                # never advertise capacity we cannot serve: hand everything back and exit non-zero
                log.critical("the engine thread died; handing back %d requests and exiting", len(self.inflight))
                self.fatal = True
                self.settings = self.settings.model_copy(update={"shutdown_grace_s": 0.0})
                self.request_stop()
                return
            await with_backoff(self._heartbeat_once, "heartbeat")

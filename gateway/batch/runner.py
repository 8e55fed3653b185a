"""Running batches: a duty any gateway replica holds, one batch at a time per lease.

The gateway keeps nothing a peer could not rebuild, so a batch is run by whichever replica holds
its lease (`p:{b:<id>}:lease` = that replica's gw id, with a PX expiry). Each housekeeping tick
(`tick`) a replica renews the leases it holds and, while it has room (BATCH_RUNS_PER_GATEWAY),
claims an active batch whose lease is free: expired, released by a clean stop, or held by a
gateway that liveness (gateway.liveness) has declared dead — so a SIGKILLed runner's batches
move on as soon as its streams are parked, well inside the resume grace that keeps its
requests alive for the new holder to re-attach to (gateway.batch.line). The holder trusts its
lease only until a monotonic deadline one lease after its last renewal, so a replica cut off
from Redis stops starting lines before another may take over.

A batch's life: validating (its file's lines must call its endpoint) -> in_progress (at most
BATCH_CONCURRENCY lines in flight) -> finalizing (the output and error files assembled from
the recorded answers, in line order) -> completed; failed (the file does not fit the batch),
cancelling -> cancelled (`POST .../cancel`), expired (its completion window passed). Lines not
answered when a batch is cancelled or expires get an error line (`batch_cancelled`,
`batch_expired`), so every line of the input is answered exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.batch.files import BatchLine, FileStore, LineErrors, parse_lines
from gateway.batch.line import LineRunner
from gateway.batch.store import BatchStore
from gateway.settings import GatewaySettings
from shared.aio import cancel_and_wait
from shared.streams import as_str

log = logging.getLogger("gateway.batch")

RETRY_S = 0.5            # a line refused for now (limits, overload, Redis) is tried again after this
WATCH_S = 0.5            # how often a running batch looks for a cancel, its expiry and its lease

# KEYS: lease. ARGV: me, the holder seen (or ""), lease ms: take it if it is still as seen.
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[2] == '') or cur == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""
# KEYS: lease. ARGV: me, lease ms (0: release).
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


class _LeftHere(Exception):
    """The lease is lost or this replica drains: the batch goes on elsewhere."""


class BatchRunner:
    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings, *, gw_id: str, gateways_key: str,
                 store: BatchStore, files: FileStore, lines: LineRunner, draining):
        self.redis = redis
        self.s = settings
        self.gw_id = gw_id
        self.gateways_key = gateways_key
        self.store = store
        self.files = files
        self.lines = lines
        self.draining = draining               # () -> bool: this replica drains (start nothing new)
        self.lease_ms = int(settings.batch_lease_s * 1000)
        self._claim = redis.register_script(_CLAIM)
        self._renew = redis.register_script(_RENEW)
        self.running: dict[str, asyncio.Task] = {}
        self.valid_until: dict[str, float] = {}

    def holds(self, batch_id: str) -> bool:
        return time.monotonic() < self.valid_until.get(batch_id, 0.0)

    async def tick(self, now: float) -> None:
        """The housekeeping duty: renew what we hold, claim what nobody runs."""
        for batch_id, task in list(self.running.items()):
            if task.done():
                self.running.pop(batch_id, None)
                self.valid_until.pop(batch_id, None)
                continue
            if await self._renew(keys=[self.store.key(batch_id, "lease")], args=[self.gw_id, self.lease_ms]):
                self.valid_until[batch_id] = now + self.s.batch_lease_s
            else:
                log.warning("batch %s: lease lost to another replica; stopping here", batch_id)
                self.valid_until.pop(batch_id, None)
                task.cancel()
        if self.draining():
            return
        for batch_id in await self.store.active_ids():
            if len(self.running) >= self.s.batch_runs_per_gateway:
                break
            if batch_id not in self.running and await self._take(batch_id, now):
                self.running[batch_id] = asyncio.get_running_loop().create_task(
                    self._run(batch_id), name=f"batch-{batch_id}")

    async def _take(self, batch_id: str, now: float) -> bool:
        found = await self.redis.get(self.store.key(batch_id, "lease"))
        holder = None if found is None else as_str(found)
        if holder not in (None, self.gw_id) and await self.redis.zscore(self.gateways_key, holder) is not None:
            return False                       # held by a live replica
        taken = await self._claim(keys=[self.store.key(batch_id, "lease")],
                                  args=[self.gw_id, holder or "", self.lease_ms])
        if taken:
            self.valid_until[batch_id] = now + self.s.batch_lease_s
            if holder not in (None, self.gw_id):
                log.warning("batch %s: taken over from gateway %s", batch_id, holder)
        return bool(taken)

    async def stop(self) -> None:
        """Stop running (a drain or a stop): unfinished lines stay parked for the next holder."""
        for batch_id, task in list(self.running.items()):
            await cancel_and_wait(task)
            try:
                await self._renew(keys=[self.store.key(batch_id, "lease")], args=[self.gw_id, 0])
            except (RedisError, OSError):
                pass                           # it expires
        self.running.clear()

    # ---- one batch ----------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        while True:
            try:
                await self._advance(batch_id)
                return
            except _LeftHere:
                return
            except (RedisError, OSError) as exc:
                log.warning("batch %s: %s; retrying", batch_id, exc)
                await asyncio.sleep(RETRY_S)
            except Exception:
                log.exception("batch %s failed here; another tick retries it", batch_id)
                return

    async def _advance(self, batch_id: str) -> None:
        raw = await self.store.raw(batch_id)
        if raw is None or raw["status"] in ("completed", "failed", "expired", "cancelled"):
            await self.redis.zrem(self.store.active, batch_id)
            return
        owner = raw["owner"]
        data = await self.files.content(owner, raw["input_file_id"])
        lines, errors = self._lines(data, raw["endpoint"])
        if errors and raw["status"] == "validating":
            await self.store.move(batch_id, "failed", when=("validating",), extra={"errors": json.dumps(errors)})
            await self.store.ended(batch_id)
            return
        if raw["status"] == "validating":
            await self.store.move(batch_id, "in_progress", when=("validating",), extra={"total": len(lines)})
        if errors:                             # the input was deleted mid-run: what was answered stays
            status = "failed"
        elif raw["status"] == "cancelling":
            status = "cancelled"
        else:
            status = await self._lines_of(batch_id, owner, lines, int(raw["expires_at"]))
        await self._finalize(batch_id, owner, lines, status, errors)

    def _lines(self, data: bytes | None, endpoint: str) -> tuple[list[BatchLine], list[dict]]:
        """The batch's requests, and its errors (OpenAI's `errors.data`: code, line, message, param);
        an input deleted mid-run has no lines left to run: the batch fails with what it answered."""
        if data is None:
            return [], [{"code": "file_not_found", "line": None, "message": "the input file no longer exists",
                         "param": "input_file_id"}]
        try:
            lines = parse_lines(data, self.s.batch_max_lines)
        except LineErrors as exc:
            return [], [{"code": "invalid_request", **e} for e in exc.errors]
        wrong = [{"code": "mismatched_endpoint", "line": ln.line, "param": "url",
                  "message": f"line {ln.line}: url {ln.url} is not the batch's endpoint {endpoint}"}
                 for ln in lines if ln.url != endpoint]
        return lines, wrong

    async def _lines_of(self, batch_id: str, owner: str, lines: list[BatchLine], expires_at: int) -> str:
        """Run the unanswered lines, BATCH_CONCURRENCY at a time, until all are answered or the
        batch is cancelled or expires; returns the status it ends with (its lease lost or this
        replica draining: cancelled here, to be resumed by the next holder)."""
        answered = await self.store.answered(batch_id)
        todo = iter([ln for ln in lines if ln.index not in answered])
        cancelled = asyncio.Event()
        stop = asyncio.Event()

        async def worker() -> None:
            for line in todo:
                while not stop.is_set():
                    if not self.holds(batch_id) or self.draining():
                        raise _LeftHere
                    if await self.lines.run(batch_id, owner, line, cancelled):
                        break
                    await asyncio.sleep(RETRY_S)
                if stop.is_set():
                    return

        async def watch() -> str:
            while True:
                try:
                    status = await self.store.status(batch_id)
                except (RedisError, OSError):
                    status = None              # Redis away: the lines wait for it too
                if status == "cancelling":
                    cancelled.set()
                    stop.set()
                    return "cancelled"
                if time.time() > expires_at:
                    stop.set()
                    return "expired"
                await asyncio.sleep(WATCH_S)

        workers = [asyncio.ensure_future(worker()) for _ in range(max(1, self.s.batch_concurrency))]
        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()                  # _LeftHere: stop without finalizing
        finally:
            for task in [*workers, watcher]:
                await cancel_and_wait(task)
        return watcher.result() if watcher.done() and not watcher.cancelled() and watcher.exception() is None \
            else "completed"

    async def _finalize(self, batch_id: str, owner: str, lines: list[BatchLine], status: str,
                        errors: list[dict] | None = None) -> None:
        """The output and error files, in line order; lines never answered get an error line."""
        if status == "completed" and not await self.store.move(batch_id, "finalizing", when=("in_progress",)):
            if await self.store.status(batch_id) == "cancelling":     # cancelled as its last line ended
                status = "cancelled"
        answers = await self.store.results(batch_id)
        code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(status, "batch_failed")
        for line in lines:
            if line.index not in answers:
                answers[line.index] = {"id": f"batch_req_{batch_id}_{line.index}", "custom_id": line.custom_id,
                                       "response": None,
                                       "error": {"code": code, "message": f"the batch was {status} before this "
                                                                          "request ran"}}
        good = [a for _, a in sorted(answers.items()) if (a.get("response") or {}).get("status_code") == 200]
        bad = [a for _, a in sorted(answers.items()) if (a.get("response") or {}).get("status_code") != 200]
        extra = {"completed": len(good), "failed": len(bad)}
        if lines:
            extra["total"] = len(lines)
        if errors:
            extra["errors"] = json.dumps(errors)
        hex_id = batch_id.removeprefix("batch_")
        for name, part in (("output_file_id", good), ("error_file_id", bad)):
            if part:
                meta = await self.files.create(
                    owner, filename=f"{batch_id}_{name.split('_')[0]}.jsonl", purpose="batch_output",
                    data="".join(json.dumps(a) + "\n" for a in part).encode(),
                    file_id=f"file-{hex_id}-{name.split('_')[0]}")
                extra[name] = meta["id"]
        when = ("finalizing",) if status == "completed" else ("in_progress", "validating", "cancelling", "finalizing")
        await self.store.move(batch_id, status, when=when, extra=extra)
        await self.store.ended(batch_id)
        log.info("batch %s %s: %d answered, %d failed", batch_id, status, len(good), len(bad))

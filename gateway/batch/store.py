"""Batch objects in Redis: the batch (one hash), each line's answer (one hash, field = line
index, written with HSETNX so a line is answered exactly once however many replicas race to
record it), its attempts, the runner's lease, the list of active batches any replica's runner
picks from, and each owner's index for `GET /v1/batches`.

Keys (shared.streams.Keys, prefix `p`): `p:{b:<id>}:batch`, `p:{b:<id>}:results`,
`p:{b:<id>}:attempts`, `p:{b:<id>}:lease`, `p:{batches}:active`, `p:{batches}:<owner>`. A batch's keys share one slot,
so the record script is one atomic step on a Redis Cluster too; all expire BATCH_FILE_TTL_S
after the batch ends (a completion window after it was created, until then).
"""

from __future__ import annotations

import json
import secrets
import time

import redis.asyncio as aioredis

from gateway.batch.files import created_us, page
from shared.streams import Keys, as_str

WINDOW_S = {"24h": 86400}
FINAL = ("completed", "failed", "expired", "cancelled")
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
         "cancelled_at")

# KEYS: batch, results. ARGV: index, line json, counter. The first answer of a line counts; a
# second (a replica that took the batch over and re-attached to the same request) is dropped.
_RECORD = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  return 1
end
return 0
"""
# KEYS: batch. ARGV: new status, its timestamp field, now, allowed current statuses...
_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
for i = 4, #ARGV do
  if cur == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    return 1
  end
end
return 0
"""


class BatchStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._record = redis.register_script(_RECORD)
        self._move = redis.register_script(_MOVE)

    def key(self, batch_id: str, part: str = "batch") -> str:
        """One of the batch's keys (shared.streams.Keys): batch, results, attempts, lease."""
        return getattr(self.keys, "batch" if part == "batch" else f"batch_{part}")(batch_id)

    @property
    def active(self) -> str:
        return self.keys.batches_active

    def index(self, owner: str) -> str:
        return self.keys.batches(owner)

    async def create(self, owner: str, *, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None) -> dict:
        now = int(time.time())
        batch_id = "batch_" + secrets.token_hex(16)
        fields = {"id": batch_id, "owner": owner, "input_file_id": input_file_id, "endpoint": endpoint,
                  "completion_window": completion_window, "metadata": json.dumps(metadata),
                  "created_at": now, "expires_at": now + WINDOW_S[completion_window], "status": "validating",
                  "total": 0, "completed": 0, "failed": 0}
        keep = WINDOW_S[completion_window] + self.ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key(batch_id), mapping=fields)
            pipe.expire(self.key(batch_id), keep)
            # by creation in µs: batches made in the same second still list newest first
            pipe.zadd(self.index(owner), {batch_id: created_us()})
            pipe.expire(self.index(owner), keep)
            pipe.zadd(self.active, {batch_id: created_us()})
            await pipe.execute()
        return render({k: str(v) for k, v in fields.items()})

    async def raw(self, batch_id: str) -> dict[str, str] | None:
        found = await self.redis.hgetall(self.key(batch_id))
        return {as_str(k): as_str(v) for k, v in found.items()} if found else None

    async def get(self, owner: str, batch_id: str) -> dict | None:
        raw = await self.raw(batch_id)
        return render(raw) if raw is not None and raw.get("owner") == owner else None

    async def list(self, owner: str, *, after: str | None, limit: int) -> tuple[list[dict], bool]:
        async def load(ids: list[str]) -> list[dict | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for batch_id in ids:
                    pipe.hgetall(self.key(batch_id))
                found = await pipe.execute()
            gone = [i for i, f in zip(ids, found) if not f]
            if gone:
                await self.redis.zrem(self.index(owner), *gone)
            return [render({as_str(k): as_str(v) for k, v in f.items()}) if f else None for f in found]
        return await page(self.redis, self.index(owner), after, limit, load)

    async def move(self, batch_id: str, status: str, *, when: tuple[str, ...], extra: dict | None = None) -> bool:
        """Set `status` (and its `<status>_at`) if the batch is in one of `when`; `extra` fields too."""
        moved = await self._move(keys=[self.key(batch_id)], args=[status, f"{status}_at", int(time.time()), *when])
        if moved and extra:
            await self.redis.hset(self.key(batch_id), mapping=extra)
        return bool(moved)

    async def status(self, batch_id: str) -> str | None:
        found = await self.redis.hget(self.key(batch_id), "status")
        return None if found is None else as_str(found)

    async def record(self, batch_id: str, index: int, line: dict, ok: bool) -> bool:
        """A line's answer, once: False when it was answered already."""
        return bool(await self._record(keys=[self.key(batch_id), self.key(batch_id, "results")],
                                       args=[index, json.dumps(line), "completed" if ok else "failed"]))

    async def answered(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self.redis.hkeys(self.key(batch_id, "results"))}

    async def results(self, batch_id: str) -> dict[int, dict]:
        found = await self.redis.hgetall(self.key(batch_id, "results"))
        return {int(k): json.loads(v) for k, v in found.items()}

    async def attempt(self, batch_id: str, index: int, *, bump: bool = False) -> int:
        key = self.key(batch_id, "attempts")
        if bump:
            return int(await self.redis.hincrby(key, index, 1))
        return int(await self.redis.hget(key, index) or 0)

    async def ended(self, batch_id: str) -> None:
        """The batch is final: off the active list; its keys kept BATCH_FILE_TTL_S from now."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.active, batch_id)
            for part in ("batch", "results", "attempts"):
                pipe.expire(self.key(batch_id, part), self.ttl_s)
            pipe.delete(self.key(batch_id, "lease"))
            await pipe.execute()

    async def active_ids(self) -> list[str]:
        return [as_str(i) for i in await self.redis.zrange(self.active, 0, -1)]


def render(raw: dict[str, str]) -> dict:
    """The batch object in OpenAI's shape (openai-python `types/batch.py`)."""
    errors = json.loads(raw["errors"]) if raw.get("errors") else None
    return {
        "id": raw["id"], "object": "batch", "endpoint": raw["endpoint"], "model": None,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": raw["input_file_id"], "completion_window": raw["completion_window"],
        "status": raw["status"], "output_file_id": raw.get("output_file_id") or None,
        "error_file_id": raw.get("error_file_id") or None, "created_at": int(raw["created_at"]),
        "expires_at": int(raw["expires_at"]),
        **{t: int(raw[t]) if raw.get(t) else None for t in TIMES},
        "request_counts": {"total": int(raw.get("total") or 0), "completed": int(raw.get("completed") or 0),
                           "failed": int(raw.get("failed") or 0)},
        "metadata": json.loads(raw.get("metadata") or "null"),
    }

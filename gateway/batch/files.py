"""Files of the Batch API (`/v1/files`): a JSONL input checked line by line at upload, and the
output and error files a batch writes when it ends, each one Redis hash bound to the API key
that uploaded it (another key sees a 404) and kept BATCH_FILE_TTL_S.

A file is small enough to be one Redis value (BATCH_FILE_MAX_BYTES, 20 MiB by default), which
keeps every gateway replica able to serve any file with no shared disk. Anonymous clients (auth
off) share one owner, as they share resumes (gateway.auth.may_resume): the 128-bit id is the secret.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.auth import ANONYMOUS, is_anonymous
from shared.streams import Keys, as_str

# what a batch line may call
RESPONSES = "/v1/responses"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", RESPONSES)
PURPOSES = ("batch", "batch_output")
MAX_REPORTED = 20          # malformed lines named in one upload error


def owner_of(key_id: str) -> str:
    return ANONYMOUS if is_anonymous(key_id) else key_id


@dataclass(frozen=True)
class BatchLine:
    index: int             # 0-based position among the file's requests
    line: int              # 1-based line number in the file
    custom_id: str
    url: str
    body: dict


class LineErrors(Exception):
    """The file's malformed lines: [{"line", "message", "param"}] (1-based line numbers)."""

    def __init__(self, errors: list[dict]):
        super().__init__(f"{len(errors)} malformed line(s)")
        self.errors = errors


def parse_lines(data: bytes, max_lines: int) -> list[BatchLine]:
    """The requests of a batch input file; LineErrors naming every malformed line otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineErrors([{"line": None, "message": f"the file is not UTF-8: {exc}", "param": "file"}]) from None
    out: list[BatchLine] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = _line(json.loads(raw), seen)
        except ValueError as exc:
            errors.append({"line": number, "message": f"line {number}: {exc}",
                           "param": getattr(exc, "param", None)})
            continue
        out.append(BatchLine(len(out), number, *item))
    if not out and not errors:
        errors.append({"line": None, "message": "the file holds no requests", "param": "file"})
    if len(out) + len(errors) > max_lines:
        errors.insert(0, {"line": None, "message": f"a batch holds at most {max_lines} requests", "param": "file"})
    if errors:
        raise LineErrors(errors)
    return out


class _Bad(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _line(item, seen: set[str]) -> tuple[str, str, dict]:
    if not isinstance(item, dict):
        raise _Bad("a line must be a JSON object {custom_id, method, url, body}")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise _Bad("'custom_id' must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise _Bad(f"'custom_id' {custom_id!r} is used by an earlier line (each must be unique)", "custom_id")
    seen.add(custom_id)
    if method != "POST":
        raise _Bad(f"'method' must be \"POST\", not {method!r}", "method")
    if url not in ENDPOINTS:
        raise _Bad(f"'url' must be one of {', '.join(ENDPOINTS)}, not {url!r}", "url")
    if not isinstance(body, dict):
        raise _Bad("'body' must be a JSON object (the request's body)", "body")
    return custom_id, url, body


class FileStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int):
        self.redis = redis
        self.key = keys.file                  # one file's hash
        self.index = keys.files               # an owner's files, for listing
        self.ttl_s = ttl_s

    async def create(self, owner: str, *, filename: str, purpose: str, data: bytes,
                     file_id: str | None = None) -> dict:
        """Store `data` as a file of `owner` (idempotent for a given `file_id`: a batch's output)."""
        now = int(time.time())
        file_id = file_id or "file-" + secrets.token_hex(16)
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": now, "filename": filename,
                "purpose": purpose, "status": "processed", "expires_at": now + self.ttl_s, "status_details": None}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key(file_id), mapping={"meta": json.dumps(meta), "owner": owner, "data": data})
            pipe.expire(self.key(file_id), self.ttl_s)
            pipe.zadd(self.index(owner), {file_id: created_us()})
            pipe.expire(self.index(owner), self.ttl_s)
            await pipe.execute()
        return meta

    async def get(self, owner: str, file_id: str) -> dict | None:
        meta, holder = await self.redis.hmget(self.key(file_id), ["meta", "owner"])
        if meta is None or as_str(holder) != owner:
            return None
        return json.loads(meta)

    async def content(self, owner: str, file_id: str) -> bytes | None:
        holder, data = await self.redis.hmget(self.key(file_id), ["owner", "data"])
        return data if data is not None and as_str(holder) == owner else None

    async def delete(self, owner: str, file_id: str) -> bool:
        if await self.get(owner, file_id) is None:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.key(file_id))
            pipe.zrem(self.index(owner), file_id)
            await pipe.execute()
        return True

    async def list(self, owner: str, *, after: str | None, limit: int, purpose: str | None = None
                   ) -> tuple[list[dict], bool]:
        """`owner`'s files, newest first, after the one named `after`; and whether more follow."""
        found, more = await page(self.redis, self.index(owner), after, limit,
                                 lambda ids: self._metas(owner, ids), keep=lambda m: purpose in (None, m["purpose"]))
        return found, more

    async def _metas(self, owner: str, ids: list[str]) -> list[dict | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hget(self.key(file_id), "meta")
            raw = await pipe.execute()
        gone = [i for i, m in zip(ids, raw) if m is None]
        if gone:                                  # expired: the index forgets them
            await self.redis.zrem(self.index(owner), *gone)
        return [json.loads(m) if m is not None else None for m in raw]


def created_us() -> int:
    """An index score: creation time in µs (exact in a zset's double), so objects made within
    the same second still sort by when they were made."""
    return time.time_ns() // 1000


async def page(redis: aioredis.Redis, index: str, after: str | None, limit: int, load, keep=lambda obj: True
               ) -> tuple[list[dict], bool]:
    """One page of an owner's index (zset id -> created_us()), newest first, after `after`."""
    start = 0
    if after:
        rank = await redis.zrevrank(index, after)
        start = 0 if rank is None else rank + 1
    out: list[dict] = []
    while len(out) <= limit:
        ids = [as_str(i) for i in await redis.zrevrange(index, start, start + 2 * limit)]
        if not ids:
            break
        start += len(ids)
        out += [obj for obj in await load(ids) if obj is not None and keep(obj)]
    return out[:limit], len(out) > limit

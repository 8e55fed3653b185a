"""Everything the gateway writes to Redis about a request: submit, cancel, attach, leases, orphans.

* submit, ONE round trip before `accepted`: a Lua script on slot {q} checks the per-key rate
  limit (`p:{q}:rate:<key>:<minute>`), takes the per-key concurrency lease
  (`p:{q}:conc:<key>`, zset rid -> expiry ms) and XADDs the request entry, or returns a typed
  refusal; pipelined with it (other slots, independent of the result): the request's meta hash
  (`key`, `gw`) and this gateway's `reqs` set. A refused submit removes those again (rare path).
* the concurrency lease is held until the REQUEST ends: the worker's final commit releases it
  (ZREM), not the socket's close; this gateway refreshes the leases of requests it serves, and
  releases one itself only when it ends a request that no worker will (cancel fallback).
* cancel: the worker owning a request (meta.owner) reads its own control stream between steps,
  so a cancel is routed there; the flag `p:{r:<rid>}:cancel` covers a request not yet taken.
* attach (resume): meta.gw = this gateway and HINCRBY meta.att in one MULTI on slot {r:rid},
  then an `attach` control to the owner, which answers with an `att` marker in our inbox; when
  the request was another gateway's, a `moved` notice into THAT gateway's inbox (only if it still
  exists: NOMKSTREAM), so a socket of it still holding the request ends it `resumed_elsewhere`.
* orphans: a socket that drops parks its unfinished requests as "rid|att" in `p:{reg}:orphans`
  with a deadline; whichever replica's sweeper pops one cancels it unless meta.att moved (a
  resume happened meanwhile), so the grace works across replicas and survives the parker. The
  check and the cancel are ONE script on {r:rid} (`ORPHAN_CANCEL`), which also marks meta
  `orph`: a resume's attach (one MULTI on the same slot) lands either before it (not cancelled)
  or after it, and then sees the mark (an idempotent re-send restarts the request instead of
  attaching to a cancelled one, gateway.request_core). Read-then-cancel in two steps cancelled
  a request re-attached in between (issue 34).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from shared.errors import ErrorCode, ProtocolError
from shared.events import HISTORY_TYPES, HistoryEvent, Moved, decode_event
from shared.streams import (ENTRY_FIELD, INBOX_MAXLEN, META_ATT, META_BG, META_GW, META_KEY, META_ORPHANED, META_OWNER,
                            META_TOOLS, Keys, RequestEntry, as_str, encode_attach, encode_cancel, pack_event_list)

log = logging.getLogger("gateway.submit")

CTL_MAXLEN = 10000

# KEYS: rate, conc, requests[, idem]. ARGV: rate_per_min, concurrency, lease_ms, rid, entry, maxlen,
# idem_ttl_s, replaces. Returns "ok", "rate_limited", "concurrency_limit", or "dup:<rid>" when the idempotency
# key (KEYS[4]) already started request <rid>: then nothing is counted, leased or queued. `replaces` (or ''):
# the request the key named, cancelled as an orphan: this one takes the key over (a re-send restarting it).
SUBMIT_LUA = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local rate, conc, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if conc > 0 and redis.call('ZSCORE', KEYS[2], ARGV[4]) then return 'ok' end  -- a retried submit
if KEYS[4] then
  local first = redis.call('GET', KEYS[4])
  if first then
    if first == ARGV[4] then return 'ok' end  -- our own submit, retried after a lost reply
    if first ~= ARGV[8] then return 'dup:' .. first end
  end
end
if rate > 0 then
  local n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('EXPIRE', KEYS[1], 120) end
  if n > rate then return 'rate_limited' end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[2]) >= conc then return 'concurrency_limit' end
  redis.call('ZADD', KEYS[2], now_ms + lease, ARGV[4])
  redis.call('PEXPIRE', KEYS[2], lease * 2)
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'd', ARGV[5])
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[4], 'EX', ARGV[7]) end
return 'ok'
"""


# KEYS: meta, cancel, out (slot {r:rid}). ARGV: att (the attach counter it was parked with; '' = any), ttl_s.
# Cancels an orphan unless it is a background response, was resumed since it was parked (meta.att moved) or has
# finished (its history ends with a final, id '...-1'): the cancel flag and meta.orph in one step. Returns the
# owner to tell ('' = none) when cancelled, else false.
ORPHAN_CANCEL = """
local att, bg = unpack(redis.call('HMGET', KEYS[1], 'att', 'bg'))
if bg then return false end
if ARGV[1] ~= '' and tonumber(att or '0') ~= tonumber(ARGV[1]) then return false end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
if #last > 0 and string.sub(last[1][1], -2) == '-1' then return false end
redis.call('SET', KEYS[2], 1, 'EX', ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'orph', 1) end
return redis.call('HGET', KEYS[1], 'owner') or ''
"""


# KEYS: a worker's registry hash, its control stream (slot {w:id}). ARGV: entry, maxlen. XADDs
# the entry only while the worker is registered, so no control stream is made again for a
# worker that has left (deregistering deletes both keys in one DEL). Returns 1 if added, else 0.
CTL_IF_REGISTERED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'd', ARGV[1])
return 1
"""


@dataclass(frozen=True)
class Attached:
    """What a resume's attach found (`Submitter.attach`)."""
    att: int                  # meta.att after this attach
    owner: str | None         # the worker running it (None: queued or finished)
    old_gw: str | None        # the gateway it streamed to before
    orphaned: bool            # an orphan sweep had cancelled it before this attach


class Submitter:
    def __init__(self, redis: aioredis.Redis, keys: Keys, gw_id: str, *, request_maxlen: int, output_ttl_s: int,
                 concurrency: int, rate_per_min: int, lease_s: float, reqs_ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.gw_id = gw_id
        self.request_maxlen = request_maxlen
        self.ttl = output_ttl_s
        self.concurrency = concurrency
        self.rate_per_min = rate_per_min
        self.lease_ms = int(lease_s * 1000)
        self.reqs_ttl_s = reqs_ttl_s   # this gateway's `reqs` set expires unless refreshed (gateway.liveness)
        self.clock = time.time      # the wall clock whose minute is the rate limit's window
        self._sha: str | None = None

    # ------------------------------------------------------------------ submit

    async def submit(self, entry: RequestEntry, *, release: list[str] = (), idem: str | None = None,
                     replaces: str = "", tool_mode: str | None = None) -> str | None:
        """Rate limit + concurrency lease + XADD in one round trip; ProtocolError when refused.
        `release`: leases of the same key that ended here and are not yet released (the
        bookkeeper's queue), released first in the same round trip. `idem`: the request's
        idempotency key (Redis key, `Keys.idem`): when it already started a request, nothing is
        queued and that request's rid is returned (None otherwise), unless it is `replaces` (an
        orphan-cancelled request a re-send restarts: the key names the new one from now on).
        `tool_mode`: how its answer is read for tool calls (kept in its meta for a resume)."""
        key_id, rid = entry.key_id, entry.rid
        minute = int(self.clock() // 60)
        lua_keys = [self.keys.rate(key_id, minute), self.keys.conc(key_id), self.keys.requests]
        if idem:
            lua_keys.append(idem)
        lua_args = [self.rate_per_min, self.concurrency, self.lease_ms, rid, entry.encode(), self.request_maxlen,
                    self.ttl, replaces]
        if self._sha is None:
            self._sha = await self.redis.script_load(SUBMIT_LUA)
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                if release and self.concurrency > 0:
                    pipe.zrem(self.keys.conc(key_id), *release)     # same slot {q}: runs first
                # execute_command: redis-py's cluster pipeline refuses its evalsha() helper, but
                # routes a raw EVALSHA by its keys like any other command
                pipe.execute_command("EVALSHA", self._sha, len(lua_keys), *lua_keys, *lua_args)
                meta = {META_KEY: key_id, META_GW: self.gw_id}
                if tool_mode:
                    meta[META_TOOLS] = tool_mode
                pipe.hset(self.keys.meta(rid), mapping=meta)
                pipe.expire(self.keys.meta(rid), self.ttl)
                pipe.sadd(self.keys.gw_reqs(self.gw_id), rid)
                pipe.expire(self.keys.gw_reqs(self.gw_id), self.reqs_ttl_s)
                results = await pipe.execute(raise_on_error=False)
            if release and self.concurrency > 0:
                results = results[1:]
            verdict = results[0]
            if isinstance(verdict, NoScriptError) and attempt == 0:   # Redis restarted without it
                self._sha = await self.redis.script_load(SUBMIT_LUA)
                continue
            break
        for r in results[1:]:
            if isinstance(r, Exception):
                verdict = r if not isinstance(verdict, Exception) else verdict
        if isinstance(verdict, Exception):
            await self._forget(rid)
            raise verdict
        verdict = as_str(verdict)
        if verdict == "ok":
            return None
        await self._forget(rid)
        if verdict.startswith("dup:"):
            return verdict[4:]
        if verdict == "rate_limited":
            retry = 60 - int(self.clock()) % 60
            raise ProtocolError(ErrorCode.RATE_LIMITED,
                                f"rate limit of {self.rate_per_min} requests/min reached; retry in {retry}s")
        raise ProtocolError(ErrorCode.CONCURRENCY_LIMIT, f"{self.concurrency} requests of this key are already running")

    def idem_key(self, owner: str, idempotency_key: str) -> str:
        """The Redis key naming what `idempotency_key` started for `owner` (hashed: bounded, and
        the client's key is not stored)."""
        return self.keys.idem(owner, hashlib.sha256(idempotency_key.encode()).hexdigest())

    async def _forget(self, rid: str) -> None:
        """A refused (or failed) submit leaves no meta and no membership behind."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.meta(rid))
                pipe.srem(self.keys.gw_reqs(self.gw_id), rid)
                await pipe.execute()
        except (RedisError, OSError):
            pass  # meta expires by itself; a stale reqs member is skipped at takeover

    # ------------------------------------------------------------------ leases

    async def end_requests(self, releases: dict[str, set[str] | list[str]], left: list[str]) -> None:
        """Requests that ended on this replica: release their concurrency leases ({key_id: rids};
        the worker does too, with the final event; a request ended here by a cancel or a stall
        has no worker release at all; ZREM twice is harmless) and take `left` out of this
        gateway's `reqs` set. One round trip for the whole batch."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if self.concurrency > 0:
                for key_id, rids in releases.items():
                    if rids:
                        pipe.zrem(self.keys.conc(key_id), *rids)
            if left:
                pipe.srem(self.keys.gw_reqs(self.gw_id), *left)
            await pipe.execute()

    async def refresh_leases(self, held: dict[str, list[str]]) -> None:
        """Extend the leases of unfinished requests served by this replica (XX: never re-add one
        the worker already released)."""
        if self.concurrency <= 0 or not held:
            return
        deadline = int(time.time() * 1000) + self.lease_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, rids in held.items():
                if rids:
                    pipe.zadd(self.keys.conc(key_id), {rid: deadline for rid in rids}, xx=True)
                    pipe.pexpire(self.keys.conc(key_id), self.lease_ms * 2)
            await pipe.execute()

    # ------------------------------------------------------------------ requests this replica serves

    # ------------------------------------------------------------------ cancel

    async def cancel(self, rid: str) -> str | None:
        """Set the cancel flag and route a cancel to the owning worker (if any). Returns the owner."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.cancel(rid), 1, ex=self.ttl)
            pipe.hget(self.keys.meta(rid), META_OWNER)
            _, owner = await pipe.execute()
        if owner is None:
            return None
        return await self._tell_owner(rid, as_str(owner))

    async def _tell_owner(self, rid: str, owner: str) -> str:
        """A cancel on the owning worker's control stream (it reads it between steps)."""
        await self.redis.xadd(self.keys.ctl(owner), {ENTRY_FIELD: encode_cancel(rid)},
                              maxlen=CTL_MAXLEN, approximate=True)
        return owner

    async def cancel_if_here(self, rid: str) -> bool:
        """Cancel rid unless a client resumed it on another replica meanwhile (meta.gw moved):
        a request this replica gave up on may be streaming happily elsewhere."""
        gw = await self.redis.hget(self.keys.meta(rid), META_GW)
        if gw is not None and as_str(gw) != self.gw_id:
            return False
        await self.cancel(rid)
        return True

    # ------------------------------------------------------------------ resume

    async def lookup(self, rid: str) -> dict[str, str] | None:
        """The request's meta (key, gw, owner, epoch, att), or None when nothing is retained."""
        raw = await self.redis.hgetall(self.keys.meta(rid))
        if not raw:
            return None
        return {as_str(k): as_str(v) for k, v in raw.items()}

    async def attach(self, rid: str) -> Attached:
        """Route rid's live events here from now on: meta.gw = this gateway, meta.att += 1, in one
        MULTI that also reads the owner, the previous gateway and whether an orphan sweep
        cancelled it before (meta.orph)."""
        meta = self.keys.meta(rid)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(meta, META_GW)
            pipe.hset(meta, META_GW, self.gw_id)
            pipe.hincrby(meta, META_ATT, 1)
            pipe.hmget(meta, [META_OWNER, META_ORPHANED])
            pipe.expire(meta, self.ttl)
            old_gw, _, att, (owner, orphaned), _ = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(self.keys.gw_reqs(self.gw_id), rid)
            pipe.expire(self.keys.gw_reqs(self.gw_id), self.reqs_ttl_s)
            old_gw = as_str(old_gw) if old_gw is not None else None
            if old_gw and old_gw != self.gw_id:
                pipe.srem(self.keys.gw_reqs(old_gw), rid)
                # a gone gateway's inbox is not made again (it would never expire)
                pipe.xadd(self.keys.inbox(old_gw), {ENTRY_FIELD: pack_event_list([Moved(rid, int(att)).encode()])},
                          maxlen=INBOX_MAXLEN, approximate=True, nomkstream=True)
            await pipe.execute()
        owner = as_str(owner) if owner is not None else None
        if owner:
            await self.send_attach(rid, owner, int(att))
        return Attached(int(att), owner, old_gw, orphaned is not None)

    async def send_attach(self, rid: str, owner: str, att: int) -> None:
        await self.redis.xadd(self.keys.ctl(owner),
                              {ENTRY_FIELD: encode_attach(rid, self.gw_id, att)},
                              maxlen=CTL_MAXLEN, approximate=True)

    async def to_registered_worker(self, worker_id: str, entry: bytes) -> bool:
        """A control entry for a worker that is still registered (False: it is not)."""
        return bool(await self.redis.eval(CTL_IF_REGISTERED, 2, self.keys.worker(worker_id), self.keys.ctl(worker_id),
                                          entry, CTL_MAXLEN))

    async def owner(self, rid: str) -> str | None:
        owner = await self.redis.hget(self.keys.meta(rid), META_OWNER)
        return as_str(owner) if owner is not None else None

    async def read_history(self, rid: str, after_seq: int) -> list[HistoryEvent]:
        """Every event of rid's history after token `after_seq` (token events and the final)."""
        # token events are `{seq}-0`, the final `{seq}-1`: from `{after}-1` on is exactly "after"
        entries = await self.redis.xrange(self.keys.out(rid), min=f"{after_seq}-1", max="+")
        if not entries and after_seq:
            # nothing after it: a resume past the end of a finished output gets the final all
            # the same (the join answers it), not a wait for tokens that will never come
            entries = [e for e in await self.redis.xrevrange(self.keys.out(rid), count=1) if as_str(e[0]).endswith("-1")]
        events = (decode_event(fields[ENTRY_FIELD]) for _, fields in entries)
        return [ev for ev in events if isinstance(ev, HISTORY_TYPES)]

    # ------------------------------------------------------------------ orphans

    async def park_orphans(self, items: list[tuple[str, int]], grace_s: float) -> None:
        """Requests nobody listens to: cancelled after `grace_s` unless resumed (att moves)."""
        if not items:
            return
        deadline = time.time() + grace_s
        await self.redis.zadd(self.keys.orphans, {f"{rid}|{att}": deadline for rid, att in items})

    async def sweep_orphans(self, limit: int = 200) -> list[str]:
        """Cancel parked requests whose grace is over and that nobody re-attached. Returns them."""
        due = await self.redis.zrangebyscore(self.keys.orphans, "-inf", time.time(), start=0, num=limit)
        cancelled = []
        for member in due:
            if not await self.redis.zrem(self.keys.orphans, member):
                continue  # another replica took it
            rid, _, att = as_str(member).rpartition("|")
            if await self.cancel_orphan(rid, int(att)):
                cancelled.append(rid)
        return cancelled

    async def mark_background(self, rid: str) -> None:
        """rid runs with nobody listening (a background response): no orphan sweep cancels it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.meta(rid), META_BG, "1")
            pipe.expire(self.keys.meta(rid), self.ttl)
            await pipe.execute()

    async def cancel_orphan(self, rid: str, att: int | None = None) -> bool:
        """Cancel an orphan unless it is a background response, has finished, or was resumed
        since it was parked with attach counter `att` (None: whatever it is), in one script
        (`ORPHAN_CANCEL`). Returns whether it was cancelled."""
        owner = await self.redis.eval(ORPHAN_CANCEL, 3, self.keys.meta(rid), self.keys.cancel(rid), self.keys.out(rid),
                                      "" if att is None else att, self.ttl)
        if owner is None:
            return False
        if owner:
            await self._tell_owner(rid, as_str(owner))
        return True

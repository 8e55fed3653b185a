"""Who runs a request: `meta.owner` and its lease, decided in Redis, atomically with the epoch.

Why its own module: a request must end exactly once with no work done twice, so exactly one
worker may run it at a time, and that has to hold when workers pause (SIGSTOP, a long GC, a VM
freeze), die, or get an entry delivered that another worker has since claimed. The decision is
one Lua script on the request's slot `{r:rid}`, with Redis's own clock (`TIME`), so worker
clocks never matter. Meta ownership is the single source of truth; the consumer group's
pending list (PEL) follows it (worker.leases' keep-fresh).

* take (`TAKE`): a worker becomes the owner only if the request is unowned, already its own,
  or its owner's lease has lapsed; then, in the same script, it sets `owner` and a new lease,
  bumps `epoch` (which fences off every earlier writer, see worker.output_writer) and reads
  what it needs to run it (gw, att, the cancel flag, the history). A request whose history
  already ends with a final is not taken at all (nothing left to run; only its ack may be
  missing). A live lease of another worker is answered with that owner and its deadline, and
  nothing is written.
* keep (`KEEP`): in every keep-fresh round the owner extends its lease (only while `owner` is
  still itself at its epoch), renews the meta TTL and reads the cancel flag; a moved epoch
  tells it the request was taken over.
* release (`RELEASE`): hand back (drain, dead engine) clears owner and lease, only while they
  are still ours at our epoch.

The lease (`lease_ms`): `WORKER_TTL_S - WORKER_HEARTBEAT_S` (1.5 s by default), at least two
keep-fresh intervals. A worker's last lease refresh comes at most one heartbeat interval after
its last heartbeat, so by the time survivors judge a dead owner dead (no heartbeat for
WORKER_TTL_S) its leases have lapsed; a live owner refreshes every keep-fresh interval (0.5 s),
so its lease survives a stall of a whole interval or more.

The owner's own view of its lease (`lease_until`, on its monotonic clock): what Redis says
holds for Redis, but a worker acts on its belief, and a stalled round trip stretches any belief
taken from a reply. So each take and each keep tells the worker the deadline
`sent + lease_ms`, counted from when the script was SENT: Redis ran it no earlier, so its lease
ends no earlier, however long the reply took (a Redis paused past the lease, a slow network).
A worker writes a request's output only before that deadline (worker.output_writer); past it,
unrenewed, it holds the output until a keep confirms that it still owns the request (epoch
unchanged: nobody took it meanwhile, since a take bumps the epoch) or tells it that it lost it.
The epoch fence in Redis refuses a stale writer anyway; the deadline makes the worker stop by
itself, on its own clock, instead of counting on being refused.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Iterable

from redis.exceptions import ConnectionError as RedisConnectionError, NoScriptError

from shared.config import Settings
from shared.events import HistoryEvent, decode_event
from shared.streams import ENTRY_FIELD, Keys, as_str
from worker.events import InFlight
from worker.redis_io import TRANSIENT

# KEYS: meta, out, cancel (slot {r:rid}). ARGV: worker, lease_ms, ttl_s, key_id, gw, whole ('1': return the
# whole history, '0': only its last event).
# Returns {'FINISHED'} (the history ends with a final: nothing written), {'HELD', owner, remaining_ms,
# deadline_ms} (another worker's lease is alive: nothing written), or {'TAKEN', epoch, gw, att, cancelled,
# history}. A final event's history id ends in '-1' (shared.streams.history_id). An owner without a lease
# (written by a worker from before leases) counts as lapsed.
TAKE = """
local meta, out = KEYS[1], KEYS[2]
local last = redis.call('XREVRANGE', out, '+', '-', 'COUNT', 1)
if #last > 0 and string.sub(last[1][1], -2) == '-1' then return {'FINISHED'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = redis.call('HGET', meta, 'owner')
if owner and owner ~= ARGV[1] then
  local lease = tonumber(redis.call('HGET', meta, 'lease') or '0') or 0
  if lease > now then return {'HELD', owner, lease - now, lease} end
end
redis.call('HSET', meta, 'owner', ARGV[1], 'lease', now + tonumber(ARGV[2]))
redis.call('HSETNX', meta, 'key', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSETNX', meta, 'gw', ARGV[5]) end
local epoch = redis.call('HINCRBY', meta, 'epoch', 1)
local gw_att = redis.call('HMGET', meta, 'gw', 'att')
redis.call('EXPIRE', meta, ARGV[3])
local cancelled = redis.call('EXISTS', KEYS[3])
local history = last
if ARGV[6] == '1' then history = redis.call('XRANGE', out, '-', '+') end
return {'TAKEN', epoch, gw_att[1], gw_att[2], cancelled, history}
"""

# KEYS: meta, cancel. ARGV: worker, epoch, lease_ms, ttl_s. Returns -1 when meta.epoch is not ARGV[2] any more
# (another worker took the request over), else the cancel flag (0/1), plus 2 when the lease was extended, or
# plus 4 when Redis refused to extend it. Extends the lease only while `owner` is still this worker (after the
# final, or for an ack-only request, it is not: nothing to extend). Writes go through pcall: a Redis refusing
# writes (OOM) still answers, and the lease then simply is not extended (reported as refused).
KEEP = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return -1 end
local extended = 0
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local t = redis.call('TIME')
  local r = redis.pcall('HSET', KEYS[1], 'lease', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3]))
  if type(r) == 'table' and r.err then extended = 4 else extended = 2 end
end
redis.pcall('EXPIRE', KEYS[1], ARGV[4])
return redis.call('EXISTS', KEYS[2]) + extended
"""

# KEYS: meta. ARGV: worker, epoch. Clears owner and lease if they are still this worker's at this epoch.
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] and redis.call('HGET', KEYS[1], 'epoch') == ARGV[2] then
  return redis.call('HDEL', KEYS[1], 'owner', 'lease')
end
return 0
"""


@dataclass
class Taken:
    """We own the request now, at `epoch`."""
    epoch: int
    gw: str                  # meta.gw: where live events go
    att: int                 # meta.att: > 0 once someone resumed it (an attach marker goes first)
    cancelled: bool
    history: list[HistoryEvent]   # its events, oldest first (only the last one unless the whole was asked for)
    lease_until: float = float("inf")   # time.monotonic() until which our lease surely holds (sent + lease)


@dataclass(frozen=True, slots=True)
class Kept:
    """One request's answer to a keep-fresh round (`Ownership.keep`)."""
    taken_over: bool              # its epoch moved on: another worker took it over
    cancelled: bool               # its cancel flag is set
    lease_until: float | None     # extended: time.monotonic() until which it surely holds (sent + lease); None: not
    refused: bool = False         # Redis answered but refused to extend it (it refuses writes: OOM)


@dataclass
class Held:
    """Another worker owns it and its lease is alive; nothing was written."""
    owner: str
    remaining_ms: int
    deadline_ms: int         # on Redis's clock


@dataclass
class Finished:
    """Its history already ends with a final event; nothing was written (only its ack may be missing)."""


def keep_fresh_interval(settings: Settings) -> float:
    """How often an owner refreshes its entries and leases (worker.leases' keep-fresh)."""
    return max(0.1, min(settings.worker_heartbeat_s, settings.claim_idle_ms / 3000))


def lease_ms(settings: Settings) -> int:
    """How long an owner's claim holds after each refresh (see the module docstring)."""
    return int(1000 * max(settings.worker_ttl_s - settings.worker_heartbeat_s, 2 * keep_fresh_interval(settings)))


class _Script:
    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class Ownership:
    def __init__(self, redis, keys: Keys, settings: Settings, worker_id: str):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.lease_ms = lease_ms(settings)
        self.interval = keep_fresh_interval(settings)
        self._take, self._keep, self._release = _Script(TAKE), _Script(KEEP), _Script(RELEASE)

    async def take(self, rid: str, *, key_id: str = "", gw: str = "", whole_history: bool = True
                   ) -> Taken | Held | Finished:
        k = self.keys
        sent = time.monotonic()
        reply = await self._call(self._take, [k.meta(rid), k.out(rid), k.cancel(rid)],
                                 [self.worker_id, self.lease_ms, self.settings.output_ttl_s, key_id, gw,
                                  int(whole_history)])
        kind = as_str(reply[0])
        if kind == "FINISHED":
            return Finished()
        if kind == "HELD":
            return Held(as_str(reply[1]), int(reply[2]), int(reply[3]))
        _, epoch, meta_gw, att, cancelled, raw_history = reply
        return Taken(epoch=int(epoch), gw=as_str(meta_gw) if meta_gw else "", att=int(att or 0),
                     cancelled=bool(cancelled),
                     history=[ev for ev in map(_event, raw_history) if ev is not None],
                     lease_until=sent + self.lease_ms / 1000)

    async def keep(self, states: list[InFlight]) -> list[Kept]:
        """One keep-fresh round for `states`, one `Kept` each. A request whose script failed (not
        transiently) counts as kept, its lease not extended."""
        if not states:
            return []
        k, s = self.keys, self.settings
        sent = time.monotonic()     # before the round trip: Redis extends no earlier than this
        replies = await self._pipelined(self._keep, [
            ([k.meta(st.rid), k.cancel(st.rid)], [self.worker_id, st.epoch, self.lease_ms, s.output_ttl_s])
            for st in states])
        until = sent + self.lease_ms / 1000
        return [Kept(False, False, None) if isinstance(r, Exception) else
                Kept(int(r) < 0, int(r) > 0 and bool(int(r) & 1), until if int(r) > 0 and int(r) & 2 else None,
                     int(r) > 0 and bool(int(r) & 4)) for r in replies]

    def release_in(self, pipe, states: Iterable[InFlight]) -> None:
        """Queue RELEASE for `states` on `pipe` (hand back; the script must be loaded: `load()`)."""
        for st in states:
            pipe.execute_command("EVALSHA", self._release.sha, 1, self.keys.meta(st.rid), self.worker_id, st.epoch)

    async def load(self) -> None:
        for script in (self._take, self._keep, self._release):
            await self.redis.script_load(script.source)

    # ---- plumbing ---------------------------------------------------------------------------

    async def _call(self, script: _Script, keys: list, args: list):
        try:
            return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:       # a new Redis (restarted, failed over): load it, once
            await self.redis.script_load(script.source)
            return await self.redis.evalsha(script.sha, len(keys), *keys, *args)

    async def _pipelined(self, script: _Script, calls: list[tuple[list, list]]) -> list:
        """One pipeline (no MULTI: each call is on its own slot) of `script` calls; each reply or
        the exception that refused it. Transient errors raise (the caller retries). The scripts
        are idempotent, so a pipeline that found them gone (a new Redis) is sent again once loaded."""
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    # a raw EVALSHA: redis-py's cluster pipeline refuses its evalsha() helper
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
            for r in replies:
                if isinstance(r, TRANSIENT):
                    raise r
            if not any(isinstance(r, NoScriptError) for r in replies):
                return replies
            await self.load()
        raise RedisConnectionError("the ownership scripts keep disappearing from Redis (restarting?)")


def _event(entry: list) -> HistoryEvent | None:
    """A history entry as a script returns it ([id, [field, value, ...]]) -> its event (None: a
    kind this version does not know)."""
    fields = entry[1]
    for i in range(0, len(fields) - 1, 2):
        if as_str(fields[i]) == ENTRY_FIELD.decode():
            return decode_event(fields[i + 1])
    raise ValueError(f"history entry {entry[0]!r} has no {ENTRY_FIELD!r} field")

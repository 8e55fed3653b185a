"""Everything a worker writes about a request's output, and the ONE commit that ends a request.

Why one module: "events, then ack, then lease, then owner" used to be written three times
(normal finish, finish-before-run, dead letter), each a little different. Here `commit()` is the
only place that writes output, and the only place that acknowledges a request.

What a commit writes, in this order (the Lua is worker.history_scripts):
1. history: per request its frozen events in order, through the FENCED history script: per
   request it writes only if `meta.epoch` is still the epoch this worker got when it took the
   request. A worker presumed dead (a long pause, a partition, SIGSTOP) whose request was
   claimed by another worker (which bumped the epoch) is refused atomically, in Redis; it then
   drops the request (`on_fenced`) without acking it. An id already in the stream counts as
   written only if the entry there is byte-identical (our own retry after a lost reply);
   anything else is a conflict, never a silent success. EXPIRE on this run's first write and
   at the final, which also removes `owner` and its `lease` from meta (worker.ownership).
2. live: per gateway ONE inbox entry whose `d` is the list of all its events that step 1
   confirmed (attach markers first). Live therefore never runs ahead of history, and a fenced
   writer's events never reach a client even before the gateway sees the newer epoch.
   Gateways de-duplicate by seq. Before it, the concurrency lease (`p:{q}:conc:<key_id>`, ZREM)
   of every request whose final step 1 confirmed is released: a gateway sends `done` without
   waiting on Redis, and a client that receives it may start its next request at once, on any
   gateway, so its slot must be free before the final can reach any gateway.
3. the ack (XACK of the request entry, ZREM of the lease, the dead-letter XADD) of every
   request whose final is in history: never before its final.

How many round trips that takes:
* A single Redis (no slots enforced): ONE. Each `HISTORY_AND_LIVE` call does 1-3 for up to
  HISTORY_BATCH requests, all calls in one pipeline; only a dead letter (or an ack a lost
  connection kept back) takes a MULTI after it. One round trip is what a first token waits
  for between the engine and the gateway (bench/fanout.py's `deliver`).
* Where Redis enforces slots (a cluster client, or a node in cluster mode: a script's keys must
  share a slot): one `HISTORY_APPEND` call a request ({r:rid}), all in one pipeline; then one
  pipeline of lease releases and inbox XADDs (a live copy lost to a connection error is re-sent
  with the next commit); then, only when finals were confirmed, one MULTI on slot {q} with the
  acks. (On a cluster the lease and the inbox live on different nodes and may land in either
  order; the ack releases the lease again.)
Batching requests into calls matters at GPU speed: a commit writes every request with news, and
redis-py spends ~10 µs of client CPU per command in a pipeline however small it is.

Ownership deadline: a request is written only while this worker's lease on it surely holds
(`InFlight.may_write`: before the deadline its last take or keep-fresh round set, counted from
when that round was sent; worker.ownership). Past it, unrenewed (Redis stalled longer than the
lease, or this process was starved), its events and markers stay queued, not refused and not
dropped, and keep-fresh is asked to renew at once (`on_lapsed`); a renewal lets them go out, a
takeover drops the request. So a worker never emits for a request it cannot be sure it owns. A
lease Redis answered it would not extend (refusing writes) counts as a refused write (below).

Failures: a transient error (connection lost) raises, nothing is dropped, the caller retries
with backoff (a retried history write is idempotent, a retried live copy de-duplicated). A
request whose write Redis refuses (e.g. OOM under `maxmemory` + `noeviction`)
keeps its events queued and is retried with backoff; after `MAX_WRITE_FAILURES` refusals it
is given up: the engine stops it, and a final retryable `output_write_failed` error is queued
behind its tokens, so when Redis accepts writes again the client gets every token and a typed
end, and the request is acked and its lease released. A request's new tokens are written at
most every WORKER_FLUSH_MS (its first token, its final and attach markers at once): the engine
delivers them at that pace (worker.engine_thread) and the writer loop (`run`) commits each
delivery; WORKER_FLUSH_MS=0 writes after every engine step.

The writer's client has no per-reply socket timeout: redis-py arms one asyncio timer per reply
it reads, which cost about as much client CPU as the rest of a pipelined script call, and a
commit reads one reply per script call. Instead one deadline (`ROUND_TRIP_TIMEOUT_S`) bounds each
round trip; when it passes, the connection is dropped and the round trip fails as transient,
exactly like a socket timeout (a history write whose reply was lost is retried idempotently).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, Iterable

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError, NoScriptError, ResponseError

from shared.config import Settings
from shared.aio import wait_event
from shared.errors import ErrorCode
from shared.events import AttachMarker
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, INBOX_MAXLEN, Keys, as_str, pack_event_list
from shared.logs import rid_of
from worker.engine import StepOutput
from worker.events import InFlight
from worker.failover import DEAD_MAXLEN
from worker.history_scripts import HISTORY_AND_LIVE, HISTORY_APPEND, fused_call, history_call
from worker.redis_io import TRANSIENT, count_error

log = logging.getLogger("worker.output")

MAX_WRITE_FAILURES = 8           # refused writes (with backoff, ~5 s) before a request is given up
INBOX_TTL_REFRESH_S = 30.0       # how often an inbox we write to gets its TTL renewed
ROUND_TRIP_TIMEOUT_S = 10.0      # one commit round trip (its client has no per-reply timeout)
LAPSE_RECHECK_S = 0.02           # WORKER_FLUSH_MS=0: a request held for its lease is looked at again after this

# requests per history script call on a single Redis. Each call writes one inbox entry per gateway,
# and a gateway's blocked XREAD is answered after the first call, so a flush split over calls
# reaches a gateway as that many reads and wake-ups (at 256 streams, one call of 256 instead of
# two of 128 cost the gateway 0.83x the CPU per token: bench/RESULTS.md). A call holds Redis
# ~10-13 µs a request (~3.5 ms at 256); the calls of one pipeline run back to back anyway.
HISTORY_BATCH = 512

def fenced(exc: Exception) -> bool:
    """The history script refused: the request's epoch moved on (another worker owns it)."""
    return str(exc).startswith("FENCED")


class DeadLetter:
    """An entry that goes to `p:{q}:dead` in the same MULTI as its ack."""

    def __init__(self, entry_id: str, fields: dict):
        self.entry_id = entry_id
        self.fields = fields


class OutputWriter:
    def __init__(self, redis, keys: Keys, settings: Settings, worker_id: str, *, paced: bool = False,
                 on_give_up: Callable[[InFlight], None] = lambda st: None,
                 on_done: Callable[[list[InFlight]], None] = lambda done: None,
                 on_fenced: Callable[[InFlight], None] = lambda st: None,
                 on_commit: Callable[[float, int], None] = lambda seconds, requests: None,
                 on_lapsed: Callable[[InFlight], None] = lambda st: None):
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.paced = paced                    # the engine delivers at WORKER_FLUSH_MS already (`run`)
        self.on_give_up = on_give_up
        self.on_done = on_done                # called with the requests a commit completed
        self.on_fenced = on_fenced            # called with a request another worker took over
        self.on_commit = on_commit            # (seconds, requests) of each commit (metrics)
        self.on_lapsed = on_lapsed            # called with a request whose lease passed its deadline unrenewed
        self._live_backlog: dict[str, list[bytes]] = {}   # live copies a connection error kept back
        self.lock = asyncio.Lock()            # one commit at a time: events of a request stay in order
        self._sha: str | None = None          # the loaded history script (None: load it, and learn the mode)
        self._fused = False                   # HISTORY_AND_LIVE (one round trip) vs HISTORY_APPEND + live + ack
        self._slots = False                   # Redis enforces slots (learnt once, or from a CROSSSLOT refusal)
        self._per_call = HISTORY_BATCH         # requests per history script call (1 where slots are enforced)
        self._inbox_ttl_at: dict[str, float] = {}
        self.stats = {"commits": 0, "events": 0, "refused": 0, "given_up": 0, "fenced": 0, "lease_lapses": 0}

    # ---- the commit -------------------------------------------------------------------------

    async def commit(self, states: Iterable[InFlight], dead_letters: Iterable[DeadLetter] = ()) -> list[InFlight]:
        """Write the queued events of `states`; ack + release the lease of those whose final is
        now in history (and dead-letter `dead_letters` with their ack). Returns the requests
        that are completely done. Raises transient Redis errors (nothing is lost)."""
        async with self.lock:
            states = list(states)
            started = time.perf_counter()
            done = await self._commit(states, list(dead_letters))
            self.on_commit(time.perf_counter() - started, len(states))
            return done

    async def _commit(self, states: list[InFlight], dead_letters: list[DeadLetter]) -> list[InFlight]:
        now = time.monotonic()
        states = [st for st in states if not st.fenced]
        for st in states:
            st.freeze()
        held = [st for st in states if not st.may_write(now) and (st.unsent or st.marker_att is not None)]
        self.mark_lapsed(held, now)         # their output is held; keep-fresh renews the leases now
        for st in held:
            self.on_lapsed(st)
            # Redis answered but refused to extend the lease: as good as a refused write
            if st.lease_refused and st.retry_at <= now:
                self._refused(st, ResponseError("OOM Redis refused to extend this request's lease"), now)
        writing = [(st, list(st.unsent)) for st in states if st.unsent and st.retry_at <= now and st.may_write(now)]
        # attach markers are built before the history write: "everything <= S is in history"
        markers = {st.rid: st.marker() for st in states if st.gw and st.marker_att is not None and st.may_write(now)}
        if self._sha is None:
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                await self._load_script()
        if self._fused:     # one round trip: history, live and acks in one script
            if markers:     # a marker with nothing to write rides along (its request is fenced there too)
                busy = {st.rid for st, _ in writing}
                writing += [(st, []) for st in states if st.rid in markers and st.rid not in busy]
            if writing or self._live_backlog:
                self._settle(writing, await self._write_history(writing, markers), now)
        else:
            confirmed = self._settle(writing, await self._write_history(writing), now) if writing else {}
            live: dict[str, list[bytes]] = {}
            for st in states:   # per gateway: markers first, then what this commit confirmed
                if st.gw and not st.fenced and (st.rid in markers or st.rid in confirmed):
                    events = live.setdefault(st.gw, [])
                    if st.rid in markers:
                        events.append(markers[st.rid])
                    events.extend(f.payload for f in confirmed.get(st.rid, ()))
            ended = [st for st in states if st.final_written and st.rid in confirmed and st.key_id]
            if live or self._live_backlog or ended:
                await self._write_live(live, ended)
        for st in states:
            if st.rid in markers:
                st.marker_att = None
        done = [st for st in states if st.final_written]
        unacked = [st for st in done if not st.acked]
        if unacked or dead_letters:
            await self._ack(unacked, dead_letters)
        if done:
            self.on_done(done)
        self.stats["commits"] += 1
        return done

    def _settle(self, writing: list, results: list, now: float) -> dict[str, list]:
        """Each request's history reply: confirm its events (and note the ack the script made),
        or fence it, or count a refusal. Returns the confirmed events by rid."""
        confirmed: dict[str, list] = {}
        for (st, frozen), result in zip(writing, results):
            if isinstance(result, Exception) and fenced(result):
                self._fence(st, result)
            elif not frozen:
                continue            # only a marker rode along: nothing was to be written
            elif isinstance(result, Exception):
                self._refused(st, result, now)
            else:
                st.confirm(frozen)
                confirmed[st.rid] = frozen
                self.stats["events"] += len(frozen)
                if self._fused and frozen[-1].final and not st.dead_letter:
                    st.acked = True     # HISTORY_AND_LIVE acked it with its final
        return confirmed

    async def _load_script(self) -> None:
        """Learn whether Redis enforces slots and load the history script that fits."""
        self._slots = self._slots or await self._slots_enforced()
        self._fused = not self._slots
        self._per_call = 1 if self._slots else HISTORY_BATCH
        self._sha = await self.redis.script_load(HISTORY_APPEND if self._slots else HISTORY_AND_LIVE)

    async def _write_history(self, writing: list, markers: dict[str, bytes] | None = None) -> list:
        """The history script for every request in `writing`: up to HISTORY_BATCH requests per
        call (one where Redis enforces slots), all calls in one pipeline; with HISTORY_AND_LIVE
        the calls also write the inbox entries (the first carries the live backlog) and the
        acks. Returns each request's reply: how many events were added, or the exception that
        refused it."""
        calls = [writing[i:i + self._per_call] for i in range(0, len(writing), self._per_call)] or [[]]
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S), self.redis.pipeline(transaction=False) as pipe:
            for i, call in enumerate(calls):
                keys, args = (fused_call(self.keys, self.settings, self.worker_id, call, markers or {},
                                         self._live_backlog if i == 0 else {}, self._inbox_refresh)
                              if self._fused else history_call(self.keys, self.settings, self.worker_id, call))
                # a raw EVALSHA: redis-py's cluster pipeline refuses its evalsha() helper
                pipe.execute_command("EVALSHA", self._sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in replies):  # Redis restarted: load it again, retry
            self._sha = None
            raise RedisConnectionError("the history script is gone from Redis (restarted); reloading it")
        for r in replies:
            if isinstance(r, TRANSIENT):
                raise r
            if isinstance(r, ResponseError) and "CROSSSLOT" in str(r):   # the server enforces slots now
                self._slots, self._sha = True, None
                raise RedisConnectionError("Redis refused a history call across slots; one request a call from now")
        if self._fused:
            self._live_backlog = {}     # the first call took it (or Redis refused it: a resume reads the history)
        results: list = []
        for call, reply in zip(calls, replies):
            if isinstance(reply, Exception):  # the whole call was refused (e.g. OOM before it ran)
                results += [reply] * len(call)
                continue
            if self._fused:
                reply, refused = reply
                for err in refused:
                    log.warning("inbox write refused: %s", as_str(err))
            for (st, frozen), r in zip(call, reply):
                if isinstance(r, bytes):
                    results.append(ResponseError(r.decode(errors="replace")))
                else:
                    st.ttl_set = st.ttl_set or bool(frozen)    # (a marker alone wrote no history to expire)
                    results.append(r)
        return results

    def _inbox_refresh(self, gw: str) -> bool:
        """Whether this write to gateway `gw`'s inbox renews its TTL (every INBOX_TTL_REFRESH_S)."""
        now = time.monotonic()
        if now - self._inbox_ttl_at.get(gw, 0.0) > INBOX_TTL_REFRESH_S:
            self._inbox_ttl_at[gw] = now
            return True
        return False

    async def _slots_enforced(self) -> bool:
        """Whether a script's keys must share a slot: a cluster client, or a plain client talking
        to a node that runs in cluster mode."""
        if isinstance(self.redis, RedisCluster):
            return True
        info = await self.redis.info("cluster")
        return str(info.get("cluster_enabled", 0)) == "1"

    async def _write_live(self, live: dict[str, list[bytes]], ended: list[InFlight] = ()) -> None:
        """One inbox XADD per gateway, after releasing the leases of the requests in `ended`
        (their final is in history now). A connection error keeps the copies for the next commit
        (history already has them); a refusal (OOM) drops them: a resume reads the history."""
        for gw, payloads in live.items():
            self._live_backlog.setdefault(gw, []).extend(payloads)
        backlog = self._live_backlog
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S), self.redis.pipeline(transaction=False) as pipe:
            for st in ended:
                pipe.zrem(self.keys.conc(st.key_id), st.rid)
            for gw, payloads in backlog.items():
                inbox = self.keys.inbox(gw)
                pipe.xadd(inbox, {ENTRY_FIELD: pack_event_list(payloads)}, maxlen=INBOX_MAXLEN, approximate=True)
                if self._inbox_refresh(gw):
                    pipe.expire(inbox, self.settings.output_ttl_s)
            results = await pipe.execute(raise_on_error=False)
        for r in results:
            if isinstance(r, TRANSIENT):
                raise r
        self._live_backlog = {}
        for r in results:
            if isinstance(r, Exception):
                log.warning("inbox write refused: %s", r)

    def _fence(self, st: InFlight, exc: Exception) -> None:
        """Another worker took the request over (its epoch is newer): stop here, write nothing
        more, do not ack it; the new owner continues from what the history holds."""
        st.fenced = True
        self.stats["fenced"] += 1
        log.warning("request %s was taken over by another worker (%s); dropping it here", st.rid, exc,
                    extra=rid_of(st.rid))
        self.on_fenced(st)

    def mark_lapsed(self, held: list[InFlight], now: float) -> None:
        """Our leases on `held` passed their deadlines unrenewed: hold their output (it stays
        queued), each lapse counted once (`lease_lapses`). Keep-fresh calls it too, for a lapse
        that no commit round saw (worker.leases)."""
        new = [st for st in held if not st.lease_lapsed]
        for st in new:
            st.lease_lapsed = True
        if new:
            self.stats["lease_lapses"] += len(new)
            log.warning("%d request(s): our lease passed its deadline unrenewed (up to %.2f s ago: Redis stalled?); "
                        "holding their output until it is renewed", len(new), max(now - st.lease_until for st in new))

    def _refused(self, st: InFlight, exc: Exception, now: float) -> None:
        count_error(exc)
        st.failures += 1
        self.stats["refused"] += 1
        st.retry_at = now + random.uniform(0.5, 1.0) * min(1.0, 0.05 * 2 ** st.failures)
        if st.failures in (1, MAX_WRITE_FAILURES) or st.failures % 20 == 0:
            log.warning("redis refused the output of %s (%d times): %s", st.rid, st.failures, exc,
                        extra=rid_of(st.rid))
        if st.failures >= MAX_WRITE_FAILURES and not st.given_up:
            st.given_up = True
            self.stats["given_up"] += 1
            log.error("giving up on %s after %d refused writes: it ends with output_write_failed", st.rid,
                      st.failures, extra=rid_of(st.rid))
            self.on_give_up(st)
            st.finish_error(ErrorCode.OUTPUT_WRITE_FAILED,
                            f"Redis refused this request's output {st.failures} times ({exc}); send it again",
                            retryable=True)

    async def _ack(self, done: list[InFlight], dead_letters: list[DeadLetter]) -> None:
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S), self.redis.pipeline(transaction=True) as pipe:  # slot {q}
            for fields in [dl.fields for dl in dead_letters] + [st.dead_letter for st in done if st.dead_letter]:
                pipe.xadd(self.keys.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
            for st in done:
                if st.key_id:
                    pipe.zrem(self.keys.conc(st.key_id), st.rid)
            ids = [st.entry_id for st in done] + [dl.entry_id for dl in dead_letters]
            pipe.xack(self.keys.requests, CONSUMER_GROUP, *ids)
            await pipe.execute()

    # ---- the flush loop ---------------------------------------------------------------------

    async def run(self, take_outputs: Callable[[], list[StepOutput]], states: dict[str, InFlight],
                  wake: asyncio.Event) -> None:
        """Coalescing: step outputs are taken as they come (cheap, in memory) and written on a
        common tick every WORKER_FLUSH_MS, so all requests share one round trip per tick; first
        tokens, finals and markers do not wait for the tick.

        `paced`: the engine delivers at most every tick itself (EngineThread.pace_s), so a
        delivery within a quarter tick of the due time (the two clocks differ by the pipe's
        latency) is written whole at once, with no timer wake-up; an earlier urgent one writes
        only what is urgent, so a busy engine's first tokens and finals do not make every step
        a write of every request (the timer is the fallback for what that leaves). Transient
        errors propagate (the caller retries with backoff); nothing leaves `states` unwritten."""
        flush_s = self.settings.worker_flush_s
        early = flush_s / 4 if self.paced else 0.0
        next_tick = time.monotonic() + flush_s
        while True:
            now = time.monotonic()
            if not any(st.has_news or st.final_written for st in states.values()):
                timeout = 1.0                                   # idle: wait for the engine
            elif flush_s == 0:                                  # per step; refused writes back off
                retry = [st.retry_at if st.may_write(now) else now + LAPSE_RECHECK_S    # held: not every step
                         for st in states.values() if st.unsent or st.marker_att is not None]
                timeout = max(0.001, min(retry) - now) if retry and not wake.is_set() else 0.0
            else:
                timeout = next_tick - now
            if timeout > 0:
                await wait_event(wake, timeout)   # not wait_for: it can lose the stop's cancel (3.11)
            wake.clear()
            if queued_outputs(states) < self.settings.output_buffer_max:
                route(take_outputs(), states)   # else leave them: the engine pauses on a full buffer
            now = time.monotonic()
            if now >= next_tick - early:
                batch = [st for st in states.values() if st.has_news or st.final_written]
                next_tick = now + flush_s
            else:
                batch = [st for st in states.values() if st.urgent]
            if batch:
                await self.commit(batch)

    async def flush_all(self, take_outputs: Callable[[], list[StepOutput]], states: dict[str, InFlight]) -> None:
        """Write everything now (drain, hand back)."""
        route(take_outputs(), states)
        await self.commit(list(states.values()))

    # ---- attach (resume on another gateway) -------------------------------------------------

    async def attach(self, st: InFlight, gw: str, att: int) -> None:
        """Route rid's live events to `gw` from now on: flush what is queued, then the marker
        "everything <= S is in history" goes to the new inbox ahead of later live events.
        The switch happens under the commit lock: a commit in flight routes its live copies
        after its history write, and switching mid-way sent tokens to the new gateway ahead
        of the marker (seen on a fast CPU)."""
        async with self.lock:
            st.gw = gw
            st.marker_att = att
            await self._commit([st], [])

    async def attach_unknown(self, rid: str, gw: str, att: int) -> None:
        """This worker does not hold rid: tell the gateway to read the history to its end."""
        await self.to_inbox(gw, AttachMarker(rid, None, 0, att).encode())

    async def to_inbox(self, gw: str, event: bytes) -> None:
        """One event straight to gateway `gw`'s inbox, outside the flush (an attach marker for
        a request not held here, a tokenize reply), with the inbox's TTL: a gateway that died
        meanwhile must not be left an inbox that never expires."""
        inbox = self.keys.inbox(gw)
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(inbox, {ENTRY_FIELD: pack_event_list([event])}, maxlen=INBOX_MAXLEN, approximate=True)
                pipe.expire(inbox, self.settings.output_ttl_s)
                await pipe.execute()



def queued_outputs(states: dict[str, InFlight]) -> int:
    """Tokens and events waiting to be written (bounded like the engine's output buffer, so a
    long Redis outage pauses the engine instead of growing memory)."""
    return sum(len(st.pending.ids) + len(st.unsent) for st in states.values())


def route(outputs: list[StepOutput], states: dict[str, InFlight]) -> None:
    """Step outputs -> their request's queue. Outputs of requests no longer here (handed back,
    claimed away) or whose engine run already ended (given up) are dropped."""
    for out in outputs:
        st = states.get(out.rid)
        if st is not None and not st.engine_done:
            st.add_output(out)

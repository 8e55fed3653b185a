"""Redis restarting from its AOF, several times in a row and under load (issue 24): admission
keeps admitting and reports the real backlog, and nobody takes over a live peer's work.

Real redis-server processes (restarted by SIGKILL and SIGTERM), real worker processes (the
production worker service around the synthetic engine, so three of them start in seconds),
real gateway liveness objects.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission import Admission
from gateway.liveness import Liveness
from gateway.submit import Submitter
from shared.backlog import read_backlog
from shared.localredis import LocalRedis
from shared.peer_liveness import PeerLiveness
from shared.redis_client import connect
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, as_str
from tests.gateway_client import eventually
from tests.stack_fixtures import start_workers
from tests.worker_redis import check_seqs, read_events, submit
from worker.consumer_group import counters_look_wrong, ensure_group, resync_entries_read, trim_finished

WORKERS = ("wr0", "wr1", "wr2")
SLOTS = 2                 # requests each worker runs (its --max-batch; no engine queue beyond it)
TTL_S = 1.0
WORKER_ENV = {"WORKER_TTL_S": TTL_S, "WORKER_HEARTBEAT_S": 0.25, "CLAIM_IDLE_MS": 3000, "WORKER_QUEUE_DEPTH": 0,
              "WORKER_FLUSH_MS": 20}


async def real_backlog(redis, keys: Keys) -> int:
    """Entries no worker has read yet plus entries read and not finished, counted one by one."""
    group = next(g for g in await redis.xinfo_groups(keys.requests) if as_str(g["name"]) == CONSUMER_GROUP)
    undelivered = await redis.xrange(keys.requests, min="(" + as_str(group["last-delivered-id"]), max="+")
    return len(undelivered) + int(group["pending"])


async def rewrite_aof(redis) -> None:
    """BGREWRITEAOF and wait for it: the new base records the group's counters as they are now,
    which is what an AOF that Redis rewrote by itself (it grew) holds."""
    await redis.bgrewriteaof()

    async def done() -> bool:
        info = await redis.info("persistence")
        return not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]
    assert await eventually(done, timeout=20)


async def owners_and_epochs(redis, keys: Keys, rids: list[str]) -> dict[str, tuple[str | None, int]]:
    out = {}
    for rid in rids:
        owner, epoch = await redis.hmget(keys.meta(rid), ["owner", "epoch"])
        out[rid] = (as_str(owner) if owner else None, int(epoch or 0))
    return out


# ---- the counter Redis leaves wrong --------------------------------------------------------

async def test_a_stale_group_counter_neither_locks_admission_nor_lingers():
    """Redis 7.0 reloads the group's entries-read from the last AOF rewrite (reads since then
    are in the AOF as XCLAIM ... LASTID, without it), so `lag` counts entries long finished.
    An empty queue reads empty anyway, admission admits, and a worker's re-sync makes `lag`
    itself exact again."""
    server = LocalRedis(appendonly=True).start()
    keys = Keys("stale")
    redis = connect(server.url)
    try:
        await ensure_group(redis, keys)

        async def deliver_and_finish(n: int) -> None:
            for _ in range(n):
                await redis.xadd(keys.requests, {ENTRY_FIELD: b"x"})
            got = await redis.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=n)
            await redis.xack(keys.requests, CONSUMER_GROUP, *[i for i, _ in got[0][1]])

        await deliver_and_finish(30)
        await rewrite_aof(redis)
        await deliver_and_finish(40)
        await asyncio.to_thread(server.restart, kill=True)
        await redis.zadd(keys.workers, {"w": int(time.time() * 1000)})
        [group] = await redis.xinfo_groups(keys.requests)
        assert group["pending"] == 0
        stale_lag = group["lag"]      # 40 on Redis 7.0 (the bug); a Redis that fixed it says 0

        backlog = await read_backlog(redis, keys, 10)
        assert (backlog.queued, backlog.pending, backlog.depth) == (0, 0, 0)
        admission = Admission(redis, keys, max_depth=10, worker_ttl_s=10, cache_ms=0)
        for _ in range(9):
            await admission.admit()

        for _ in range(3):            # now a real queue of 3, behind 70 finished entries
            await redis.xadd(keys.requests, {ENTRY_FIELD: b"x"})
        await trim_finished(redis, keys, approximate=False)
        assert await redis.xlen(keys.requests) == 3
        assert (await read_backlog(redis, keys, 10)).depth == 3   # the stale lag is capped by the stream
        if stale_lag:
            assert await counters_look_wrong(redis, keys)
        assert await resync_entries_read(redis, keys) == bool(stale_lag)
        [group] = await redis.xinfo_groups(keys.requests)
        assert group["lag"] == 3 and group["entries-read"] == 70
        assert not await counters_look_wrong(redis, keys)
        assert await resync_entries_read(redis, keys) is False          # idempotent
        got = await redis.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=10)
        assert len(got[0][1]) == 3                                      # nothing delivered twice or skipped
        assert (await read_backlog(redis, keys, 10)).depth == 3         # 3 pending, none queued
    finally:
        await redis.aclose()
        server.stop()


async def test_unknown_depth_admits_instead_of_refusing(redis_client, stream_prefix, caplog):
    """`lag` nil while entries wait (Redis cannot compute it past a deleted entry): the depth is
    unknown, admission admits and logs it once, and says when it is known again."""
    keys = Keys(stream_prefix)
    await ensure_group(redis_client, keys)
    ids = [await redis_client.xadd(keys.requests, {ENTRY_FIELD: b"x"}) for _ in range(3)]
    await redis_client.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=1)
    await redis_client.xdel(keys.requests, ids[1])     # a deleted undelivered entry: lag is nil
    [group] = await redis_client.xinfo_groups(keys.requests)
    assert group["lag"] is None
    await redis_client.zadd(keys.workers, {"w": int(time.time() * 1000)})
    assert (await read_backlog(redis_client, keys, 10)).depth is None
    admission = Admission(redis_client, keys, max_depth=1, worker_ttl_s=10, cache_ms=0)
    with caplog.at_level("INFO", logger="gateway.admission"):
        for _ in range(3):
            await admission.admit()
        assert not await counters_look_wrong(redis_client, keys)       # nothing a re-sync could fix
        await redis_client.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=5)   # past the gap
        assert (await read_backlog(redis_client, keys, 10)).depth == 2     # 2 pending, none queued
        with pytest.raises(Exception, match="queue is full"):
            await admission.admit()
    assert len([r for r in caplog.records if "cannot be read" in r.message]) == 1
    assert len([r for r in caplog.records if "known again" in r.message]) == 1


# ---- judging peers ------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_peers_are_judged_only_after_a_full_uninterrupted_window():
    clock = Clock()
    peers = PeerLiveness(2.0, clock=clock, wall=lambda: clock.t)

    def round_at(t: float, run_id: str = "r1", took: float = 0.01) -> bool:
        clock.t = t
        return peers.observe(run_id, sent_at=t - took)

    def rounds_until(end: float, run_id: str = "r1") -> None:
        """Rounds every 0.25 s (the worker's pace) up to `end`; nobody judged before it."""
        while clock.t + 0.25 < end:
            round_at(clock.t + 0.25, run_id)
            assert not peers.judging(), clock.t

    round_at(1000.25)
    rounds_until(1002.0)
    round_at(1002.0)
    assert peers.judging() and peers.cutoff_ms() == 1002.0 * 1000 - 2000
    # Redis unreachable: nobody is judged until a full window after it answers again
    peers.interrupted()
    assert not peers.judging()
    round_at(1009.0)
    rounds_until(1011.0)
    round_at(1011.0)
    assert peers.judging()
    # a different server (restarted without us seeing an error, or failed over)
    assert round_at(1011.25, run_id="r2") is True
    rounds_until(1013.25, run_id="r2")
    round_at(1013.25, run_id="r2")
    assert peers.judging()
    # a round trip longer than half the TTL (Redis stalled)
    round_at(1013.5, run_id="r2", took=1.5)
    rounds_until(1015.5, run_id="r2")
    round_at(1015.5, run_id="r2")
    assert peers.judging()
    # our own round more than half a TTL late (this process paused or starved)
    round_at(1016.7, run_id="r2")
    assert not peers.judging()


async def test_a_redis_restart_does_not_make_a_gateway_take_over_live_peers():
    """Two gateways beat; Redis is down longer than the gateway TTL. Back up, the survivor's
    first rounds take nobody over (every beat is stale, the peer beats again within its
    interval), while a gateway that never beats again is taken over one TTL later."""
    server = LocalRedis(appendonly=True).start()
    keys = Keys("gwl")
    clients = [connect(server.url) for _ in range(3)]

    def liveness(client, gw):
        submitter = Submitter(client, keys, gw, request_maxlen=1000, output_ttl_s=60, concurrency=0,
                              rate_per_min=0, lease_s=30, reqs_ttl_s=66)
        return Liveness(client, keys, gw, submitter, ttl_s=1.0, grace_s=5)
    a, b, c = (liveness(cl, gw) for cl, gw in zip(clients, ("gwa", "gwb", "gwc")))
    try:
        for g in (a, b, c):
            await g.beat()
        await asyncio.to_thread(server.restart, kill=True, down_for=2.0)
        await a.beat()
        taken = await a.take_over_dead()                # b has not beaten since Redis came back

        async def rounds_until_c_is_taken() -> bool:
            await b.beat()                              # b is alive: it beats every round
            await a.beat()
            taken.update(await a.take_over_dead())
            return "gwc" in taken
        assert await eventually(rounds_until_c_is_taken, timeout=20, interval=0.2)
        assert set(taken) == {"gwc"}                    # never the live one
        assert await clients[0].zscore(keys.gateways, "gwb") is not None
    finally:
        for cl in clients:
            await cl.aclose()
        server.stop()


# ---- the whole thing under load ------------------------------------------------------------

@pytest.mark.parametrize("restarts", [("kill", "term", "kill", "term")])
async def test_redis_restarts_under_load_keep_admitting_and_never_move_a_live_workers_request(tmp_path, restarts):
    """Three workers; each round: short requests come and finish (the group's counters move),
    the AOF is rewritten midway (so its base holds counters that later reads leave behind),
    every worker is then busy with long requests and a few more wait in the stream; Redis is
    restarted from its AOF (down longer than the worker TTL). After each restart: new requests
    are admitted within seconds, admission's depth equals the real backlog, and once every
    worker has beaten for three TTLs no request has changed owner or epoch; the long ones then
    end exactly (every token once, in order)."""
    server = LocalRedis(appendonly=True).start()
    keys = Keys("rs")
    procs = await asyncio.to_thread(start_workers, server.url, "rs", None, tmp_path, WORKERS, env=WORKER_ENV,
                                    step_ms=10, max_batch=SLOTS)
    redis = connect(server.url)
    try:
        admission = Admission(redis, keys, max_depth=len(WORKERS) * SLOTS + 6, worker_ttl_s=TTL_S, cache_ms=0)

        async def churn(n: int) -> None:
            rids = [await submit(redis, keys, max_tokens=3) for _ in range(n)]
            for events in await asyncio.gather(*(read_events(redis, keys, rid, timeout=30) for rid in rids)):
                assert events[-1]["k"] == "done"

        for round_no, how in enumerate(restarts):
            await churn(10)
            await rewrite_aof(redis)
            await churn(10)
            running = [await submit(redis, keys, max_tokens=100_000) for _ in range(len(WORKERS) * SLOTS)]

            async def all_running() -> bool:
                return all(owner and epoch == 1 for owner, epoch in
                           (await owners_and_epochs(redis, keys, running)).values())
            assert await eventually(all_running, timeout=20)
            before = await owners_and_epochs(redis, keys, running)
            assert {owner for owner, _ in before.values()} == set(WORKERS)
            queued = [await submit(redis, keys, max_tokens=3) for _ in range(4)]   # no room: they wait
            assert await real_backlog(redis, keys) == len(running) + len(queued)

            await asyncio.to_thread(server.restart, kill=how == "kill", down_for=2 * TTL_S)
            back_ms = int(time.time() * 1000)

            async def admits() -> bool:
                try:
                    await admission.admit()
                    return True
                except Exception:
                    return False
            assert await eventually(admits, timeout=5, interval=0.1), f"round {round_no}: still refusing"

            async def depth_is_real() -> bool:
                return (await read_backlog(redis, keys, TTL_S)).depth == await real_backlog(redis, keys) == 10
            assert await eventually(depth_is_real, timeout=5, interval=0.1), \
                (round_no, await read_backlog(redis, keys, TTL_S), await real_backlog(redis, keys))

            async def every_worker_beat_three_ttls() -> bool:
                scores = [await redis.zscore(keys.workers, w) for w in WORKERS]
                return all(s and s > back_ms + 3000 * TTL_S for s in scores)
            assert await eventually(every_worker_beat_three_ttls, timeout=30, interval=0.1)
            assert await owners_and_epochs(redis, keys, running) == before, f"round {round_no} ({how})"

            for rid in running:                 # end them: the queued ones run next
                await redis.set(keys.cancel(rid), 1, ex=60)
            for rid in running:
                events = await read_events(redis, keys, rid, timeout=30)
                check_seqs(events)
                assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "cancelled"
                assert {e["ep"] for e in events} == {1}
            for rid in queued:
                assert (await read_events(redis, keys, rid, timeout=30))[-1]["k"] == "done"

            async def drained() -> bool:
                return await real_backlog(redis, keys) == 0 and (await read_backlog(redis, keys, TTL_S)).depth == 0
            assert await eventually(drained, timeout=10)
        assert all(p.alive() for p in procs)
    finally:
        for p in procs:
            p.stop()
        await redis.aclose()
        server.stop()


async def test_a_new_group_is_set_quietly_and_a_wrong_lag_warns(redis_client, stream_prefix, caplog):
    """A fresh Redis: the group Redis creates has no entries-read counter but a true lag (0, or
    the entries waiting); the worker sets the counter without warning of a failover that never
    happened. A stale counter (its lag counts read entries as queued) still warns."""
    keys = Keys(stream_prefix)
    with caplog.at_level("DEBUG", logger="worker.consumer_group"):
        await ensure_group(redis_client, keys)
        [group] = await redis_client.xinfo_groups(keys.requests)
        assert group["entries-read"] is None and group["lag"] == 0
        assert await resync_entries_read(redis_client, keys) is False
        ids = [await redis_client.xadd(keys.requests, {ENTRY_FIELD: b"x"}) for _ in range(3)]
        assert await resync_entries_read(redis_client, keys) is False       # counter right: nothing to do
        assert not [r for r in caplog.records if r.levelname == "WARNING"]

        # what an AOF reload leaves (test above): a stale counter, so `lag` counts read entries as queued
        await redis_client.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=1)
        await redis_client.execute_command("XGROUP", "SETID", keys.requests, CONSUMER_GROUP, ids[0], "ENTRIESREAD", 0)
        [group] = await redis_client.xinfo_groups(keys.requests)
        assert group["lag"] == 3
        assert await resync_entries_read(redis_client, keys) is True
        [group] = await redis_client.xinfo_groups(keys.requests)
        assert group["lag"] == 2 and group["entries-read"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "entries-read counter was wrong" in warnings[0]

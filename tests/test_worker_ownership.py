"""Who runs a request (issue 26): the ownership scripts against a real redis-server, and the
intake's side of them, built from its parts (the real writer, the synthetic engine in a thread,
no worker process and no WorkerService). A worker becomes the owner only if the request is
unowned, already its own, or its owner's lease lapsed; an entry for a request that a live
worker holds is left to it without a write; the pending list follows meta ownership."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.aio import cancel_and_wait
from shared.config import Settings
from shared.events import DoneEvent, DoneUsage, TokEvent
from shared.localredis import LocalRedis
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, as_str
from tests.gateway_client import eventually
from tests.worker_redis import meta_of, new_rid, pending_after_acks, read_events, submit
from worker.engine import StepOutput
from worker.engine_thread import EngineThread
from worker.events import InFlight, Progress
from worker.inflight import InFlightTable, Stats
from worker.intake import Intake
from worker.leases import Leases
from worker.output_writer import OutputWriter
from worker.ownership import Finished, Held, Kept, Ownership, Taken, keep_fresh_interval, lease_ms
from worker.synthetic import SyntheticEngine


def settings(prefix: str, **overrides) -> Settings:
    return Settings(stream_prefix=prefix, **{"worker_heartbeat_s": 0.5, "worker_ttl_s": 2.0, "claim_idle_ms": 1500,
                                             "worker_flush_ms": 10, **overrides})


async def redis_ms(redis) -> int:
    sec, usec = await redis.time()
    return sec * 1000 + usec // 1000


def test_the_lease_lapses_before_a_dead_owner_is_judged_dead_and_outlives_a_missed_refresh():
    s = settings("x")
    assert keep_fresh_interval(s) == 0.5 and lease_ms(s) == 1500          # WORKER_TTL_S - WORKER_HEARTBEAT_S
    fast = settings("x", worker_ttl_s=1.0, worker_heartbeat_s=0.25, claim_idle_ms=3000)
    assert keep_fresh_interval(fast) == 0.25 and lease_ms(fast) == 750
    tight = settings("x", worker_ttl_s=0.6, worker_heartbeat_s=0.5)       # never under two refreshes
    assert lease_ms(tight) == 1000


async def test_a_worker_takes_a_request_only_unowned_its_own_or_after_its_owners_lease(redis_client, stream_prefix):
    keys, s = Keys(stream_prefix), settings(stream_prefix)
    wa, wb = Ownership(redis_client, keys, s, "wa"), Ownership(redis_client, keys, s, "wb")
    # unowned: taken at epoch 1, with a lease on Redis's clock
    sent = time.monotonic()
    got = await wa.take("r", key_id="k", gw="g")
    assert isinstance(got, Taken) and (got.epoch, got.gw, got.att, got.cancelled, got.history) == (1, "g", 0, False, [])
    assert sent <= got.lease_until - 1.5 <= time.monotonic()        # our deadline: from when TAKE was sent
    meta, now = await meta_of(redis_client, keys, "r"), await redis_ms(redis_client)
    assert (meta["owner"], meta["key"], meta["gw"], meta["epoch"]) == ("wa", "k", "g", "1")
    assert now < int(meta["lease"]) <= now + 1500
    assert 0 < await redis_client.ttl(keys.meta("r")) <= s.output_ttl_s
    # another worker while that lease lives: refused with the owner and its deadline, nothing written
    before = await redis_client.hgetall(keys.meta("r"))
    held = await wb.take("r", key_id="k")
    assert isinstance(held, Held) and held.owner == "wa" and held.deadline_ms == int(meta["lease"])
    assert 0 < held.remaining_ms <= 1500
    assert await redis_client.hgetall(keys.meta("r")) == before
    # its own again (e.g. a worker restarted under the same id): taken, the epoch fences the old run
    assert (await wa.take("r")).epoch == 2
    # the lease lapsed (its owner stopped refreshing it: it died): another worker takes it, with the
    # delivered tokens a continuation starts from, and the cancel flag
    await redis_client.hset(keys.meta("r"), "lease", await redis_ms(redis_client) - 1)
    await redis_client.xadd(keys.out("r"), {ENTRY_FIELD: TokEvent("r", 2, [5, 6], "ab", 2, 0).encode()}, id="2-0")
    await redis_client.set(keys.cancel("r"), 1)
    got = await wb.take("r")
    assert isinstance(got, Taken) and got.epoch == 3 and got.cancelled
    assert [(e.KIND, e.seq, e.ids) for e in got.history] == [("tok", 2, [5, 6])]
    assert (await meta_of(redis_client, keys, "r"))["owner"] == "wb"
    # an owner without a lease (a worker from before leases) counts as lapsed
    await redis_client.hdel(keys.meta("r"), "lease")
    assert (await wa.take("r", whole_history=False)).epoch == 4
    # a history that ends with a final: nothing to run, not taken, nothing written (only an ack is due)
    await redis_client.xadd(keys.out("r"), {ENTRY_FIELD: DoneEvent("r", 2, "length", DoneUsage(1, 2), 4, 0).encode()}, id="2-1")
    before = await redis_client.hgetall(keys.meta("r"))
    assert isinstance(await wb.take("r"), Finished) and isinstance(await wa.take("r"), Finished)
    assert await redis_client.hgetall(keys.meta("r")) == before


async def test_keep_extends_only_its_own_lease_and_tells_a_moved_epoch(redis_client, stream_prefix):
    keys, s = Keys(stream_prefix), settings(stream_prefix)
    wa, wb = Ownership(redis_client, keys, s, "wa"), Ownership(redis_client, keys, s, "wb")
    st = InFlight.start("r", "1-0", None, Progress(), epoch=(await wa.take("r")).epoch)
    lease = int((await meta_of(redis_client, keys, "r"))["lease"])
    await asyncio.sleep(0.02)
    sent = time.monotonic()
    [kept] = await wa.keep([st])
    assert not kept.taken_over and not kept.cancelled
    # renewed: its deadline on our clock counts from when the round was sent, not from the reply
    assert sent <= kept.lease_until - wa.lease_ms / 1000 <= time.monotonic()
    assert int((await meta_of(redis_client, keys, "r"))["lease"]) > lease
    await redis_client.set(keys.cancel("r"), 1)
    [kept] = await wa.keep([st])
    assert kept.cancelled and kept.lease_until is not None         # the cancel flag, read with it
    # wb's keep of a request it does not own at that epoch extends nothing (no deadline for it)
    assert await wb.keep([st]) == [Kept(False, True, None)]
    assert (await meta_of(redis_client, keys, "r"))["owner"] == "wa"
    # another worker took it over (epoch 2): taken over, and its lease is not touched
    await redis_client.hset(keys.meta("r"), mapping={"owner": "wb", "epoch": 2, "lease": 5})
    assert await wa.keep([st]) == [Kept(True, False, None)]
    assert (await meta_of(redis_client, keys, "r"))["lease"] == "5"
    # hand back clears owner and lease only while they are still ours at our epoch
    theirs = InFlight.start("r", "1-0", None, Progress(), epoch=2)
    for own, states in ((wa, [st]), (wb, [theirs])):
        await own.load()
        async with redis_client.pipeline(transaction=False) as pipe:
            own.release_in(pipe, states)
            await pipe.execute()
        if own is wa:
            assert (await meta_of(redis_client, keys, "r"))["owner"] == "wb"
    meta = await meta_of(redis_client, keys, "r")
    assert "owner" not in meta and "lease" not in meta and meta["epoch"] == "2"


@dataclass
class IntakeParts:
    """What intake_of builds; the test drives and reads them through their public methods."""
    intake: Intake
    leases: Leases
    table: InFlightTable
    stats: Stats

    def rids(self) -> set[str]:
        """The requests this worker holds now."""
        return {st.rid for st in self.table.states()}


@contextlib.asynccontextmanager
async def intake_of(redis, s: Settings, worker_id: str):
    """An Intake built from its parts, its output writer running, around the synthetic engine."""
    keys, stats = Keys(s.stream_prefix), Stats()
    engine = EngineThread(SyntheticEngine(max_batch=4, step_ms=5), max_prompt_tokens=100, buffer_max=1024)
    table = InFlightTable(engine, capacity=4, queue_depth=0, stats=stats)
    writer = OutputWriter(redis, keys, s, worker_id, on_give_up=table.give_up, on_done=table.finished,
                          on_fenced=table.drop)
    ownership = Ownership(redis, keys, s, worker_id)
    leases = Leases(redis=redis, keys=keys, settings=s, worker_id=worker_id, ownership=ownership, table=table,
                    engine=engine, stats=stats, mark_lapsed=writer.mark_lapsed)
    intake = Intake(redis=redis, blocking_redis=redis, keys=keys, settings=s, worker_id=worker_id, table=table,
                    engine=engine, writer=writer, stats=stats, stop=asyncio.Event(), ownership=ownership,
                    leases=leases)
    await intake.ensure_group()
    outputs = asyncio.Event()
    engine.start(outputs.set)
    task = asyncio.create_task(writer.run(engine.take_outputs, table.view, outputs))
    try:
        yield IntakeParts(intake, leases, table, stats)
    finally:
        await cancel_and_wait(task)
        engine.stop()


async def delivered(redis, keys: Keys, consumer: str, rid: str, **params) -> tuple[str, dict]:
    """Submit rid and have it delivered to `consumer` (as its blocked read would): (entry id, fields)."""
    await submit(redis, keys, rid, **params)
    [(_stream, [(entry_id, fields)])] = await redis.xreadgroup(CONSUMER_GROUP, consumer, {keys.requests: ">"}, count=1)
    return as_str(entry_id), fields


async def test_an_entry_for_a_request_a_live_worker_holds_is_left_to_it_without_a_write(redis_client, stream_prefix):
    """What a zombie does with the entry its blocked read got: the owner's lease is alive, so it
    waits until that lease would end; the owner refreshed it (alive): the zombie leaves the
    request to it, writing nothing and acking nothing."""
    keys, s = Keys(stream_prefix), settings(stream_prefix)
    rid = new_rid()
    owner = Ownership(redis_client, keys, s, "wa")               # the live owner (this test refreshes its lease)
    async with intake_of(redis_client, s, "wb") as wb:
        entry_id, fields = await delivered(redis_client, keys, "wb", rid, max_tokens=50)
        await owner.take(rid)
        before = await redis_client.hgetall(keys.meta(rid))
        await wb.intake.accept(entry_id, fields, deliveries=1)
        assert wb.intake.contested() == {entry_id} and not wb.rids()
        assert await redis_client.hgetall(keys.meta(rid)) == before
        st = InFlight.start(rid, entry_id, None, Progress(), epoch=1)
        async def settled() -> bool:
            assert not (await owner.keep([st]))[0].taken_over    # wa's keep-fresh round
            await wb.intake.recheck_contested()                   # wb's claim loop
            return not wb.intake.contested()
        assert await eventually(settled, timeout=10, interval=0.1)
        assert wb.stats.yielded == 1 and not wb.rids()
        meta = await meta_of(redis_client, keys, rid)
        assert (meta["owner"], meta["epoch"]) == ("wa", "1")
        assert await redis_client.xlen(keys.out(rid)) == 0
        [pending] = await redis_client.xpending_range(keys.requests, CONSUMER_GROUP, min="-", max="+", count=10)
        assert as_str(pending["message_id"]) == entry_id            # not acked: wa's to finish


async def test_a_contested_request_is_taken_once_its_owners_lease_lapses(redis_client, stream_prefix):
    """The owner died right after taking the request: its lease is not refreshed, and when it
    ends the waiting worker takes the request (epoch 2) and runs it."""
    keys, s = Keys(stream_prefix), settings(stream_prefix)
    rid = new_rid()
    short = settings(stream_prefix, worker_ttl_s=0.4, worker_heartbeat_s=0.1)   # a 0.3 s lease
    async with intake_of(redis_client, s, "wb") as wb:
        entry_id, fields = await delivered(redis_client, keys, "wb", rid, max_tokens=20)
        await Ownership(redis_client, keys, short, "wa").take(rid)
        await wb.intake.accept(entry_id, fields, deliveries=1)
        assert entry_id in wb.intake.contested()
        async def taken_over() -> bool:
            await wb.intake.recheck_contested()
            return not wb.intake.contested()
        assert await eventually(taken_over, timeout=10, interval=0.05)
        assert wb.stats.yielded == 0
        events = await read_events(redis_client, keys, rid, timeout=30)
        assert events[-1]["k"] == "done" and {e["ep"] for e in events} == {2}
        assert await pending_after_acks(redis_client, keys) == 0


async def test_keep_fresh_takes_back_an_entry_another_consumer_claimed_and_drops_a_taken_over_one(
        redis_client, stream_prefix):
    """Meta ownership is the truth and the pending list follows it: an entry of a request we own
    that another consumer claimed comes back to us; a request whose epoch moved on is dropped."""
    keys, s = Keys(stream_prefix), settings(stream_prefix)
    async with intake_of(redis_client, s, "wa") as wa:
        kept, lost = new_rid(), new_rid()
        ids = {}
        for rid in (kept, lost):
            entry_id, fields = await delivered(redis_client, keys, "wa", rid, max_tokens=100_000)
            await wa.intake.accept(entry_id, fields, deliveries=1)
            ids[rid] = entry_id
        assert wa.rids() == {kept, lost}
        lease = int((await meta_of(redis_client, keys, kept))["lease"])
        # a worker that judged wa dead claimed kept's entry, found wa's lease alive and left it
        await redis_client.xclaim(keys.requests, CONSUMER_GROUP, "thief", 0, [ids[kept]], justid=True)
        # another worker took lost over (its epoch moved on)
        await redis_client.hset(keys.meta(lost), mapping={"owner": "wc", "epoch": 2})
        await wa.leases.keep_fresh_once()
        pending = {as_str(p["message_id"]): as_str(p["consumer"]) for p in await redis_client.xpending_range(
            keys.requests, CONSUMER_GROUP, min="-", max="+", count=10)}
        assert pending[ids[kept]] == "wa"
        assert int((await meta_of(redis_client, keys, kept))["lease"]) > lease
        assert wa.rids() == {kept} and wa.stats.dropped == 1
        assert (await meta_of(redis_client, keys, lost))["owner"] == "wc"


async def test_a_redis_paused_past_the_lease_cannot_stretch_the_owners_deadline():
    """Issue 34 item 5. A keep-fresh round sent while Redis is stopped (SIGSTOP) and answered
    after more than a lease: the owner's deadline counts from when the round was SENT, so the
    late reply leaves the lease lapsed on the owner's clock. Meanwhile the output writer holds the
    request's output (nothing written, nothing dropped); the next round, answered in time, lets
    it out: every token once, in order, one epoch."""
    server = LocalRedis().start()        # its own server: this test stops it
    redis = aioredis.from_url(server.url)
    s = settings("lease", worker_ttl_s=0.8, worker_heartbeat_s=0.2)      # a 0.6 s lease
    lease_s = lease_ms(s) / 1000
    keys, stats = Keys("lease"), Stats()
    table = InFlightTable(EngineThread(SyntheticEngine(max_batch=1, step_ms=5), max_prompt_tokens=100, buffer_max=64),
                          capacity=1, queue_depth=0, stats=stats)
    own = Ownership(redis, keys, s, "wa")
    writer = OutputWriter(redis, keys, s, "wa", on_lapsed=lambda st: leases.renew_soon(st))
    leases = Leases(redis=redis, keys=keys, settings=s, worker_id="wa", ownership=own, table=table,
                    engine=table.engine, stats=stats, mark_lapsed=writer.mark_lapsed)
    try:
        rid = new_rid()
        await redis.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
        entry_id, fields = await delivered(redis, keys, "wa", rid, max_tokens=3)
        got = await own.take(rid, gw="g")
        st = InFlight.start(rid, entry_id, RequestEntry.decode(fields[ENTRY_FIELD]), Progress(), epoch=got.epoch,
                            lease_until=got.lease_until)
        table.add(st)
        st.add_output(StepOutput(rid, " a", [1], False, None, 1, 1))
        await writer.commit([st])
        assert st.written_seq == 1
        server.proc.send_signal(signal.SIGSTOP)
        try:
            before = time.monotonic()
            keeping = asyncio.create_task(leases.keep_fresh_once())   # sent now; answered after the pause
            # Redis stays stopped for two leases: our deadline passes on our own clock meanwhile
            assert await eventually(lambda: time.monotonic() > before + 2 * lease_s, timeout=30)
            assert table.lease_lapsed(time.monotonic()) == 1
        finally:
            resumed = time.monotonic()
            server.proc.send_signal(signal.SIGCONT)
        await keeping
        # the reply came after the round's deadline: it renewed nothing on our clock (a deadline
        # counted from the reply would run to resumed + lease)
        assert before + lease_s <= st.lease_until < resumed and not st.may_write(time.monotonic())
        # a lapse that no commit round saw (none ran meanwhile) is counted by the late reply, once
        assert writer.stats["lease_lapses"] == 1 and st.lease_lapsed
        # so the writer holds the output: nothing written, nothing dropped, a renewal asked for
        st.add_output(StepOutput(rid, " b", [2], False, None, 1, 2))
        assert await writer.commit([st]) == [] and st.written_seq == 1 and len(st.unsent) == 1
        assert writer.stats["lease_lapses"] == 1 and st.lease_lapsed
        assert [as_str(i) for i, _ in await redis.xrange(keys.out(rid))] == ["1-0"]
        await leases.keep_fresh_once()                                # a round answered in time
        assert st.may_write(time.monotonic()) and not st.lease_lapsed
        st.add_output(StepOutput(rid, " c", [3], True, "length", 1, 3))
        assert await writer.commit([st]) == [st]
        events = await read_events(redis, keys, rid, timeout=5)
        assert [(e["k"], e["seq"]) for e in events] == [("tok", 1), ("tok", 2), ("tok", 3), ("done", 3)]
        assert "".join(e.get("text", "") for e in events) == " a b c" and {e["ep"] for e in events} == {1}
        assert stats.dropped == 0 and writer.stats["fenced"] == 0
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await redis.aclose()
        server.stop()


async def test_keep_tells_a_lease_that_redis_refused_to_extend():
    """Redis full (`noeviction`): KEEP still answers, but its HSET of the lease is refused. The
    owner is told (the output writer counts it as a refused write, so the request is given up
    like any other Redis refuses), and the deadline is not moved."""
    server = LocalRedis().start()        # its own server: this test fills it
    redis = aioredis.from_url(server.url)
    try:
        keys, s = Keys("full"), settings("full")
        own = Ownership(redis, keys, s, "wa")
        st = InFlight.start("r", "1-0", None, Progress(), epoch=(await own.take("r")).epoch)
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", str(int((await redis.info("memory"))["used_memory"]) // 2))
        assert await own.keep([st]) == [Kept(False, False, None, True)]
        await redis.config_set("maxmemory", "0")
        [kept] = await own.keep([st])
        assert kept.lease_until is not None and not kept.refused
    finally:
        await redis.aclose()
        server.stop()

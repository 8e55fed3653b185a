"""The output writer's commit against a real redis-server (no worker process): idempotent
retries, history ahead of live, ack + lease release only after the final, and no loss when
Redis refuses writes (maxmemory + noeviction)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis.asyncio as aioredis

from shared.config import Settings
from shared.localredis import LocalRedis
from shared.redis_client import connect
from shared.sampling import SamplingParams
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, decode_event_list
from worker.engine import StepOutput
from worker.events import InFlight, Progress
from worker import output_writer
from worker.output_writer import MAX_WRITE_FAILURES, OutputWriter
from worker.redis_io import TRANSIENT
from bench.hop import counting_client
from tests.gateway_client import eventually
from tests.worker_redis import check_seqs, read_events


async def pending_request(redis, keys: Keys, rid: str, key_id: str = "k", *, group: bool = True) -> InFlight:
    if group:
        await redis.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    entry = RequestEntry(rid=rid, params=SamplingParams(), prompt="x", key_id=key_id, gw="g")
    await redis.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
    resp = await redis.xreadgroup(CONSUMER_GROUP, "w", {keys.requests: ">"}, count=1)
    await redis.zadd(keys.conc(key_id), {rid: 1})
    await redis.hset(keys.meta(rid), mapping={"owner": "w", "epoch": 1})
    return InFlight.start(rid, resp[0][1][0][0].decode(), entry, Progress(), epoch=1)


def tok(rid: str, i: int) -> StepOutput:
    return StepOutput(rid, f" w{i}", [i], False, None, 1, i)


async def test_commit_is_idempotent_live_follows_history_and_the_final_acks(redis_client, stream_prefix):
    keys = Keys(stream_prefix)
    done: list = []
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix), "w", on_done=done.extend)
    st = await pending_request(redis_client, keys, "r1")
    for i in range(1, 4):
        st.add_output(tok("r1", i))
    st.freeze()
    # the first attempt landed but its reply was lost: the retry must not duplicate it
    first = st.unsent[0]
    await redis_client.xadd(keys.out("r1"), {ENTRY_FIELD: first.payload}, id=first.entry_id)
    assert await writer.commit([st]) == []
    assert st.written_seq == 3 and st.unsent == []
    st.add_output(tok("r1", 4))
    st.add_output(StepOutput("r1", "", [], True, "length", 1, 4))
    assert await writer.commit([st]) == [st] and done == [st]
    events = await read_events(redis_client, keys, "r1", timeout=5)
    check_seqs(events)
    assert [(e["k"], e["seq"]) for e in events] == [("tok", 3), ("tok", 4), ("done", 4)]
    inbox = [decode_event_list(f[ENTRY_FIELD]) for _, f in await redis_client.xrange(keys.inbox("g"))]
    assert [[(e["k"], e["seq"]) for e in entry] for entry in inbox] == [[("tok", 3)], [("tok", 4), ("done", 4)]]
    assert (await redis_client.xpending(keys.requests, CONSUMER_GROUP))["pending"] == 0
    assert await redis_client.zscore(keys.conc("k"), "r1") is None
    assert await redis_client.hget(keys.meta("r1"), "owner") is None
    assert 0 < await redis_client.ttl(keys.out("r1")) <= 600


async def test_on_one_redis_a_commit_is_one_round_trip_with_live_lease_and_ack(redis_server, stream_prefix):
    """Where Redis enforces no slots, the history script also writes the inbox entry, releases
    the lease and acks the final: a first token and a final each cost the writer ONE round trip
    (they used to cost two and three), with the same outcome: history, then live, then ack."""
    keys = Keys(stream_prefix)
    client, sends = counting_client(redis_server.url)
    try:
        done: list = []
        writer = OutputWriter(client, keys, Settings(stream_prefix=stream_prefix), "w", on_done=done.extend)
        st = await pending_request(client, keys, "r1")
        other = await pending_request(client, keys, "r2", key_id="k2", group=False)
        for s in (st, other):
            s.add_output(tok(s.rid, 1))
        await writer.commit([st, other])            # loads the script, learns the mode
        sends.clear()
        st.add_output(tok("r1", 2))
        st.add_output(StepOutput("r1", "", [], True, "length", 1, 2))
        other.add_output(tok("r2", 2))
        assert await writer.commit([st, other]) == [st] and done == [st]
        assert len(sends) == 1
        assert st.acked and not other.acked
        inbox = [[(e["rid"], e["k"], e["seq"]) for e in decode_event_list(f[ENTRY_FIELD])]
                 for _, f in await client.xrange(keys.inbox("g"))]
        assert inbox == [[("r1", "tok", 1), ("r2", "tok", 1)], [("r1", "tok", 2), ("r1", "done", 2), ("r2", "tok", 2)]]
        pending = await client.xpending_range(keys.requests, CONSUMER_GROUP, "-", "+", 10)
        assert [p["message_id"].decode() for p in pending] == [other.entry_id]      # r1 acked, r2 not
        assert await client.zscore(keys.conc("k"), "r1") is None
        assert await client.zscore(keys.conc("k2"), "r2") is not None
        assert await client.hget(keys.meta("r1"), "owner") is None
        assert 0 < await client.ttl(keys.inbox("g")) <= 600
    finally:
        await client.aclose()


async def test_a_marker_alone_rides_the_commit_unless_its_request_is_fenced(redis_client, stream_prefix):
    """An attach marker with no events to write goes to the (new) gateway's inbox in the same
    round trip; a request whose epoch moved on sends nothing there and is dropped."""
    keys = Keys(stream_prefix)
    dropped: list = []
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix), "w", on_fenced=dropped.append)
    held = InFlight.start("held", "1-0", None, Progress(seq=3), epoch=1, gw="g")
    moved = InFlight.start("moved", "2-0", None, Progress(seq=5), epoch=1, gw="g")
    await redis_client.hset(keys.meta("held"), "epoch", 1)
    await redis_client.hset(keys.meta("moved"), "epoch", 2)                  # claimed away
    await writer.attach(held, "g2", 4)
    await writer.attach(moved, "g2", 1)
    inbox = [e for _, f in await redis_client.xrange(keys.inbox("g2")) for e in decode_event_list(f[ENTRY_FIELD])]
    assert [(e["k"], e["rid"], e["seq"], e["att"]) for e in inbox] == [("att", "held", 3, 4)]
    assert dropped == [moved] and moved.fenced and not held.fenced
    assert held.marker_att is None
    held.add_output(tok("held", 4))             # its first write after the marker still sets the TTL
    await writer.commit([held])
    assert held.written_seq == 4 and 0 < await redis_client.ttl(keys.out("held")) <= 600


async def test_refused_writes_keep_outputs_then_end_typed_once_redis_accepts_them():
    server = LocalRedis().start()
    redis = aioredis.from_url(server.url)
    keys = Keys("ow")
    given_up: list = []
    try:
        writer = OutputWriter(redis, keys, Settings(stream_prefix="ow"), "w", on_give_up=given_up.append)
        st = await pending_request(redis, keys, "r2")
        st.add_output(tok("r2", 1))
        await writer.commit([st])
        assert st.written_seq == 1
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", str(int((await redis.info("memory"))["used_memory"]) // 2))
        for i in range(2, 2 + MAX_WRITE_FAILURES):
            st.add_output(tok("r2", i))
            st.retry_at = 0.0                                    # do not wait out the backoff here
            assert await writer.commit([st]) == []
            assert st.written_seq == 1                           # nothing confirmed...
        assert sum(1 for f in st.unsent if not f.final) == MAX_WRITE_FAILURES   # ...nothing dropped
        assert given_up == [st] and st.engine_done and st.unsent[-1].final
        st.add_output(tok("r2", 99))                             # engine output after giving up: ignored
        await redis.config_set("maxmemory", "0")
        st.retry_at = 0.0
        assert await writer.commit([st]) == [st]
        events = await read_events(redis, keys, "r2", timeout=5)
        check_seqs(events)
        assert events[-1]["seq"] == 1 + MAX_WRITE_FAILURES
        assert events[-1]["k"] == "err" and events[-1]["code"] == "output_write_failed" and events[-1]["retryable"]
        assert (await redis.xpending(keys.requests, CONSUMER_GROUP))["pending"] == 0
        assert await redis.zscore(keys.conc("k"), "r2") is None
    finally:
        await redis.aclose()
        server.stop()


@pytest.mark.parametrize("n", [1, 3])
async def test_one_round_trip_carries_many_requests_to_one_inbox_entry(redis_client, stream_prefix, n):
    keys = Keys(stream_prefix)
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix), "w")
    states = [InFlight.start(f"r{i}", f"{i}-0", None, Progress(), epoch=1, gw="g") for i in range(5)]
    for st in states:
        await redis_client.hset(keys.meta(st.rid), "epoch", 1)
    for st in states:
        for i in range(1, n + 1):
            st.add_output(tok(st.rid, i))
    await redis_client.config_resetstat()
    await writer.commit(states)
    assert (await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"] == 1   # one history call
    entries = await redis_client.xrange(keys.inbox("g"))
    assert len(entries) == 1
    assert sorted(e["rid"] for e in decode_event_list(entries[0][1][ENTRY_FIELD])) == [st.rid for st in states]
    assert all(st.written_seq == n for st in states)


async def test_history_writes_are_fenced_by_epoch_and_conflicts_are_not_success(redis_client, stream_prefix):
    """A worker whose request was taken over (meta.epoch bumped by the claim) is refused in
    Redis: nothing of it reaches history or the gateway's inbox, it is not acked, and it drops
    the request. An event id already taken by a DIFFERENT event is a conflict, not a success;
    only a byte-identical entry (our own retry after a lost reply) counts as written."""
    keys = Keys(stream_prefix)
    dropped: list = []
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix), "w", on_fenced=dropped.append)
    st = await pending_request(redis_client, keys, "rf")
    st.add_output(tok("rf", 1))
    await writer.commit([st])
    assert st.written_seq == 1
    # another worker claims it: epoch 2, and it continues: writes token 2
    await redis_client.hincrby(keys.meta("rf"), "epoch", 1)
    other = InFlight.start("rf", st.entry_id, st.entry, Progress(seq=1), epoch=2, gw="g")
    other.add_output(tok("rf", 2))
    await writer.commit([other])
    # the stale writer comes back with tokens 2..3 and a final
    st.add_output(tok("rf", 2))
    st.add_output(tok("rf", 3))
    st.add_output(StepOutput("rf", "", [], True, "length", 1, 3))
    assert await writer.commit([st]) == []
    assert dropped == [st] and st.fenced and writer.stats["fenced"] == 1
    assert await writer.commit([st]) == [] and dropped == [st]          # and it writes nothing more
    events = await read_events(redis_client, keys, "rf", until_final=False, timeout=2)
    assert [(e["seq"], e["ep"]) for e in events] == [(1, 1), (2, 2)]
    inbox = [e for _, f in await redis_client.xrange(keys.inbox("g")) for e in decode_event_list(f[ENTRY_FIELD])]
    assert [(e["seq"], e["ep"]) for e in inbox] == [(1, 1), (2, 2)]
    assert (await redis_client.xpending(keys.requests, CONSUMER_GROUP))["pending"] == 1   # not acked
    assert await redis_client.zscore(keys.conc("k"), "rf") is not None                   # lease kept

    # same epoch, an id already holding a different event: CONFLICT, the request is not confirmed
    clash = InFlight.start("rf", st.entry_id, st.entry, Progress(seq=1), epoch=2, gw="")
    clash.add_output(StepOutput("rf", " other", [77], False, None, 1, 2))
    assert await writer.commit([clash]) == []
    assert clash.written_seq == 1 and clash.failures == 1 and not clash.fenced
    # (our own event written again, a retry whose reply was lost, is success: the first test)


async def test_a_commit_to_a_frozen_redis_fails_transient_within_its_deadline(monkeypatch):
    """The writer's client has no per-reply socket timeout; one deadline per round trip must
    still turn a hung Redis (SIGSTOP: a partition, a stuck node) into a transient error that
    the caller retries, never a commit that waits forever. After the deadline the connection is
    dropped, so the retry once Redis is back reads its own replies, not stale ones."""
    monkeypatch.setattr(output_writer, "ROUND_TRIP_TIMEOUT_S", 0.5)
    server = LocalRedis().start()
    redis = connect(server.url, socket_timeout=None)
    keys = Keys("dl")
    try:
        writer = OutputWriter(redis, keys, Settings(stream_prefix="dl"), "w")
        st = await pending_request(redis, keys, "r3")
        st.add_output(tok("r3", 1))
        await writer.commit([st])
        server.proc.send_signal(signal.SIGSTOP)
        try:
            st.add_output(tok("r3", 2))
            # nothing but the writer's own deadline can end this commit while Redis is stopped
            # (its client has no socket timeout): that it ends, transient, is the deadline working
            commit = asyncio.create_task(writer.commit([st]))
            done, _ = await asyncio.wait({commit}, timeout=60)
            if not done:
                commit.cancel()
            assert done, "the commit hung on a frozen Redis"
            assert isinstance(commit.exception(), TRANSIENT), commit.exception()
        finally:
            server.proc.send_signal(signal.SIGCONT)
        st.add_output(tok("r3", 3))
        st.add_output(StepOutput("r3", "", [], True, "length", 1, 3))
        assert await writer.commit([st]) == [st]
        events = await read_events(redis, keys, "r3", timeout=5)
        check_seqs(events)
        assert [(e["k"], e["seq"]) for e in events] == [("tok", 1), ("tok", 2), ("tok", 3), ("done", 3)]
    finally:
        await redis.aclose()
        server.stop()


@pytest.mark.parametrize("batch", [2, 128])
async def test_one_refused_request_in_a_history_call_does_not_stop_the_others(redis_client, stream_prefix,
                                                                               monkeypatch, batch):
    """Requests share history script calls (HISTORY_BATCH per call): a fenced request and a
    conflicting one in the middle of a call are refused alone, the requests around them and in
    the other calls are written, and each request's reply goes to that request."""
    monkeypatch.setattr(output_writer, "HISTORY_BATCH", batch)
    keys = Keys(stream_prefix)
    dropped: list = []
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix), "w", on_fenced=dropped.append)
    rids = ["a", "b", "fenced", "c", "clash", "d", "e"]
    states = {rid: InFlight.start(rid, f"{i}-0", None, Progress(), epoch=1, gw="g") for i, rid in enumerate(rids)}
    for rid in rids:
        await redis_client.hset(keys.meta(rid), "epoch", 1)
    await redis_client.hset(keys.meta("fenced"), "epoch", 2)                   # claimed away
    await redis_client.xadd(keys.out("clash"), {ENTRY_FIELD: b"someone else"}, id="2-0")   # another writer
    for rid, st in states.items():
        for i in (1, 2):
            st.add_output(tok(rid, i))
    await writer.commit(list(states.values()))
    assert dropped == [states["fenced"]] and states["fenced"].fenced
    assert states["clash"].written_seq == 0 and states["clash"].failures == 1 and not states["clash"].fenced
    for rid in ("a", "b", "c", "d", "e"):
        assert states[rid].written_seq == 2 and states[rid].unsent == []
        events = await read_events(redis_client, keys, rid, until_final=False, timeout=2)
        assert [(e["rid"], e["seq"], e["n"]) for e in events] == [(rid, 2, 2)]
    assert await redis_client.xlen(keys.out("fenced")) == 0
    inbox = [e for _, f in await redis_client.xrange(keys.inbox("g")) for e in decode_event_list(f[ENTRY_FIELD])]
    assert sorted(e["rid"] for e in inbox) == ["a", "b", "c", "d", "e"]


class ManualClock:
    """The output writer's `time` module with a monotonic clock that moves only when the test
    moves it (everything else is the real module's)."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


async def test_between_ticks_first_tokens_and_finals_go_at_once_other_tokens_wait(redis_client, stream_prefix,
                                                                                  monkeypatch):
    """The writer loop looks only at the requests a step produced for between ticks: among many
    requests, one's first token and another's final are written at once, while a later token
    of a request already streaming waits for the (long) tick. The writer's clock is the test's:
    "between ticks" holds because the clock has not moved, not because the machine was quick
    enough; the tick comes when the test moves the clock past it."""
    clock = ManualClock()
    monkeypatch.setattr(output_writer, "time", clock)
    keys = Keys(stream_prefix)
    writer = OutputWriter(redis_client, keys, Settings(stream_prefix=stream_prefix, worker_flush_ms=800), "w")
    states = {f"r{i}": InFlight.start(f"r{i}", f"{i}-0", None, Progress(), epoch=1, gw="g") for i in range(40)}
    for rid in states:
        await redis_client.hset(keys.meta(rid), "epoch", 1)
    streaming = states["r5"]
    streaming.add_output(tok("r5", 1))
    await writer.commit([streaming])                        # r5 already has its first token out
    queue: list = []
    wake = asyncio.Event()

    def take():
        out, queue[:] = list(queue), []
        return out

    async def inbox_seqs() -> list:
        return [(e["rid"], e["k"], e["seq"]) for _, f in await redis_client.xrange(keys.inbox("g"))
                for e in decode_event_list(f[ENTRY_FIELD])]

    async def written(event: tuple) -> bool:
        return event in await inbox_seqs()

    loop_task = asyncio.create_task(writer.run(take, states, wake))
    try:
        queue.append(tok("r5", 2))                          # r5's second token: waits for the tick
        wake.set()
        assert await eventually(lambda: not queue)          # the loop has taken it
        queue.append(tok("r7", 1))                          # r7's first token: at once
        wake.set()
        assert await eventually(lambda: written(("r7", "tok", 1)))
        assert ("r5", "tok", 2) not in await inbox_seqs()
        queue.append(StepOutput("r9", "", [], True, "stop", 1, 0))   # a final: at once
        wake.set()
        assert await eventually(lambda: written(("r9", "done", 0)))
        assert ("r5", "tok", 2) not in await inbox_seqs()
        clock.now += 0.8                                    # the tick (0.8 s) is due: it writes what waited
        wake.set()
        assert await eventually(lambda: written(("r5", "tok", 2)))
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)

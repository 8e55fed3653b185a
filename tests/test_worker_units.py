"""The worker's decision logic and stream maintenance, against a real redis-server."""

from __future__ import annotations

import time

from shared.errors import ErrorCode
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, SamplingParams, decode_event
from worker.engine import StepOutput
from worker.events import InFlight, Progress, progress_from_last, step_events
from worker.failover import decide, rid_of_raw
from worker.service import trim_finished


def entry(**params) -> RequestEntry:
    return RequestEntry(rid="r", params=SamplingParams(**params), prompt="x")


def test_failover_decisions():
    assert decide(entry(temperature=0.7), Progress()).action == "run"
    assert decide(entry(temperature=0.7), Progress(seq=3, tokens=3, finished=True)).action == "ack"
    d = decide(entry(temperature=0.0), Progress(seq=4, tokens=5))
    assert (d.action, d.skip_tokens) == ("replay", 5)
    assert decide(entry(temperature=0.7, seed=3), Progress(seq=4, tokens=4)).action == "replay"
    assert decide(entry(temperature=0.7), Progress(seq=4, tokens=4)).action == "lost"


def test_events_count_seq_and_tokens_and_progress_round_trips():
    st = InFlight(rid="r", entry_id="1-0", entry=entry())
    out = lambda text, ids, fin=False, reason=None: StepOutput("r", text, ids, fin, reason, 3, 0)
    evs = step_events(st, out("Hel", [1])) + step_events(st, out("", [2])) + step_events(st, out("lo", [3], True, "length"))
    ids = [i for i, _ in evs]
    assert ids == ["1-0", "2-0", "3-0", "3-1"]            # idempotent ids from seq
    decoded = [decode_event(p) for _, p in evs]
    assert [(e["k"], e["seq"]) for e in decoded] == [("tok", 1), ("tok", 2), ("tok", 3), ("done", 3)]
    assert [e.get("t") for e in decoded[:3]] == [1, 2, 3]
    assert all(abs(e["ms"] - time.time() * 1000) < 60_000 for e in decoded[:3])
    assert progress_from_last(decoded[1]) == Progress(seq=2, tokens=2)
    assert progress_from_last(decoded[-1]).finished
    err = step_events(InFlight("r", "1-0", entry()), StepOutput("r", "", [], True, "error", 3, 0,
                                                             ErrorCode.CONTEXT_TOO_LONG, "too long"))
    e = decode_event(err[0][1])
    assert (err[0][0], e["k"], e["code"], e["retryable"]) == ("0-1", "err", "context_too_long", False)


def test_rid_of_raw_is_best_effort():
    import msgpack
    assert rid_of_raw(msgpack.packb({"rid": "abc", "junk": 1})) == "abc"
    assert rid_of_raw(b"\xc1") is None and rid_of_raw(msgpack.packb([1])) is None and rid_of_raw(None) is None


async def test_trim_keeps_pending_and_undelivered(redis_client, stream_prefix):
    keys = Keys(stream_prefix)
    await redis_client.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    ids = [await redis_client.xadd(keys.requests, {ENTRY_FIELD: b"x"}) for _ in range(6)]
    await redis_client.xreadgroup(CONSUMER_GROUP, "c", {keys.requests: ">"}, count=4)
    await redis_client.xack(keys.requests, CONSUMER_GROUP, ids[0], ids[1], ids[3])   # ids[2] still running
    await trim_finished(redis_client, keys, approximate=False)
    assert [i for i, _ in await redis_client.xrange(keys.requests)] == ids[2:]
    await redis_client.xack(keys.requests, CONSUMER_GROUP, ids[2])
    await trim_finished(redis_client, keys, approximate=False)
    assert [i for i, _ in await redis_client.xrange(keys.requests)] == ids[4:]      # undelivered stay
    await redis_client.xreadgroup(CONSUMER_GROUP, "c", {keys.requests: ">"}, count=10)
    await redis_client.xack(keys.requests, CONSUMER_GROUP, *ids[4:])
    await trim_finished(redis_client, keys, approximate=False)
    assert await redis_client.xlen(keys.requests) == 0

"""The worker's decision logic and stream maintenance, against a real redis-server."""

from __future__ import annotations

import time

from shared.errors import ErrorCode
from shared.sampling import SamplingParams
from shared.events import TokEvent, event_from_map
from shared.streams import (CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, decode_event,
                            decode_event_list, pack_event_list)
from worker.engine import StepOutput
from worker.events import InFlight, Progress, progress_from_last
from worker.failover import decide, rid_of_raw
from worker.consumer_group import trim_finished


def entry(**params) -> RequestEntry:
    return RequestEntry(rid="r", params=SamplingParams(**params), prompt="x")


def test_failover_decisions():
    tok = lambda seq, ids: TokEvent("r", seq, ids, "", 1, 0)
    assert decide(entry(temperature=0.7), Progress(), []).action == "run"
    assert decide(entry(temperature=0.7), Progress(seq=3, finished=True), []).action == "ack"
    history = [tok(2, [5, 6]), tok(5, [7, 8, 9])]
    for params in (dict(temperature=0.0), dict(temperature=0.7, seed=3), dict(temperature=1.0)):
        d = decide(entry(**params), Progress(seq=5), history)   # random sampling too: continue exactly
        assert (d.action, d.generated_ids) == ("continue", [5, 6, 7, 8, 9])
    # a history that does not cover 1..seq (trimmed, or events without ids) cannot be continued
    assert decide(entry(temperature=1.0), Progress(seq=5), history[1:]).action == "lost"
    assert decide(entry(temperature=1.0), Progress(seq=5), [tok(2, [5, 6]), event_from_map({"k": "tok", "seq": 5, "n": 3})]).action == "lost"


def out(text, ids, fin=False, reason=None):
    return StepOutput("r", text, ids, fin, reason, 3, 0)


def test_events_v2_cover_many_tokens_with_ids_seq_range_and_epoch():
    st = InFlight.start("r", "1-0", entry(), Progress(), epoch=2, gw="g1")
    st.add_output(out("Hel", [1]))
    st.freeze()
    st.add_output(out("", [2]))                  # held-back bytes: ids advance, no text yet
    st.add_output(out("lo", [3]))
    st.add_output(out(" you", [4], True, "length"))
    assert [f.entry_id for f in st.unsent] == ["1-0", "4-0", "4-1"]   # idempotent ids from seq
    decoded = [decode_event(f.payload) for f in st.unsent]
    assert [(e["k"], e["seq"], e.get("n")) for e in decoded] == [("tok", 1, 1), ("tok", 4, 3), ("done", 4, None)]
    assert decoded[1]["ids"] == [2, 3, 4] and decoded[1]["text"] == "lo you"
    assert all(e["v"] == 2 and e["ep"] == 2 and e["rid"] == "r" for e in decoded)
    assert all(abs(e["ms"] - time.time() * 1000) < 60_000 for e in decoded)
    assert progress_from_last(event_from_map(decoded[1])) == Progress(seq=4)
    assert progress_from_last(event_from_map(decoded[-1])).finished
    # outputs stay queued until confirmed; a retry sends the very same frozen events
    before = list(st.unsent)
    st.freeze()
    assert st.unsent == before and st.written_seq == 0
    st.confirm(before[:2])
    assert st.written_seq == 4 and not st.final_written and st.unsent == before[2:]
    st.add_output(out("late", [9]))              # after the final: never a token beyond it
    st.confirm(before[2:])
    assert st.final_written and st.unsent == []


def test_error_final_and_urgency():
    st = InFlight.start("r", "1-0", entry(), Progress())
    assert not st.urgent
    st.add_output(out("a", [5]))
    assert st.urgent                             # the first token goes out at once
    st.freeze()
    st.confirm(list(st.unsent))
    st.add_output(out("b", [6]))
    assert st.has_news and not st.urgent         # later tokens wait for the flush tick
    st.add_output(StepOutput("r", "", [], True, "error", 3, 0, ErrorCode.CONTEXT_TOO_LONG, "too long"))
    assert st.urgent
    e = decode_event(st.unsent[-1].payload)
    assert (st.unsent[-1].entry_id, e["k"], e["code"], e["retryable"], e["seq"]) == \
        ("2-1", "err", "context_too_long", False, 2)


def test_inbox_entries_are_lists_of_events():
    payloads = [TokEvent(f"r{i}", i + 1, [i], "x", 1, 0).encode() for i in range(40)]
    for n in (0, 1, 15, 16, 40):
        assert decode_event_list(pack_event_list(payloads[:n])) == [decode_event(p) for p in payloads[:n]]


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


def test_synthetic_engine_paces_steps_continues_and_cancels():
    from worker.engine import EngineRequest
    from worker.synthetic import SyntheticEngine

    eng = SyntheticEngine(max_batch=2, step_ms=5)
    params = SamplingParams(max_tokens=6)
    eng.add(EngineRequest("a", [1], params))
    eng.add(EngineRequest("b", [1], params, generated_ids=[0, 0, 0, 0]))   # a continuation after 4 tokens
    eng.add(EngineRequest("c", [1], params))                      # waits: batch is 2, b's slot frees first
    t0 = time.monotonic()
    outs = []
    for _ in range(6):
        outs += eng.step()
    assert time.monotonic() - t0 >= 0.025                          # ~5 ms a step
    a = [o for o in outs if o.rid == "a"]
    b = [o for o in outs if o.rid == "b"]
    assert len(a) == 6 and a[-1].finished and a[-1].finish_reason == "length"
    assert [o.token_ids for o in b] == [o.token_ids for o in a[4:]] and [o.text for o in b] == [o.text for o in a[4:]]
    assert all(o.text for o in a)
    c = [o for o in outs if o.rid == "c"]
    assert 1 <= len(c) < 6 and not c[-1].finished                 # admitted when b (2 tokens to go) ended
    assert eng.num_running == 1 and eng.num_waiting == 0 and eng.cancel("c") and not eng.cancel("zz")
    final = eng.step()
    assert [(o.rid, o.finish_reason) for o in final] == [("c", "cancelled")] and not eng.has_work


def test_the_engine_thread_and_the_engine_process_are_both_engine_clients():
    """The service talks to worker.engine_client.EngineClient only; both implementations have
    every member of it, with the same signature (EngineProcess is not launched here)."""
    import functools
    import inspect

    from worker.engine_client import EngineClient
    from worker.engine_process import EngineProcess
    from worker.engine_thread import EngineThread
    from worker.synthetic import SyntheticEngine

    members = set(EngineClient.__annotations__) | {n for n, v in vars(EngineClient).items()
                                                   if callable(v) and not n.startswith("_")}
    assert {"start", "submit", "take_outputs", "is_alive", "stop", "running", "waiting", "kv_used", "kv_total",
            "preemptions", "steps", "unhealthy_reason"} <= members
    clients = (EngineThread(SyntheticEngine(max_batch=2, step_ms=1), max_prompt_tokens=10, buffer_max=10),
               EngineProcess(functools.partial(SyntheticEngine, max_batch=2, step_ms=1), max_prompt_tokens=10,
                             buffer_max=10))
    for client in clients:
        for name in members:
            assert hasattr(client, name), (type(client).__name__, name)
            want = getattr(EngineClient, name, None)
            if callable(want):
                params = list(inspect.signature(getattr(client, name)).parameters)
                assert params[:len(inspect.signature(want).parameters) - 1] == \
                    list(inspect.signature(want).parameters)[1:], (type(client).__name__, name, params)


def test_placement_spreads_claimed_entries_over_the_room_peers_have_and_keeps_the_rest():
    from worker.intake.placement import assign
    moves, left = assign(list("abcdef"), {"p": 3, "q": 1, "full": 0})
    assert [item for item, _ in moves] == list("abcd") and left == ["e", "f"]
    assert sorted(peer for _, peer in moves) == ["p", "p", "p", "q"]     # none past its room
    assert moves[0][1] == "p"                                            # the most room first
    assert assign(list("ab"), {}) == ([], ["a", "b"])
    assert assign([], {"p": 2}) == ([], [])


async def test_a_peer_has_less_room_by_what_was_handed_to_it_since_its_last_beat(redis_client, stream_prefix):
    """Placement must not hand a peer its advertised room twice before the peer's figures can
    show the first hand-over (the registry view is up to a second old)."""
    import asyncio
    from shared.backlog import WorkerInfo
    from shared.config import Settings
    from worker.inflight import Stats
    from worker.intake.forwarding import Forwarding, HandOver
    keys = Keys(stream_prefix)
    await redis_client.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    fwd = Forwarding(redis=redis_client, keys=keys, settings=Settings(), worker_id="me", stats=Stats(),
                     stop=asyncio.Event())
    beat = int(time.time() * 1000) - 1000

    def info(worker_id: str, running: int, state: str = "ready") -> WorkerInfo:
        return WorkerInfo(worker_id, 4, running, 0, 0, 0, "m", 0, 0, beat, state)
    fwd.view = {w.worker_id: w for w in (info("me", 0), info("p", 1), info("full", 4), info("going", 0, "draining"))}
    assert fwd.rooms() == {"p": 3}
    await fwd.hand_over([HandOver("1-0", "r1", 1, "p"), HandOver("2-0", "r2", 1, "p")])
    assert fwd.rooms() == {"p": 1}
    assert len(await redis_client.xrange(keys.ctl("p"))) == 2      # each told on its control stream
    fwd.view["p"] = WorkerInfo("p", 4, 3, 0, 0, 0, "m", 0, 0, int(time.time() * 1000) + 200)   # it beat since
    assert fwd.rooms() == {"p": 1}

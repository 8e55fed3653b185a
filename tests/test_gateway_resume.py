"""Exact resume (issue 13 item 2): a socket closed abruptly (or silently gone, as a phone that
switched networks) after a few chunks, `resume` sent on
another socket (on the same replica, or on another one) 2-3 ms later, many times over: every resumed stream continues
right after `last_seq`, with no token lost and none repeated, checked against the worker's own
record of the request (its history stream in Redis).
"""

from __future__ import annotations

import asyncio
import random

from shared.events import DoneEvent, DoneUsage, TokEvent
from shared.streams import ENTRY_FIELD, Keys, history_id, pack_event_list
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import StackSpec, gateway_in_process, gateway_settings
from tests.worker_redis import read_events, silent_worker, text_of

ITERATIONS = 60
PARALLEL = 6


STACK = StackSpec("w-resume", env={"MAX_BATCH": "32", "WORKER_HEARTBEAT_S": "0.5"})


async def test_abrupt_close_then_quick_resume_elsewhere_loses_and_repeats_nothing(redis_client, stack):
    settings = stack.settings(resume_grace_s=30, sweep_interval_s=0.1, flush_interval_ms=30, flush_max_tokens=16,
                              per_key_concurrency=1000, per_key_rate_per_min=100000)
    rng = random.Random(13)
    async with gateway_in_process(settings) as gw_a, gateway_in_process(settings) as gw_b:
        failures: list[str] = []

        async def one(i: int) -> None:
            cid = f"r{i}"
            a = await GatewayClient.connect(gw_a.ws_url)
            # already open, so the resume follows A's drop by 2-3 ms; half on the same replica (whose
            # reader still holds A's subscription then), half on another one
            b = await GatewayClient.connect((gw_a if i % 4 in (1, 2) else gw_b).ws_url)
            rid = await a.generate(cid, prompt=f"Story {i}:", max_tokens=120)
            seen = []
            for _ in range(rng.randint(2, 4)):
                msg = await a.recv(cid, timeout=30)
                if msg["type"] != "chunk":
                    break
                seen.append(msg)
            if i % 2 == 0:
                a.ws.transport.abort()                        # no close frame, no goodbye
            # else: a phone that switched networks: its old socket vanished without the server
            # noticing yet (it stays open, unread, until the end)
            await asyncio.sleep(rng.uniform(0.002, 0.003))
            last_seq = seen[-1]["seq"] if seen else 0
            await b.send(type="resume", id=cid, last_seq=last_seq, request_id=rid)
            assert (await b.recv(cid, timeout=30))["type"] == "accepted"
            rest, done = await b.until_done(cid, timeout=60)
            await b.close()
            a.ws.transport.abort()
            assert done["type"] == "done", done
            expected = text_of(await read_events(redis_client, stack.keys, rid))
            got = "".join(ch["text"] for ch in seen + rest)
            if rest and seen and rest[0]["seq"] - rest[0]["tokens"] != last_seq:
                failures.append(f"{cid}: resumed after seq {last_seq}, first chunk covers "
                                f"{rest[0]['seq'] - rest[0]['tokens'] + 1}..{rest[0]['seq']}")
            elif got != expected:
                failures.append(f"{cid}: text differs from the worker's record")
            elif sum(ch["tokens"] for ch in seen + rest) != done["usage"]["completion_tokens"]:
                failures.append(f"{cid}: token count differs")

        sem = asyncio.Semaphore(PARALLEL)

        async def bounded(i: int) -> None:
            async with sem:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in range(ITERATIONS)))
        assert not failures, f"{len(failures)} of {ITERATIONS} resumes were not exact: {failures[:5]}"


async def test_a_resume_on_another_gateway_ends_the_old_socket_with_resumed_elsewhere(redis_client, stack):
    """Issue 34 item 5. A client resumes on gateway B while its old socket on gateway A is still
    open (a phone that switched networks, its old connection not yet noticed as gone): A learns
    it through its inbox (B's `moved` notice) and ends the request on the old socket at once with
    `resumed_elsewhere`, instead of leaving it silent until its stall watchdog; A releases
    nothing of the request, which runs on for B (its one concurrency slot stays taken), and B
    gets exactly the tokens after `last_seq`."""
    settings = stack.settings(resume_grace_s=30, flush_interval_ms=30, per_key_concurrency=1)
    async with gateway_in_process(settings) as gw_a, gateway_in_process(settings) as gw_b:
        a = await GatewayClient.connect(gw_a.ws_url)
        b = await GatewayClient.connect(gw_b.ws_url)
        rid = await a.generate("x", prompt="Story:", max_tokens=1500, ignore_eos=True)
        seen = await a.chunks("x", 4)
        last_seq = seen[-1]["seq"]
        await b.send(type="resume", id="y", last_seq=last_seq, request_id=rid)
        assert (await b.recv("y", timeout=30))["type"] == "accepted"
        more, moved = await a.until_done("x", timeout=30)
        assert moved["type"] == "done" and moved["finish_reason"] == "error", moved
        assert moved["error"]["code"] == "resumed_elsewhere" and not moved["error"]["retryable"], moved
        assert moved["seq"] == (more[-1]["seq"] if more else last_seq)
        assert gw_a.probe.requests() == [] and gw_a.probe.subscriptions == 0
        # the request still holds its key's one slot: A, which ended it for its own socket only,
        # released nothing (a submit of the same key on A takes A's pending releases along)
        refused = await a.send_generate("z", max_tokens=5)
        assert refused["type"] == "error" and refused["code"] == "concurrency_limit", refused
        rest = await b.chunks("y", 8)
        await b.send(type="cancel", id="y")
        tail, done = await b.until_done("y", timeout=30)
        rest += tail
        assert done["finish_reason"] == "cancelled", done
        assert rest[0]["seq"] - rest[0]["tokens"] == last_seq
        history = await read_events(redis_client, stack.keys, rid)
        assert "".join(ch["text"] for ch in seen + rest) == text_of(history)
        for c in (a, b):
            await c.close()


async def test_a_live_event_past_a_gap_is_completed_from_history(redis_server, stream_prefix, redis_client):
    """Live tokens that skip ahead (a stale writer's event crossed the new owner's, or an inbox
    entry was trimmed) are completed from the history, in order, before the later ones are shown.
    The 'worker' here is the test itself, writing history and inbox entries as a worker does."""
    keys = Keys(stream_prefix)
    await silent_worker(redis_client, keys)
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, flush_interval_ms=0)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        rid = await c.generate("g1", prompt="x", max_tokens=10)
        inbox = keys.inbox((await redis_client.hget(keys.meta(rid), "gw")).decode())
        toks = [TokEvent(rid, seq, [seq], text, 1, 0).encode() for seq, text in ((1, "A"), (2, "B"), (3, "C"))]
        for seq, ev in enumerate(toks, 1):
            await redis_client.xadd(keys.out(rid), {ENTRY_FIELD: ev}, id=history_id(seq, False))
        done = DoneEvent(rid, 3, "stop", DoneUsage(1, 3), 1, 0).encode()
        await redis_client.xadd(keys.out(rid), {ENTRY_FIELD: done}, id=history_id(3, True))
        await redis_client.xadd(inbox, {ENTRY_FIELD: pack_event_list([toks[0]])})
        await redis_client.xadd(inbox, {ENTRY_FIELD: pack_event_list([toks[2]])})    # seq 2 never came live
        await redis_client.xadd(inbox, {ENTRY_FIELD: pack_event_list([done])})
        chunks, fin = await c.until_done("g1")
        assert "".join(ch["text"] for ch in chunks) == "ABC", chunks
        assert sum(ch["tokens"] for ch in chunks) == 3 and chunks[-1]["seq"] == 3
        assert fin["finish_reason"] == "stop" and fin["seq"] == 3
        await c.close()

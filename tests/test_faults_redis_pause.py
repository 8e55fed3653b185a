"""Redis paused (SIGSTOP) for longer than the ownership lease, with two real worker processes
(issue 34 item 5): no lease is stretched by the stall, no request is written by two workers and
no token is lost or duplicated, in the history and in the gateway's inbox.

The workers run the synthetic engine (the production worker service, its text a function of the
token index, so every answer's exact text is known). While Redis is stopped, each owner's lease
passes its deadline on the owner's own clock (counted from when its last renewal was SENT) and
the owner holds that request's output (its /metrics, served without Redis, shows it); when
Redis resumes, the other worker (claiming entries idle past CLAIM_IDLE_MS) finds the owners'
leases renewed by their rounds that waited in Redis's socket and leaves the requests to them.
"""

from __future__ import annotations

import signal

import redis.asyncio as aioredis

from shared.localredis import LocalRedis, free_port
from shared.sampling import SamplingParams
from shared.streams import ENTRY_FIELD, Keys, RequestEntry, decode_event_list
from tests.gateway_client import eventually
from tests.stack_fixtures import metric, scrape, start_synthetic_worker, wait_for_worker
from tests.worker_redis import (check_seqs, client_view, meta_of, new_rid, pending_after_acks, read_events, text_of,
                                wait_for_tokens, worker_info)
from worker.synthetic import token_at

# lease = WORKER_TTL_S - WORKER_HEARTBEAT_S = 1.5 s (the defaults); entries idle 1.5 s are claimable
ENV = {"WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2, "CLAIM_IDLE_MS": 1500, "WORKER_FLUSH_MS": 20}
N, MAX_TOKENS, GW = 4, 300, "g-pause"


def expected_text(n: int) -> str:
    return "".join(token_at(i)[1] for i in range(1, n + 1))


async def test_redis_paused_longer_than_the_lease_loses_nothing_and_no_request_gets_two_writers(tmp_path):
    server = LocalRedis().start()        # its own server: this test stops it
    redis = aioredis.from_url(server.url)
    keys = Keys("pause")
    workers = {name: start_synthetic_worker(server.url, "pause", tmp_path, name=name, step_ms=5, wait=False,
                                            env={**ENV, "WORKER_METRICS_PORT": free_port()})
               for name in ("wa", "wb")}
    try:
        for proc in workers.values():
            wait_for_worker(server.url, "pause", proc, count=2)
        rids = [new_rid() for _ in range(N)]
        async with redis.pipeline(transaction=True) as pipe:     # one read takes them all: one owner
            for rid in rids:
                pipe.xadd(keys.requests, {ENTRY_FIELD: RequestEntry(
                    rid=rid, params=SamplingParams(max_tokens=MAX_TOKENS), prompt="x", gw=GW).encode()})
            await pipe.execute()
        for rid in rids:
            await wait_for_tokens(redis, keys, rid, 10)
        owners = {(await meta_of(redis, keys, rid))["owner"] for rid in rids}

        async def held() -> float:
            return sum([metric(await scrape(p), "worker_requests_lease_lapsed") for p in workers.values()])

        async def all_held() -> bool:
            return await held() == N
        server.proc.send_signal(signal.SIGSTOP)
        try:
            # every owner's lease passes its deadline on its own clock: it holds the output (its
            # queue, not refused, not dropped) while nothing it sent can be confirmed
            assert await eventually(all_held, timeout=30, interval=0.05), await held()
        finally:
            server.proc.send_signal(signal.SIGCONT)

        live = {}
        for rid in rids:
            events = await read_events(redis, keys, rid, timeout=60)
            check_seqs(events)                                    # every token once, in order
            assert events[-1]["k"] == "done" and events[-1]["seq"] == MAX_TOKENS, events[-1]
            assert text_of(events) == expected_text(MAX_TOKENS)
            # one writer: its owner, at the epoch it took the request with, throughout
            assert {e["ep"] for e in events} == {1} and events[-1]["wk"] in owners, events[-1]
            live[rid] = events

        async def finals_in_inbox() -> bool:
            raw = [e for _, f in await redis.xrange(keys.inbox(GW)) for e in decode_event_list(f[ENTRY_FIELD])]
            return sum(e["k"] == "done" for e in raw) == N
        assert await eventually(finals_in_inbox, timeout=10)
        raw = [e for _, f in await redis.xrange(keys.inbox(GW)) for e in decode_event_list(f[ENTRY_FIELD])]
        for rid, events in live.items():      # what a gateway delivers from its inbox: exactly the history
            mine = [e for e in raw if e["rid"] == rid]
            assert {e["ep"] for e in mine} == {1}
            assert [(e["seq"], e.get("text")) for e in client_view(mine, events)] == \
                [(e["seq"], e.get("text")) for e in events]
        assert await pending_after_acks(redis, keys) == 0
        for name, proc in workers.items():
            found = await scrape(proc)
            assert metric(found, "worker_requests_lease_lapsed") == 0
            assert metric(found, "worker_fenced_writes_total") == 0      # nothing it sent was refused
            if name in owners:
                assert metric(found, "worker_lease_lapses_total") >= 1
            assert (await worker_info(redis, keys, name)).get("dropped") == "0"
            assert proc.alive()
    finally:
        for proc in workers.values():
            proc.stop()
        server.proc.send_signal(signal.SIGCONT)
        await redis.aclose()
        server.stop()

"""Where a dead (or paused) worker's requests go, with real `python -m worker.synthetic`
processes (the real worker service around a paced fake engine: no model, starts in a second).

* claimed work never waits behind a full survivor while another worker has room: a claimant
  that cannot start a claimed request within a bound hands it to a live worker with room, and
  a worker that was paused, fenced and came back is such a worker again (issue 34, item 6);
* a dead worker's entries are claimed in one round, however many it owned.

Which worker holds which entry is arranged, not left to chance: the survivor is started first
and filled (no queue beyond its batch, so it reads nothing more), then the victim starts and is
the only worker with room for the next requests.
"""

from __future__ import annotations

import re
import signal

from shared.sampling import SamplingParams
from shared.streams import Keys, RequestEntry
from tests.gateway_client import eventually
from tests.stack_fixtures import start_synthetic_worker
from tests.test_faults_worker import submit_together
from tests.worker_redis import check_seqs, history, meta_of, new_rid, owner_of, read_events, wait_for_tokens

ENV = {"WORKER_TTL_S": 2, "WORKER_HEARTBEAT_S": 0.5, "CLAIM_IDLE_MS": 1500, "WORKER_QUEUE_DEPTH": 0,
       "SHUTDOWN_GRACE_S": 0.5}
STEP_MS = 20
ENDLESS = 10**6     # tokens: a stream that outlasts the test (its worker stops it at the end)
SHORT = 200         # tokens: 4 s at STEP_MS, so still running when the test pauses its worker


def entries(n: int, max_tokens: int) -> tuple[list[str], list[RequestEntry]]:
    rids = [new_rid() for _ in range(n)]
    return rids, [RequestEntry(rid=r, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt="hi")
                  for r in rids]


async def fill(redis, keys: Keys, n: int, owner: str, max_tokens: int = ENDLESS) -> list[str]:
    """n requests, all taken by `owner` (the only worker with room) and a token in."""
    rids, es = entries(n, max_tokens)
    await submit_together(redis, keys, es)
    for r in rids:
        await wait_for_tokens(redis, keys, r, 1)
    assert {await owner_of(redis, keys, r) for r in rids} == {owner}
    return rids


async def test_claimed_work_moves_off_a_full_survivor_to_the_paused_worker_once_it_is_back(
        redis_server, redis_client, stream_prefix, tmp_path):
    """The issue's fault run in small: the survivor's batch is full of endless streams; the
    victim is paused (SIGSTOP) with two requests mid-stream; the survivor claims them (it
    cannot start them); the victim comes back (SIGCONT), is fenced off its old copies and has
    room again. The claimed requests must finish, on the victim, while the survivor's streams
    are still running: before, they waited behind them."""
    keys, url = Keys(stream_prefix), redis_server.url
    survivor = start_synthetic_worker(url, stream_prefix, tmp_path, name="wb", env=ENV, step_ms=STEP_MS, max_batch=2)
    victim = None
    try:
        endless = await fill(redis_client, keys, 2, "wb")
        victim = start_synthetic_worker(url, stream_prefix, tmp_path, name="wa", env=ENV, step_ms=STEP_MS,
                                        max_batch=2)
        claimed = await fill(redis_client, keys, 2, "wa", max_tokens=SHORT)
        for r in claimed:
            await wait_for_tokens(redis_client, keys, r, 5)
        victim.signal(signal.SIGSTOP)
        try:
            async def taken_by_survivor() -> bool:
                metas = [await meta_of(redis_client, keys, r) for r in claimed]
                return all(m.get("owner") == "wb" and m.get("epoch") == "2" for m in metas)
            assert await eventually(taken_by_survivor, timeout=30), [await meta_of(redis_client, keys, r)
                                                                    for r in claimed]
        finally:
            victim.signal(signal.SIGCONT)
        for r in claimed:
            events = await read_events(redis_client, keys, r, timeout=30)
            check_seqs(events)
            assert events[-1]["k"] == "done" and events[-1]["seq"] == SHORT, events[-1]
            # never started on the full survivor (epoch 2); continued by the victim (epoch 3)
            assert {e["ep"] for e in events} == {1, 3}, [(e["seq"], e["ep"]) for e in events]
            assert (await meta_of(redis_client, keys, r))["epoch"] == "3"
        # ...while the survivor's own streams still ran: nothing waited for them to end
        for r in endless:
            assert all(e["k"] == "tok" for e in await history(redis_client, keys, r))
            assert await owner_of(redis_client, keys, r) == "wb"
    finally:
        for p in (victim, survivor):
            if p is not None:
                p.signal(signal.SIGCONT)
                p.stop()


async def test_a_dead_workers_entries_are_claimed_in_one_round_and_placed_where_there_is_room(
        redis_server, redis_client, stream_prefix, tmp_path):
    """A victim that owned 40 requests, two survivors with a batch of 8 each. Whichever sees
    the death first claims all 40 at once (one pass over the victim's own pending list), not
    in rounds of its capacity a claim-loop tick apart; it starts 8, hands 8 to the other
    survivor (idle: room for 8) and queues the rest."""
    keys, url = Keys(stream_prefix), redis_server.url
    victim = start_synthetic_worker(url, stream_prefix, tmp_path, name="wa", env=ENV, step_ms=STEP_MS, max_batch=40)
    survivors = []
    try:
        owned = await fill(redis_client, keys, 40, "wa")
        survivors = [start_synthetic_worker(url, stream_prefix, tmp_path, name=name, env=ENV, step_ms=STEP_MS,
                                            max_batch=8) for name in ("wb", "wc")]
        victim.signal(signal.SIGKILL)

        async def all_claimed() -> bool:
            return all([await owner_of(redis_client, keys, r) in ("wb", "wc") for r in owned])
        assert await eventually(all_claimed, timeout=30)
        rounds = [(p, int(n)) for p in survivors
                  for n in re.findall(r"worker wa is dead .*?: claimed (\d+) of its requests", p.log())]
        assert [n for _, n in rounds] == [40], rounds

        async def started_by_survivors() -> dict[str, int]:
            started: dict[str, int] = {}
            for r in owned:
                if any(e["k"] == "tok" and e["ep"] == 2 for e in await history(redis_client, keys, r)):
                    owner = await owner_of(redis_client, keys, r)
                    started[owner] = started.get(owner, 0) + 1
            return started

        async def eight_each() -> bool:
            return await started_by_survivors() == {"wb": 8, "wc": 8}
        assert await eventually(eight_each, timeout=30), await started_by_survivors()
    finally:
        for p in (victim, *survivors):
            p.stop()

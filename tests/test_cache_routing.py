"""Cache-aware routing across workers (issue 25 item 3): requests with the same route key run on
the same live worker (rendezvous hashing over the registry, shared.routing), whichever worker
reads their entry first; a routed request whose worker is SIGKILLed continues exactly on
another. Real Redis, real gateway, real worker processes (synthetic engine: the production
worker service, its text a function of the token index)."""

from __future__ import annotations

import signal
import uuid

import pytest

from shared.routing import rendezvous, route_key
from shared.streams import Keys
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings, start_workers
from tests.worker_redis import check_seqs, meta_of, read_events
from worker.synthetic import token_at

WORKERS = ("route-a", "route-b")
ENV = {"WORKER_TTL_S": 1.0, "WORKER_HEARTBEAT_S": 0.25, "CLAIM_IDLE_MS": 3000}


def expected_text(n: int) -> str:
    return "".join(token_at(i)[1] for i in range(1, n + 1))


@pytest.fixture
def two_workers(redis_server, tmp_path):
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    procs = dict(zip(WORKERS, start_workers(redis_server.url, prefix, None, tmp_path, WORKERS, env=ENV, step_ms=10,
                                            max_batch=16)))
    yield prefix, procs
    for proc in procs.values():
        proc.stop()


async def owners(redis_client, keys: Keys, rids: list[str]) -> list[str | None]:
    return [(await meta_of(redis_client, keys, rid)).get("owner") for rid in rids]


async def test_requests_with_one_key_run_on_one_worker_and_survive_its_death(redis_server, redis_client, two_workers):
    prefix, procs = two_workers
    keys = Keys(prefix)
    async with gateway_in_process(gateway_settings(redis_server.url, prefix)) as gw:
        assert await eventually(lambda: len(gw.probe.routed_workers) == 2, timeout=10)
        c = await GatewayClient.connect(gw.ws_url)
        by_key: dict[str, list[str]] = {}
        for key in ("conversation-1", "conversation-2", "tenant-system-prompt"):
            for i in range(4):       # several gateway reads and worker reads race for each entry
                cid = f"{key}-{i}"
                await c.send(type="generate", id=cid, prompt=f"{key} turn {i}", max_tokens=2000,
                             prompt_cache_key=key)
                by_key.setdefault(key, []).append((await c.recv(cid))["request_id"])
        for key, rids in by_key.items():
            target = rendezvous(route_key(key, None, None), WORKERS)[0]

            async def all_owned() -> bool:
                return None not in await owners(redis_client, keys, rids)
            assert await eventually(all_owned, timeout=15)
            assert await owners(redis_client, keys, rids) == [target] * len(rids), key
            assert {(await meta_of(redis_client, keys, rid))["epoch"] for rid in rids} == {"1"}   # handed over, not taken twice

        # the worker holding conversation-1 dies: its requests continue on the other, exactly
        victim = rendezvous(route_key("conversation-1", None, None), WORKERS)[0]
        survivor = next(w for w in WORKERS if w != victim)
        procs[victim].signal(signal.SIGKILL)

        async def moved() -> bool:
            return set(await owners(redis_client, keys, by_key["conversation-1"])) == {survivor}
        assert await eventually(moved, timeout=20)
        for cid in [f"conversation-1-{i}" for i in range(4)]:
            await c.send(type="cancel", id=cid)
        for cid in [f"conversation-1-{i}" for i in range(4)]:
            chunks, done = await c.until_done(cid, timeout=30)
            assert done["finish_reason"] == "cancelled"
            assert "".join(ch["text"] for ch in chunks) == expected_text(done["seq"])   # every token once, in order
        for rid in by_key["conversation-1"]:
            events = await read_events(redis_client, keys, rid)
            check_seqs(events)
            assert {e["ep"] for e in events} <= {1, 2}
        # new requests with that key now go to the live worker
        await c.send(type="generate", id="after", prompt="again", max_tokens=5, prompt_cache_key="conversation-1")
        after = (await c.recv("after"))["request_id"]
        _, done = await c.until_done("after", timeout=30)
        assert done["finish_reason"] == "length"
        for key in ("conversation-2", "tenant-system-prompt"):
            for i in range(4):
                await c.send(type="cancel", id=f"{key}-{i}")
        for key in ("conversation-2", "tenant-system-prompt"):
            for i in range(4):
                assert (await c.until_done(f"{key}-{i}", timeout=30))[1]["finish_reason"] == "cancelled"
        # placement, from each request's final (`wk`: the worker that wrote it): the new turn ran
        # on the survivor from its start (epoch 1: routed there, not taken over), and the other
        # keys' turns ended on their own worker, or on the survivor where theirs was the victim
        events = await read_events(redis_client, keys, after)
        assert events[-1]["wk"] == survivor and {e["ep"] for e in events} == {1}, events[-1]
        for key in ("conversation-2", "tenant-system-prompt"):
            target = rendezvous(route_key(key, None, None), WORKERS)[0]
            for rid in by_key[key]:
                final = (await read_events(redis_client, keys, rid))[-1]
                assert final["finish_reason"] == "cancelled", (key, final)
                assert (final["wk"], final["ep"]) == ((survivor, 2) if target == victim else (target, 1)), (key, final)
        await c.close()


def test_rendezvous_moves_only_the_keys_of_a_worker_that_leaves():
    workers = [f"w{i}" for i in range(5)]
    keys = [route_key(None, f"system prompt {i}", None) for i in range(2000)]
    before = {k: rendezvous(k, workers)[0] for k in keys}
    counts = {w: sum(1 for v in before.values() if v == w) for w in workers}
    assert all(300 <= n <= 500 for n in counts.values()), counts        # spread evenly
    after = {k: rendezvous(k, workers[:-1])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "w4" for k in moved)              # only the leaver's keys move
    # a conversation's later turns resend its start: they keep the key, short or long
    for system in ("You are terse.", "You are terse. " * 300):
        opening = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        later = opening + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"}]
        assert route_key(None, None, opening) == route_key(None, None, later)
        assert route_key("explicit", None, opening) != route_key(None, None, opening)
    # two conversations under one system prompt: their own keys (spread, not one hot worker)
    assert route_key(None, None, [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]) != \
        route_key(None, None, [{"role": "system", "content": "S"}, {"role": "user", "content": "b"}])

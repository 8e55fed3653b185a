"""A real `python -m worker` process on the tiny model, driven through Redis as a gateway would."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from shared.backlog import live_workers, read_backlog
from shared.streams import CONSUMER_GROUP, ENTRY_FIELD, Keys, encode_cancel
from tests.gateway_client import eventually
from tests.stack_fixtures import engine_pids, metric, scrape, start_synthetic_worker, start_worker
from tests.worker_redis import (check_seqs, new_rid, owner_of, pending_after_acks, read_events, submit, text_of,
                                wait_for_tokens)


def module_worker(redis_server, tiny_model_dir, tmp_path_factory, tag: str, env: dict, metrics: bool = False):
    """A worker on its own stream prefix (the module's fixtures differ only in `env`)."""
    prefix = f"{tag}{int(time.time() * 1000) % 10**8}"
    proc = start_worker(redis_server.url, prefix, tiny_model_dir, tmp_path_factory.mktemp("wlogs"),
                        name=f"w-{tag}", env={"WORKER_HEARTBEAT_S": 0.5, **env}, metrics=metrics)
    yield Keys(prefix), proc
    proc.stop()


@pytest.fixture(scope="module")
def worker_env(redis_server, tiny_model_dir, tmp_path_factory):
    yield from module_worker(redis_server, tiny_model_dir, tmp_path_factory, "svc",
                             {"MAX_BATCH": 4, "MAX_SEQ_LEN": 1024, "MAX_PROMPT_TOKENS": 200, "CLAIM_IDLE_MS": 1500},
                             metrics=True)


async def test_streams_tokens_and_acks(worker_env, redis_client):
    keys, proc = worker_env
    rid = await submit(redis_client, keys, max_tokens=12)
    events = await read_events(redis_client, keys, rid)
    check_seqs(events)
    done = events[-1]
    assert done["k"] == "done" and done["finish_reason"] in ("stop", "length")
    toks = [e for e in events if e["k"] == "tok"]
    assert sum(e["n"] for e in toks) == done["usage"]["completion_tokens"] == done["seq"] <= 12
    assert done["usage"]["prompt_tokens"] > 0
    assert all(e["ep"] == 1 for e in events)             # first run: epoch 1, from meta.epoch
    # acked (nothing pending), owner gone from meta, history and meta have a TTL
    assert await pending_after_acks(redis_client, keys) == 0
    assert await owner_of(redis_client, keys, rid) is None
    assert 0 < await redis_client.ttl(keys.out(rid)) <= 600
    assert 0 < await redis_client.ttl(keys.meta(rid)) <= 600


async def test_greedy_is_reproducible_and_batched(worker_env, redis_client):
    keys, proc = worker_env

    async def batch_sizes() -> tuple[float, float, float]:
        """Engine steps so far: all, those of at most 2 rows, those of at most MAX_BATCH (4) rows."""
        found = await scrape(proc)
        return tuple(metric(found, name, **labels) for name, labels in (
            ("worker_batch_size_count", {}), ("worker_batch_size_bucket", {"le": "2.0"}),
            ("worker_batch_size_bucket", {"le": "4.0"})))

    before = await batch_sizes()
    async with redis_client.pipeline(transaction=True) as pipe:     # one MULTI: the worker reads all six at once
        rids = [await submit(pipe, keys, max_tokens=20, prompt="Same prompt") for _ in range(6)]
        await pipe.execute()
    texts = [text_of(await read_events(redis_client, keys, rid)) for rid in rids]
    assert texts[0] and all(t == texts[0] for t in texts)
    # batched: the engine ran steps of 3-4 rows (four requests decoding together; 20 tokens each),
    # never more rows than MAX_BATCH (the metrics pump lags the steps by a fraction of a second)
    steps = wide = capped = 0.0

    async def batched() -> bool:
        nonlocal steps, wide, capped
        now = await batch_sizes()
        steps, wide, capped = now[0] - before[0], (now[0] - now[1]) - (before[0] - before[1]), now[2] - before[2]
        return wide >= 10
    assert await eventually(batched, timeout=15, interval=0.2), (steps, wide)
    assert capped == steps, (steps, capped)


async def test_registry_and_queue_depth(worker_env, redis_client):
    keys, proc = worker_env
    workers = await live_workers(redis_client, keys, worker_ttl_s=10)
    assert [w.worker_id for w in workers] == ["w-svc"]
    w = workers[0]
    assert w.capacity == 4 and w.kv_total > 0 and w.pid == proc.pid
    assert len(engine_pids(proc.pid)) == 1                  # its engine process (ENGINE_PROCESS default)
    backlog = await read_backlog(redis_client, keys, worker_ttl_s=10)
    assert backlog.queued == 0 and backlog.pending == 0 and backlog.live_workers == 1


async def test_cancel_reaches_owner_quickly(worker_env, redis_client):
    keys, _ = worker_env
    rid = await submit(redis_client, keys, max_tokens=900, prompt="Count forever")
    await wait_for_tokens(redis_client, keys, rid, 3)
    owner = await owner_of(redis_client, keys, rid)
    assert owner == "w-svc"
    t0 = time.monotonic()
    await redis_client.xadd(keys.ctl(owner), {ENTRY_FIELD: encode_cancel(rid)})
    events = await read_events(redis_client, keys, rid)
    latency = events[-1]["_t"] - t0
    assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "cancelled"
    check_seqs(events)
    assert events[-1]["usage"]["completion_tokens"] < 900
    assert latency < 2.0, f"cancel-to-last-token {latency:.3f}s"  # generous sanity bound


async def test_cancel_flag_before_claim(worker_env, redis_client):
    keys, _ = worker_env
    rid = new_rid()
    await redis_client.set(keys.cancel(rid), 1, ex=60)
    await submit(redis_client, keys, rid, max_tokens=50)
    events = await read_events(redis_client, keys, rid)
    assert [e["k"] for e in events] == ["done"] and events[0]["finish_reason"] == "cancelled"


async def test_context_too_long_is_typed_for_output_and_for_tokenized_prompt(worker_env, redis_client):
    keys, _ = worker_env
    rid = await submit(redis_client, keys, max_tokens=1024, prompt="hello there")
    ev = (await read_events(redis_client, keys, rid))[-1]
    assert ev["k"] == "err" and ev["code"] == "context_too_long" and ev["retryable"] is False
    # over MAX_PROMPT_TOKENS once tokenized: docs/protocol.md names it context_too_long
    # (prompt_too_large is the gateway's character cap, refused before anything runs)
    rid = await submit(redis_client, keys, max_tokens=5, prompt="word " * 400)
    ev = (await read_events(redis_client, keys, rid))[-1]
    assert ev["k"] == "err" and ev["code"] == "context_too_long" and ev["retryable"] is False


async def test_poison_entries_go_to_dead_letter(worker_env, redis_client):
    keys, proc = worker_env
    bad_rid = new_rid()
    await redis_client.xadd(keys.requests, {ENTRY_FIELD: b"\xc1 not msgpack"})
    await redis_client.xadd(keys.requests, {b"other": b"field"})
    await redis_client.xadd(keys.requests, {ENTRY_FIELD: msgpack.packb({"v": 1, "rid": bad_rid, "params": {"max_tokens": -3},
                                                                         "prompt": "x"})})
    await redis_client.xadd(keys.requests, {ENTRY_FIELD: msgpack.packb({"v": 99, "rid": "x"})})
    good = await submit(redis_client, keys, max_tokens=5)
    assert (await read_events(redis_client, keys, good))[-1]["k"] == "done"
    ev = (await read_events(redis_client, keys, bad_rid))[-1]
    assert ev["k"] == "err" and ev["code"] == "invalid_request" and ev["retryable"] is False
    async def four_dead() -> bool:
        return await redis_client.xlen(keys.dead) >= 4
    await eventually(four_dead, timeout=10, interval=0.05)
    dead = await redis_client.xrange(keys.dead)
    assert len(dead) == 4
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert any("undecodable" in r for r in reasons) and any("version" in r for r in reasons)
    assert dead[0][1][b"raw"] == b"\xc1 not msgpack"
    assert await pending_after_acks(redis_client, keys) == 0
    assert proc.alive()


async def test_busy_worker_keeps_its_requests_from_being_claimed(redis_server, redis_client, stream_prefix, tmp_path):
    """A request running longer than CLAIM_IDLE_MS (1.5 s) stays with its healthy worker. The
    synthetic engine (the real worker service, 5 ms a step) makes 1000 tokens last >= 5 s on any
    machine, so the check cannot pass vacuously on a fast CPU."""
    keys = Keys(stream_prefix)
    proc = start_synthetic_worker(redis_server.url, stream_prefix, tmp_path, name="w-busy",
                                  env={"CLAIM_IDLE_MS": 1500, "WORKER_HEARTBEAT_S": 0.5})
    try:
        t0 = time.monotonic()
        rid = await submit(redis_client, keys, max_tokens=1000, prompt="A long one")
        await wait_for_tokens(redis_client, keys, rid, 2)
        stolen = []
        task = asyncio.ensure_future(read_events(redis_client, keys, rid, timeout=90))
        while not task.done():
            _next, claimed, _deleted = (await redis_client.xautoclaim(keys.requests, CONSUMER_GROUP, "thief", 1500,
                                                                      start_id="0-0", count=10))[:3]
            stolen += claimed
            await asyncio.sleep(0.25)
        events = task.result()
        assert time.monotonic() - t0 > 2 * 1.5       # it ran well past CLAIM_IDLE_MS
        assert stolen == []
        assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == 1000
    finally:
        proc.stop()


async def test_recovers_when_redis_lost_the_request_stream(worker_env, redis_client):
    """Redis restarted without its data (no AOF): the consumer group is gone; the worker
    recreates it and keeps serving instead of failing every read with NOGROUP."""
    keys, proc = worker_env
    await redis_client.delete(keys.requests)
    rid = await submit(redis_client, keys, max_tokens=5)
    assert (await read_events(redis_client, keys, rid, timeout=30))[-1]["k"] == "done"
    assert proc.alive()


@pytest.fixture(scope="module")
def small_pool_env(redis_server, tiny_model_dir, tmp_path_factory):
    """A worker whose KV pool (256 tokens) cannot hold four long requests at once."""
    yield from module_worker(redis_server, tiny_model_dir, tmp_path_factory, "kv",
                             {"MAX_BATCH": 4, "MAX_SEQ_LEN": 256, "KV_CACHE_TOKENS": 256, "KV_BLOCK_SIZE": 16})


async def test_a_full_kv_pool_preempts_and_streams_stay_exact(worker_env, small_pool_env, redis_client):
    """Admission is optimistic, so four 120-token requests start together in a 256-token pool;
    when it runs out, requests are preempted and recompute. Every stream is still exactly the
    text a worker with room for all of them produces, and the registry counts the preemptions."""
    keys, _ = small_pool_env
    params = dict(max_tokens=120, prompt="Same prompt")
    reference = text_of(await read_events(redis_client, worker_env[0],
                                          await submit(redis_client, worker_env[0], **params)))
    async with redis_client.pipeline(transaction=True) as pipe:     # one MULTI: all four are read together
        rids = [await submit(pipe, keys, **params) for _ in range(4)]
        await pipe.execute()
    for rid in rids:
        events = await read_events(redis_client, keys, rid)
        check_seqs(events)
        assert events[-1]["k"] == "done" and events[-1]["seq"] == 120  # the tiny model does not stop early
        assert text_of(events) == reference
    assert await pending_after_acks(redis_client, keys) == 0
    async def preempted() -> bool:                   # the registry entry follows at the next heartbeat
        return int(await redis_client.hget(keys.worker("w-kv"), "preemptions") or 0) > 0
    assert await eventually(preempted, timeout=5, interval=0.2), "no preemption was counted"


async def test_the_engine_in_a_thread_of_the_worker_serves_and_cancels(redis_server, redis_client, tiny_model_dir,
                                                                        tmp_path):
    """ENGINE_PROCESS=false: the engine runs in the worker's own process (no child), streams,
    takes a cancel mid-stream and drains on SIGTERM like the default."""
    keys = Keys(f"thr{int(time.time() * 1000) % 10**8}")
    proc = start_worker(redis_server.url, keys.prefix, tiny_model_dir, tmp_path, name="w-thread",
                        env={"ENGINE_PROCESS": "false", "MAX_BATCH": 2})
    try:
        assert engine_pids(proc.pid) == []
        rid = await submit(redis_client, keys, max_tokens=12)
        events = await read_events(redis_client, keys, rid)
        check_seqs(events)
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] in ("stop", "length")
        long = await submit(redis_client, keys, max_tokens=900, prompt="Count forever")
        await wait_for_tokens(redis_client, keys, long, 3)
        await redis_client.xadd(keys.ctl("w-thread"), {ENTRY_FIELD: encode_cancel(long)})
        events = await read_events(redis_client, keys, long)
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "cancelled"
        assert await pending_after_acks(redis_client, keys) == 0
    finally:
        assert proc.stop() == 0

"""Worker-side faults with a real redis-server and real `python -m worker` processes:
SIGKILL mid-stream (claim + exact continuation from the delivered token ids), SIGTERM hand-back, Redis restart
mid-stream, Redis refusing writes (OOM under noeviction), and requests that keep failing
(dead-lettered after max deliveries)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.backlog import live_workers
from shared.events import TokEvent
from shared.localredis import LocalRedis
from shared.sampling import SamplingParams
from shared.streams import (CONSUMER_GROUP, ENTRY_FIELD, Keys, RequestEntry, decode_event_list,
                            encode_cancel, history_id)
from tests.gateway_client import eventually
from tests.stack_fixtures import (engine_pids, metric, pid_alive, scrape, start_synthetic_worker, start_worker,
                                  start_workers, wait_for_worker)
from tests.worker_redis import (beats_after, check_seqs, client_view, history, last_seq, meta_of, new_rid, owner_of,
                                pending_after_acks, read_events, read_inbox, submit, text_of, wait_for_tokens,
                                worker_info)

# seeded, with every sampling control that depends on the tokens produced so far (EOS never
# sampled, so it runs to max_tokens like the others)
CONTROLLED = dict(temperature=0.9, seed=9, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                  logit_bias={300: 2.0, 301: -3.0}, min_p=0.02, min_tokens=40, ignore_eos=True)
FAST_CLAIM = {"CLAIM_IDLE_MS": 1500, "WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2, "MAX_SEQ_LEN": 2048}
PROMPT = "Once upon a time"


def two_workers(url, prefix, model_dir, log_dir, env):
    """Workers wa and wb (each serving /metrics: `scrape(proc)`), once both are registered."""
    return start_workers(url, prefix, model_dir, log_dir, ("wa", "wb"), env=env, metrics=True)


async def submit_together(redis, keys: Keys, entries: list[RequestEntry]) -> None:
    """One MULTI: the first worker to read gets all of them (so one SIGKILL hits all)."""
    async with redis.pipeline(transaction=True) as pipe:
        for e in entries:
            pipe.xadd(keys.requests, {ENTRY_FIELD: e.encode()})
        await pipe.execute()


async def one_greedy_request_underway(redis, keys: Keys, procs: list, max_tokens: int):
    """A greedy request taken by one of two workers and 20 tokens in: (rid, its owner's name,
    the owner's Proc, the other worker's Proc)."""
    rid = new_rid()
    await submit_together(redis, keys, [entry(rid, max_tokens=max_tokens, temperature=0.0)])
    await wait_for_tokens(redis, keys, rid, 20)
    owner = await owner_of(redis, keys, rid)
    victim = next(p for p, name in zip(procs, ("wa", "wb")) if name == owner)
    return rid, owner, victim, next(p for p in procs if p is not victim)


def entry(rid, **params) -> RequestEntry:
    return RequestEntry(rid=rid, params=SamplingParams(**params), prompt=PROMPT)


def reference_engine(model_dir):
    """The worker's own engine, in this process, on `model_dir` (CPU, fp32): the reference a
    continuation must match token for token."""
    from shared.config import Settings
    from worker.engine import Engine, EngineConfig, load_model
    settings = Settings(model_path=str(model_dir), device="cpu", max_batch=2, max_seq_len=2048, torch_threads=1)
    model, tokenizer = load_model(settings)
    return Engine(model, tokenizer, EngineConfig.from_settings(settings)), tokenizer


def continue_greedy(engine, prompt_ids: list[int], delivered: list[int], max_tokens: int) -> list[int]:
    from worker.engine import EngineRequest
    engine.add(EngineRequest("ref", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             generated_ids=delivered))
    ids: list[int] = []
    while engine.has_work:
        for out in engine.step():
            ids += out.token_ids
    return ids


def ids_of(events: list[dict]) -> list[int]:
    return [i for e in events if e["k"] == "tok" for i in e["ids"]]


def logprobs_of(events: list[dict]) -> list[list]:
    return [lp for e in events if e["k"] == "tok" for lp in e["lp"]]


async def test_sigkill_mid_stream_continues_exactly_whatever_the_sampling(redis_server, redis_client, stream_prefix,
                                                                          tiny_model_dir, tmp_path):
    """A claiming worker continues from prompt + the delivered token ids: random (unseeded)
    sampling finishes too (no worker_lost), and what the client holds is exactly what was delivered
    before the kill followed by what was generated after; greedy and seeded runs still equal an
    uninterrupted run on CPU. The greedy one asks for logprobs: the continuation's entries go on
    where the first run's stopped (text offsets included) and equal the uninterrupted run's. A
    seeded one with every sampling control (penalties over the output so far, logit bias, min-p,
    min_tokens) too: the claiming worker rebuilt its counts from the delivered ids."""
    from transformers import AutoTokenizer
    keys = Keys(stream_prefix)
    gw = "g-kill"
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, FAST_CLAIM)
    try:
        greedy, seeded, rnd, controlled = new_rid(), new_rid(), new_rid(), new_rid()
        await submit_together(redis_client, keys, [entry(greedy, max_tokens=600, temperature=0.0, logprobs=2),
                                                   entry(seeded, max_tokens=600, temperature=0.9, seed=7),
                                                   entry(controlled, max_tokens=600, **CONTROLLED),
                                                   RequestEntry(rid=rnd, params=SamplingParams(max_tokens=600,
                                                                                               temperature=1.0),
                                                                prompt=PROMPT, gw=gw)])
        for rid in (greedy, seeded, rnd, controlled):
            await wait_for_tokens(redis_client, keys, rid, 20)
        owners = {await owner_of(redis_client, keys, r) for r in (greedy, seeded, rnd, controlled)}
        assert len(owners) == 1
        victim = next(p for p, name in zip(procs, ("wa", "wb")) if name in owners)
        survivor = next(p for p in procs if p is not victim)
        [engine] = engine_pids(victim.pid)                 # the worker's engine process
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        assert await eventually(lambda: not pid_alive(engine), timeout=10), "the engine process outlived its worker"
        before = {}
        for rid in (greedy, seeded, rnd, controlled):  # a killed worker writes nothing more: they were mid-stream
            before[rid] = await history(redis_client, keys, rid)
            assert before[rid][-1]["k"] == "tok", "finished before the kill"

        ev_greedy = await read_events(redis_client, keys, greedy, timeout=60)
        ev_seeded = await read_events(redis_client, keys, seeded, timeout=60)
        ev_rnd = await read_events(redis_client, keys, rnd, timeout=60)
        ev_controlled = await read_events(redis_client, keys, controlled, timeout=60)
        # random sampling: finished normally, the delivered events untouched, the rest from epoch 2
        # (a random run may sample EOS before 600 tokens: "stop")
        assert ev_rnd[-1]["k"] == "done" and ev_rnd[-1]["usage"]["completion_tokens"] == ev_rnd[-1]["seq"], ev_rnd[-1]
        check_seqs(ev_rnd)
        k = len(before[rnd])
        assert [e["_id"] for e in ev_rnd[:k]] == [e["_id"] for e in before[rnd]]
        assert {e["ep"] for e in ev_rnd[:k]} == {1} and {e["ep"] for e in ev_rnd[k:]} == {2}
        assert text_of(ev_rnd) == text_of(before[rnd]) + text_of(ev_rnd[k:])
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        assert text_of(ev_rnd) == tokenizer.decode(ids_of(ev_rnd), skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)
        # what the client got live is the same stream: the gateway's inbox deduplicated by seq, plus
        # history where the victim died between its last history write and that write's live copy
        # (the kill follows a history read at once, so that gap is common; a gateway fills it)
        live, _ = await read_inbox(redis_client, keys, gw, {rnd}, timeout=10)
        assert [(e["seq"], e.get("text")) for e in client_view(live[rnd], ev_rnd)] == \
            [(e["seq"], e.get("text")) for e in ev_rnd]
        filled = {e["seq"] for e in ev_rnd} - {e["seq"] for e in live[rnd]}
        assert all(e["ep"] == 1 for e in ev_rnd if e["seq"] in filled), "only the dead worker's last write may miss live"
        # deterministic ones finish seamlessly: seq continues, text identical to an uninterrupted run
        for rid, params, events in ((greedy, dict(temperature=0.0, logprobs=2), ev_greedy),
                                    (seeded, dict(temperature=0.9, seed=7), ev_seeded),
                                    (controlled, CONTROLLED, ev_controlled)):
            assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "length"
            check_seqs(events)
            assert events[-1]["usage"]["completion_tokens"] == 600
            ref = await submit(redis_client, keys, prompt=PROMPT, max_tokens=600, **params)
            ref_events = await read_events(redis_client, keys, ref, timeout=60)
            assert text_of(events) == text_of(ref_events) and ids_of(events) == ids_of(ref_events)
            if rid == greedy:   # logprobs across the hand-over: one entry per token, offsets continuous
                got, want = logprobs_of(events), logprobs_of(ref_events)
                assert len(got) == len(ids_of(events)) == 600
                assert [(e[0], e[3], [t for t, _ in e[2]]) for e in got] == \
                    [(e[0], e[3], [t for t, _ in e[2]]) for e in want]
                assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(got, want))
            # the claiming worker stamps the next epoch (meta.epoch bumped on claim)
            assert {e["ep"] for e in events} == {1, 2} and events[-1]["ep"] == 2
        # all four continued from their delivered tokens (none recomputed from the start, none lost)
        assert metric(await scrape(survivor), "worker_continuations_total") == 4
        assert survivor.alive()
        assert await pending_after_acks(redis_client, keys) == 0
        # the registry no longer lists the dead worker (silent > WORKER_TTL_S), only the survivor
        survivors = [n for n in ("wa", "wb") if n not in owners]

        async def only_the_survivor_listed() -> bool:
            return [w.worker_id for w in await live_workers(redis_client, keys, worker_ttl_s=2)] == survivors
        assert await eventually(only_the_survivor_listed, timeout=10)
    finally:
        for p in procs:
            p.stop()


async def test_a_crashed_engine_process_hands_its_requests_to_another_worker(redis_server, redis_client,
                                                                             stream_prefix, tiny_model_dir, tmp_path):
    """The engine process dies (a segfault, the OOM killer, a CUDA error that kills the process)
    while its worker lives: the worker sees it, hands its requests back at once and exits
    non-zero; the other worker continues them exactly (greedy: equal to an uninterrupted run).
    With CLAIM_IDLE_MS=20 s and the dead worker gone from the registry (nobody judges it dead),
    only the hand-back can make the other worker continue within seconds."""
    keys = Keys(stream_prefix)
    env = {**FAST_CLAIM, "CLAIM_IDLE_MS": 20000}
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, env)
    try:
        rid, owner, victim, survivor = await one_greedy_request_underway(redis_client, keys, procs, 600)
        [engine] = engine_pids(victim.pid)
        t0_ms = time.time() * 1000
        os.kill(engine, signal.SIGKILL)
        assert victim.popen.wait(20) != 0
        assert await redis_client.zscore(keys.workers, owner) is None      # deregistered
        events = await read_events(redis_client, keys, rid, timeout=60)
        check_seqs(events)
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "length"
        assert {e["ep"] for e in events} == {1, 2}
        resumed = next(e for e in events if e["ep"] == 2)           # handed back: continued at once
        assert resumed["ms"] - t0_ms < 10_000, resumed["ms"] - t0_ms
        assert metric(await scrape(survivor), "worker_continuations_total") == 1
        ref = await submit(redis_client, keys, prompt=PROMPT, max_tokens=600, temperature=0.0)
        assert text_of(events) == text_of(await read_events(redis_client, keys, ref, timeout=60))
        assert survivor.alive() and await pending_after_acks(redis_client, keys) == 0
    finally:
        for p in procs:
            p.stop()


async def test_continuation_is_exact_when_the_new_run_differs(redis_server, redis_client, stream_prefix,
                                                               tiny_model_dir, tmp_path_factory, tmp_path):
    """The survivor runs DIFFERENT weights (a stand-in for kernels that do not reproduce the old
    run): a replay would splice its own greedy text onto the delivered prefix; a continuation
    yields exactly the survivor's greedy continuation of prompt + the delivered ids."""
    from tests.tiny_model import make_tiny_model_dir
    from worker.engine import build_prompt_ids
    # a larger init scale: this model's greedy text varies, the default tiny model repeats one token
    other_model = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model-b"), seed=1, initializer_range=0.5)
    keys = Keys(stream_prefix)
    # Deterministic roles: wa is the only worker when the request arrives (no other worker's
    # blocked read can be served it), and is frozen once it has streamed 10 tokens, so the run
    # cannot finish while wb starts; then wa dies and wb takes the request over.
    models = {"wa": tiny_model_dir, "wb": other_model}
    procs = {"wa": start_worker(redis_server.url, stream_prefix, models["wa"], tmp_path, name="wa", env=FAST_CLAIM)}
    try:
        rid = await submit(redis_client, keys, prompt=PROMPT, max_tokens=1200, temperature=0.0)
        await wait_for_tokens(redis_client, keys, rid, 10)
        procs["wa"].signal(signal.SIGSTOP)
        assert await owner_of(redis_client, keys, rid) == "wa"
        survivor = "wb"
        procs["wb"] = start_worker(redis_server.url, stream_prefix, models["wb"], tmp_path, name="wb", env=FAST_CLAIM,
                                   wait=False)
        wait_for_worker(redis_server.url, stream_prefix, procs["wb"], count=2)
        procs["wa"].signal(signal.SIGKILL)
        procs["wa"].popen.wait(10)
        before = await history(redis_client, keys, rid)
        assert before[-1]["k"] == "tok", "finished before the kill"
        events = await read_events(redis_client, keys, rid, timeout=120)
        # the survivor's greedy text may reach EOS before 1200 tokens
        assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == events[-1]["seq"]
        check_seqs(events)
        delivered = ids_of(before)
        assert ids_of(events)[:len(delivered)] == delivered
        engine, tokenizer = reference_engine(models[survivor])
        expected = continue_greedy(engine, build_prompt_ids(tokenizer, PROMPT, None), delivered, 1200)
        assert ids_of(events)[len(delivered):] == expected
        # the new run really differs from the old one: the survivor's own run of the request
        # does not reproduce what the client was shown (so a replay would splice two generations)
        replay = continue_greedy(engine, build_prompt_ids(tokenizer, PROMPT, None), [], 1200)
        assert replay[:len(delivered)] != delivered
    finally:
        for proc in procs.values():
            proc.stop()


async def test_a_stopped_worker_that_comes_back_is_fenced_off(redis_server, redis_client, stream_prefix,
                                                               tiny_model_dir, tmp_path):
    """SIGSTOP the owner mid-stream (a long GC pause, a partition): the other worker claims the
    request (epoch 2) and continues it. On SIGCONT the old owner must not write to it any more:
    its lease passed its deadline on its own clock while it was stopped, so it holds the output
    until keep-fresh tells it the epoch moved on, and drops the request (a write already on its
    way when it was stopped is refused in Redis: the history script checks meta.epoch); the
    history and the gateway inbox hold one continuous stream, nothing of epoch 1 after the claim."""
    keys = Keys(stream_prefix)
    gw = "g-stop"
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, FAST_CLAIM)
    try:
        rid = new_rid()
        await submit_together(redis_client, keys, [RequestEntry(rid=rid, params=SamplingParams(max_tokens=1500,
                                                                                              temperature=1.0),
                                                                prompt=PROMPT, gw=gw)])
        await wait_for_tokens(redis_client, keys, rid, 20)
        owner = await owner_of(redis_client, keys, rid)
        victim = procs[0] if owner == "wa" else procs[1]
        survivor = procs[1] if victim is procs[0] else procs[0]
        victim.signal(signal.SIGSTOP)
        try:
            async def claimed() -> bool:
                return await redis_client.hget(keys.meta(rid), "epoch") == b"2"
            assert await eventually(claimed, timeout=30), "not claimed"
        finally:
            victim.signal(signal.SIGCONT)
        events = await read_events(redis_client, keys, rid, timeout=120)
        assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == events[-1]["seq"], events[-1]
        check_seqs(events)
        eps = [e["ep"] for e in events]
        assert eps == sorted(eps) and set(eps) == {1, 2}
        # live: after the first epoch-2 event the stale worker put nothing into the inbox either
        # (live copies follow the confirmed history write: wait for the final to reach the inbox)
        raw: list[dict] = []

        async def final_in_inbox() -> bool:
            nonlocal raw
            raw = [e for _, f in await redis_client.xrange(keys.inbox(gw))
                   for e in decode_event_list(f[ENTRY_FIELD]) if e["rid"] == rid]
            return any(e["k"] in ("done", "err") for e in raw)
        await eventually(final_in_inbox, timeout=10)
        # (a victim stopped between a history write and its live copy sends that copy on SIGCONT:
        # late, but of history it had written before the takeover, never anything new)
        first2 = next(i for i, e in enumerate(raw) if e["ep"] == 2)
        last_ep1 = max(e["seq"] for e in events if e["ep"] == 1)
        assert all(e["ep"] == 2 or e["seq"] <= last_ep1 for e in raw[first2:]), \
            [(e["seq"], e["ep"]) for e in raw[first2:]]
        assert [(e["seq"], e.get("text")) for e in client_view(raw, events)] == \
            [(e["seq"], e.get("text")) for e in events]
        # the stale worker dropped the request (its registry entry, refreshed every heartbeat,
        # counts drops): its keep-fresh saw the epoch move on, or its write was refused (fenced);
        # whichever came first, nothing of it was written after the claim (above)
        victim_id = "wa" if victim is procs[0] else "wb"
        info: dict = {}

        async def victim_dropped() -> bool:
            nonlocal info
            info = await worker_info(redis_client, keys, victim_id)
            return int(info.get("dropped", 0)) == 1
        assert await eventually(victim_dropped, timeout=10), info
        assert metric(await scrape(victim), "worker_requests_lease_lapsed") == 0     # nothing left held
        assert victim.alive() and survivor.alive()
        assert await pending_after_acks(redis_client, keys) == 0
        # the stale worker serves new work normally afterwards
        more = [new_rid() for _ in range(4)]
        for r in more:
            await submit(redis_client, keys, r, max_tokens=8)
        for r in more:
            assert (await read_events(redis_client, keys, r, timeout=60))[-1]["k"] == "done"
    finally:
        for p in procs:
            p.signal(signal.SIGCONT)
            p.stop()


# ---- a zombie: an entry delivered to a worker that then froze ---------------------------------

ZOMBIE_ENV = {"WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2, "CLAIM_IDLE_MS": 1500, "WORKER_FLUSH_MS": 20}


async def deliver_to_a_frozen_worker(redis, keys: Keys, proc, consumer: str, entry: RequestEntry) -> str:
    """SIGSTOP `proc` while its intake connection is blocked in XREADGROUP (CLIENT LIST: cmd
    xreadgroup, flag b), then XADD `entry`: Redis serves the blocked read, so the entry is pending
    under `consumer` and its reply sits unread in the frozen worker's socket. Proven with XPENDING
    (if the block ran out between the check and the XADD, the undelivered entry is deleted and it
    is tried again). No other client may be blocked reading the stream. Returns the entry id."""
    for _ in range(50):
        proc.signal(signal.SIGSTOP)
        blocked = [c for c in await redis.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]
        assert len(blocked) <= 1, blocked
        if blocked:
            entry_id = await redis.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
            pending = await redis.xpending_range(keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
            if pending and pending[0]["consumer"].decode() == consumer:
                return entry_id.decode()
            assert not pending, pending
            await redis.xdel(keys.requests, entry_id)
        proc.signal(signal.SIGCONT)         # between two blocking reads: let it block again
        await asyncio.sleep(0.05 + 0.1 * random.random())
    raise AssertionError("never caught the worker blocked in XREADGROUP")


async def blocked_in_xreadgroup(redis, pid: int) -> bool:
    """Whether one of process `pid`'s Redis connections is blocked in XREADGROUP (CLIENT LIST:
    cmd xreadgroup, flag b; its `addr` port is one of the process's local TCP ports)."""
    import psutil
    process = psutil.Process(pid)
    connections = process.net_connections(kind="tcp") if hasattr(process, "net_connections") else \
        process.connections(kind="tcp")
    ports = {c.laddr.port for c in connections if c.laddr}
    return any(c["cmd"] == "xreadgroup" and "b" in c["flags"] and int(c["addr"].rsplit(":", 1)[1]) in ports
               for c in await redis.client_list())


async def test_a_zombie_that_wakes_leaves_the_request_to_its_new_owner(tmp_path):
    """Issue 26. A worker blocked in XREADGROUP freezes (SIGSTOP: a GC pause, a VM freeze); Redis
    delivers a new request to its blocked read. Its heartbeat lapses, a survivor claims the entry,
    owns the request (epoch 1) and streams it. The frozen worker wakes and reads the delivered
    entry: it must leave the request to its live owner without writing anything: the owner
    stays the survivor, the epoch is bumped once, the survivor's writes are never fenced, and
    the stream is exact. The zombie then serves new work normally."""
    server = LocalRedis().start()        # its own server: CLIENT LIST shows only this test's workers
    redis = aioredis.from_url(server.url)
    keys = Keys("zombie")
    zombie = start_synthetic_worker(server.url, "zombie", tmp_path, name="wz", env=ZOMBIE_ENV)
    survivor = start_synthetic_worker(server.url, "zombie", tmp_path, name="ws", env=ZOMBIE_ENV, wait=False)
    try:
        wait_for_worker(server.url, "zombie", survivor, count=2)
        # the survivor-to-be is frozen too, and stays frozen; once its blocked read has timed out
        # in Redis (BLOCK 1 s; CLIENT LIST shows it), only the zombie's read can be served the
        # request. (Both are up beforehand, so the zombie is frozen for seconds only: a worker
        # frozen past its blocking reader's socket timeout, 11 s, would drop the delivered reply unread.)
        survivor.signal(signal.SIGSTOP)
        async def survivors_read_timed_out() -> bool:
            return not await blocked_in_xreadgroup(redis, survivor.pid)
        assert await eventually(survivors_read_timed_out, timeout=10, interval=0.05), "its read never timed out"
        rid = new_rid()
        try:
            entry_id = await deliver_to_a_frozen_worker(redis, keys, zombie, "wz", RequestEntry(
                rid=rid, params=SamplingParams(max_tokens=100_000), prompt=PROMPT, gw="g-z"))
            try:
                survivor.signal(signal.SIGCONT)
                # it judges wz dead (no heartbeat for WORKER_TTL_S), XCLAIMs the entry and runs it
                async def survivor_runs_it() -> bool:
                    assert survivor.alive(), survivor.log()[-3000:]
                    return await owner_of(redis, keys, rid) == "ws" and await last_seq(redis, keys, rid) >= 20
                assert await eventually(survivor_runs_it, timeout=60), survivor.log()[-3000:]
                assert (await meta_of(redis, keys, rid))["epoch"] == "1"
                [pending] = await redis.xpending_range(keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id,
                                                       count=1)
                assert pending["consumer"] == b"ws"
            finally:
                zombie.signal(signal.SIGCONT)
        finally:
            survivor.signal(signal.SIGCONT)
        # the zombie reads the entry its blocked read got; it leaves it to ws (registry counter)
        async def zombie_yielded() -> bool:
            meta = await meta_of(redis, keys, rid)
            assert (meta.get("owner"), meta.get("epoch")) == ("ws", "1"), meta     # meanwhile, never stolen
            return (await worker_info(redis, keys, "wz")).get("yielded") == "1"
        assert await eventually(zombie_yielded, timeout=30), zombie.log()[-3000:]
        await wait_for_tokens(redis, keys, rid, await last_seq(redis, keys, rid) + 50)   # ws streams on
        meta = await meta_of(redis, keys, rid)
        assert (meta.get("owner"), meta.get("epoch")) == ("ws", "1"), meta
        await redis.xadd(keys.ctl("ws"), {ENTRY_FIELD: encode_cancel(rid)})       # what a gateway does
        events = await read_events(redis, keys, rid, timeout=30)
        check_seqs(events)
        assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "cancelled", events[-1]
        assert {e["ep"] for e in events} == {1}
        assert (await meta_of(redis, keys, rid)).get("epoch") == "1"
        assert await pending_after_acks(redis, keys) == 0
        # no write of the survivor was refused, none of its requests dropped; the zombie dropped
        # nothing it had started either (it never started this one)
        now_ms = int(time.time() * 1000)

        async def both_beat_again() -> bool:                      # one more heartbeat of each
            beats = [int((await worker_info(redis, keys, w)).get("heartbeat_ms", 0)) for w in ("ws", "wz")]
            return min(beats) > now_ms
        assert await eventually(both_beat_again, timeout=10)
        ws, wz = await worker_info(redis, keys, "ws"), await worker_info(redis, keys, "wz")
        assert (ws["fenced"], ws["dropped"], ws["yielded"]) == ("0", "0", "0"), ws
        assert (wz["fenced"], wz["dropped"], wz["yielded"]) == ("0", "0", "1"), wz
        # the zombie serves new work afterwards (alone: the survivor has stopped)
        assert survivor.stop() == 0 and zombie.alive()
        more = await submit(redis, keys, max_tokens=30)
        events = await read_events(redis, keys, more, timeout=30)
        assert events[-1]["k"] == "done" and {e["ep"] for e in events} == {1}
        assert zombie.alive()
    finally:
        for p in (zombie, survivor):
            p.signal(signal.SIGCONT)
            p.stop()
        await redis.aclose()
        server.stop()


async def test_a_killed_workers_streams_continue_within_3_s_with_default_settings(
        redis_server, redis_client, stream_prefix, tiny_model_dir, tmp_path):
    """Default CLAIM_IDLE_MS / WORKER_TTL_S: a survivor knows the worker is dead as soon as its
    registry heartbeat lapses and claims its requests at once (not after CLAIM_IDLE_MS)."""
    keys = Keys(stream_prefix)
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, {"MAX_SEQ_LEN": 2048})
    try:
        rids = [new_rid() for _ in range(8)]
        await submit_together(redis_client, keys, [entry(r, max_tokens=1500, temperature=1.0) for r in rids])
        for rid in rids:
            await wait_for_tokens(redis_client, keys, rid, 10)
        owners = {await owner_of(redis_client, keys, r) for r in rids}
        assert len(owners) == 1
        victim = next(p for p, name in zip(procs, ("wa", "wb")) if name in owners)
        victim.signal(signal.SIGKILL)
        killed_ms = time.time() * 1000
        gaps = []
        for rid in rids:
            events = await read_events(redis_client, keys, rid, timeout=120)
            check_seqs(events)       # random sampling may end with EOS ("stop") before 1500 tokens
            assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == events[-1]["seq"]
            gaps.append(next(e for e in events if e["ep"] == 2)["ms"] - killed_ms)
        print(f"first token after the kill: {sorted(round(g) for g in gaps)} ms")
        # target 3 s (WORKER_TTL_S = 2 s + claim + prefill); generous on a shared 2-core box
        assert max(gaps) < 4500, gaps
        assert await pending_after_acks(redis_client, keys) == 0
    finally:
        for p in procs:
            p.stop()


async def test_claims_reach_idle_entries_behind_a_hundred_busy_ones(redis_server, redis_client, stream_prefix,
                                                                     tiny_model_dir, tmp_path):
    """120 pending entries of a live worker (kept fresh) come first in the pending list; behind
    them are entries of a worker gone from the registry (idle, found only by XAUTOCLAIM) and of
    a registered worker whose heartbeat lapsed (claimed through the registry). A survivor with
    ONE free slot must reach both: XAUTOCLAIM scans at most 10 x COUNT entries a call, so it has
    to follow the cursor."""
    keys = Keys(stream_prefix)
    await redis_client.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    for _ in range(120):
        await submit(redis_client, keys, max_tokens=5)
    busy = await redis_client.xreadgroup(CONSUMER_GROUP, "busy", {keys.requests: ">"}, count=120)
    busy_ids = [i for i, _ in busy[0][1]]
    gone = [await submit(redis_client, keys, max_tokens=5) for _ in range(3)]
    await redis_client.xreadgroup(CONSUMER_GROUP, "gone", {keys.requests: ">"}, count=3)
    lapsed = [await submit(redis_client, keys, max_tokens=5) for _ in range(3)]
    await redis_client.xreadgroup(CONSUMER_GROUP, "lapsed", {keys.requests: ">"}, count=3)
    pend = await redis_client.xpending_range(keys.requests, CONSUMER_GROUP, min="-", max="+", count=200,
                                             consumername="gone")
    await redis_client.xclaim(keys.requests, CONSUMER_GROUP, "gone", 0, [p["message_id"] for p in pend],
                              idle=3_600_000, justid=True)
    now_ms = int(time.time() * 1000)
    await redis_client.zadd(keys.workers, {"busy": now_ms, "lapsed": now_ms - 60_000})

    async def keep_busy_alive():
        while True:
            await redis_client.zadd(keys.workers, {"busy": int(time.time() * 1000)})
            await redis_client.xclaim(keys.requests, CONSUMER_GROUP, "busy", 0, busy_ids, justid=True)
            await asyncio.sleep(0.3)
    keeper = asyncio.create_task(keep_busy_alive())
    proc = start_worker(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, name="w-one",
                        env={"MAX_BATCH": 1, "WORKER_QUEUE_DEPTH": 0, "CLAIM_IDLE_MS": 5000})
    try:
        for rid in gone + lapsed:
            assert (await read_events(redis_client, keys, rid, timeout=60))[-1]["k"] == "done"
        # the live worker's entries were left alone
        pend = await redis_client.xpending_range(keys.requests, CONSUMER_GROUP, min="-", max="+", count=500)
        assert sorted(p["message_id"] for p in pend if p["consumer"] == b"busy") == sorted(busy_ids)
        # the lapsed worker was judged dead, and owns nothing any more: forgotten (registry, consumer)
        async def forgotten() -> bool:
            return await redis_client.zscore(keys.workers, "lapsed") is None
        assert await eventually(forgotten, timeout=10)
        consumers = {c["name"] for c in await redis_client.xinfo_consumers(keys.requests, CONSUMER_GROUP)}
        assert b"lapsed" not in consumers and b"busy" in consumers
    finally:
        keeper.cancel()
        proc.stop()


POISONED_ENGINE = """
# every forward pass fails, as on a poisoned CUDA context (loaded by the worker at start-up)
import worker.engine.runner as runner


def execute(self, plan):
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


runner.ModelRunner.execute = execute
"""


async def test_a_worker_whose_every_step_fails_stops_taking_work_and_says_why(
        redis_server, redis_client, stream_prefix, tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    from tests.stack_fixtures import ROOT
    hook = tmp_path / "poison"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(POISONED_ENGINE)
    keys = Keys(stream_prefix)
    env = {"PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', ROOT)}"}
    proc = start_worker(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, name="w-sick", env=env)
    try:
        for _ in range(3):     # one failing step each
            rid = await submit(redis_client, keys, max_tokens=5)
            ev = (await read_events(redis_client, keys, rid, timeout=30))[-1]
            assert ev["k"] == "err" and ev["code"] == "internal", ev
        info: dict = {}

        async def unhealthy() -> bool:
            nonlocal info
            info = await worker_info(redis_client, keys, "w-sick")
            return info.get("state") == "unhealthy"
        assert await eventually(unhealthy, timeout=10), info
        assert "illegal memory access" in info["reason"], info
        # no more work taken: a new request stays in the queue for a healthy worker. Two of its
        # heartbeats after the submit (its loops ran meanwhile; a reading worker is served the
        # entry at once), the entry is undelivered, or was handed back at once by a read that
        # was already blocked when the engine turned unhealthy (an idle time far above
        # claim_idle_ms: the next XAUTOCLAIM anywhere takes it), and it never ran here
        waiting = await submit(redis_client, keys, max_tokens=5)
        await beats_after(redis_client, keys, "w-sick", int(time.time() * 1000), count=2)
        [(entry_id, _)] = await redis_client.xrevrange(keys.requests, count=1)     # `waiting`'s
        found: tuple = ()

        async def left_for_a_healthy_worker() -> bool:
            nonlocal found
            [group] = await redis_client.xinfo_groups(keys.requests)
            pending = await redis_client.xpending_range(keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id,
                                                        count=1)
            found = (group, pending)
            handed_back = bool(pending) and pending[0]["time_since_delivered"] >= 3_600_000
            return group["last-delivered-id"] != entry_id or handed_back
        assert await eventually(left_for_a_healthy_worker, timeout=10), found
        assert await redis_client.xlen(keys.out(waiting)) == 0 and await owner_of(redis_client, keys, waiting) is None
        # the container health check says so, with the reason
        check = subprocess.run([sys.executable, str(ROOT / "deploy" / "healthcheck.py"), "worker"], cwd=ROOT,
                               env={**os.environ, "REDIS_URL": redis_server.url, "STREAM_PREFIX": stream_prefix,
                                    "WORKER_ID": "w-sick", "PYTHONPATH": str(ROOT)},
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 1 and "illegal memory access" in check.stdout, check.stdout + check.stderr
        assert proc.alive()
    finally:
        proc.stop()


async def test_keys_of_killed_workers_are_removed(redis_server, redis_client, stream_prefix, tmp_path):
    """Start and SIGKILL 20 workers (synthetic engine: the real service, no model), each with a
    control stream a gateway wrote to and a consumer in the group; after WORKER_TTL_S a survivor
    removes their registry entries, control streams and consumers: Redis keys stay bounded."""
    keys = Keys(stream_prefix)
    env = {"WORKER_HEARTBEAT_S": 0.5, "WORKER_TTL_S": 2}
    dead = [start_synthetic_worker(redis_server.url, stream_prefix, tmp_path, name=f"d{i}", env=env, wait=False)
            for i in range(20)]
    survivor = None
    try:
        for p in dead:
            wait_for_worker(redis_server.url, stream_prefix, p, count=20, timeout=300)
        for i in range(20):      # what a gateway's cancel / attach leaves behind
            await redis_client.xadd(keys.ctl(f"d{i}"), {ENTRY_FIELD: b"x"})
        for p in dead:
            p.signal(signal.SIGKILL)
        for p in dead:
            p.popen.wait(30)
        survivor = start_synthetic_worker(redis_server.url, stream_prefix, tmp_path, name="alive", env=env, wait=False)
        worker_keys: list = []

        async def only_the_survivors_keys() -> bool:
            nonlocal worker_keys
            worker_keys = sorted([k.decode() async for k in redis_client.scan_iter(match=f"{stream_prefix}:{{w:*")])
            return worker_keys == [keys.worker("alive")]
        assert await eventually(only_the_survivors_keys, timeout=60, interval=0.2), worker_keys
        assert [m.decode() for m in await redis_client.zrange(keys.workers, 0, -1)] == ["alive"]
        consumers = {c["name"].decode() for c in await redis_client.xinfo_consumers(keys.requests, CONSUMER_GROUP)}
        assert consumers <= {"alive"}
    finally:
        for p in dead + ([survivor] if survivor else []):
            p.stop()


async def test_sigterm_hands_running_requests_back(redis_server, redis_client, stream_prefix, tiny_model_dir,
                                                   tmp_path):
    """With CLAIM_IDLE_MS=20 s, only the hand-back can make another worker continue within seconds."""
    keys = Keys(stream_prefix)
    env = {**FAST_CLAIM, "CLAIM_IDLE_MS": 20000, "SHUTDOWN_GRACE_S": 0.3}
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, env)
    try:
        rid, owner, victim, _ = await one_greedy_request_underway(redis_client, keys, procs, 1000)
        t0_ms = time.time() * 1000
        victim.signal(signal.SIGTERM)
        assert victim.popen.wait(15) == 0
        events = await read_events(redis_client, keys, rid, timeout=60)
        assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == 1000
        check_seqs(events)
        # the survivor (epoch 2) continued well before CLAIM_IDLE_MS (20 s) would let anyone claim it
        resumed = next(e for e in events if e["ep"] == 2)
        assert resumed["ms"] - t0_ms < 10_000, resumed["ms"] - t0_ms
        assert await redis_client.zscore(keys.workers, owner) is None  # deregistered
        ref = await submit(redis_client, keys, prompt=PROMPT, max_tokens=1000, temperature=0.0)
        assert text_of(events) == text_of(await read_events(redis_client, keys, ref, timeout=60))
    finally:
        for p in procs:
            p.stop()


async def test_an_entry_handed_to_a_worker_as_it_exits_is_claimable_at_once(redis_server, redis_client,
                                                                            stream_prefix, tmp_path):
    """A peer whose view of the registry is stale may hand a routed entry to a worker whose
    control loop has already stopped (it never hears the `take`): at exit the worker makes what
    is still pending under it claimable at once, instead of leaving it for CLAIM_IDLE_MS."""
    keys = Keys(stream_prefix)
    proc = start_synthetic_worker(redis_server.url, stream_prefix, tmp_path, name="w-exit",
                                  env={"CLAIM_IDLE_MS": 60000})
    try:
        entry = RequestEntry(rid=new_rid(), params=SamplingParams(max_tokens=8), prompt=PROMPT,
                             created_ms=int(time.time() * 1000))
        # the stale peer reads the entry (in one transaction with its XADD: the worker's blocked
        # read is served after it) and hands it over without a `take`
        async with redis_client.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.requests, {ENTRY_FIELD: entry.encode()})
            pipe.xreadgroup(CONSUMER_GROUP, "stale-peer", {keys.requests: ">"}, count=1)
            _, read = await pipe.execute()
        entry_id = read[0][1][0][0]
        await redis_client.xclaim(keys.requests, CONSUMER_GROUP, "w-exit", 0, [entry_id], justid=True)
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        [pending] = await redis_client.xpending_range(keys.requests, CONSUMER_GROUP, min=entry_id, max=entry_id,
                                                      count=1)
        assert pending["consumer"] == b"w-exit" and pending["time_since_delivered"] >= 60000, pending
        assert "1 entries still pending under us at exit" in proc.log()
    finally:
        proc.stop()


async def test_redis_restart_mid_stream_loses_no_token(tiny_model_dir, tmp_path):
    server = LocalRedis(appendonly=True).start()
    client = aioredis.from_url(server.url)
    keys = Keys("rr")
    proc = start_worker(server.url, "rr", tiny_model_dir, tmp_path, name="w-rr", env=FAST_CLAIM, metrics=True)
    try:
        rid = await submit(client, keys, prompt=PROMPT, max_tokens=600, temperature=0.0)
        await wait_for_tokens(client, keys, rid, 30)
        last = await client.xrevrange(keys.out(rid), count=1)
        assert last[0][0].endswith(b"-0"), "finished before the restart"
        await asyncio.to_thread(server.restart, down_for=1.0)
        events = None
        deadline = time.monotonic() + 60
        while events is None and time.monotonic() < deadline:
            try:
                events = await read_events(client, keys, rid, timeout=60)
            except RedisConnectionError:
                await asyncio.sleep(0.2)
        assert events[-1]["k"] == "done" and events[-1]["usage"]["completion_tokens"] == 600
        check_seqs(events)
        assert sum(e["n"] for e in events if e["k"] == "tok") == 600
        found = await scrape(proc)          # the worker did see Redis go away (and came through it)
        assert sum(metric(found, "worker_redis_errors_total", kind=k) for k in ("connection", "timeout", "loading")) > 0
        ref = await submit(client, keys, prompt=PROMPT, max_tokens=600, temperature=0.0)
        assert text_of(events) == text_of(await read_events(client, keys, ref, timeout=60))
        assert await pending_after_acks(client, keys) == 0
        assert proc.alive()
    finally:
        proc.stop()
        await client.aclose()
        server.stop()


async def test_request_failing_on_every_worker_is_dead_lettered(redis_server, redis_client, stream_prefix,
                                                                tiny_model_dir, tmp_path):
    """An entry already delivered more than MAX_DELIVERIES times (its workers kept dying) is not
    run again: dead-letter + a final non-retryable error for its client."""
    keys = Keys(stream_prefix)
    await redis_client.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    rid = await submit(redis_client, keys, max_tokens=5)
    # its last (dead) worker had already streamed two tokens
    for seq in (1, 2):
        await redis_client.xadd(keys.out(rid), {ENTRY_FIELD: TokEvent(rid, seq, [7], "x", 1, 0).encode()},
                                id=history_id(seq, False))
    resp = await redis_client.xreadgroup(CONSUMER_GROUP, "ghost", {keys.requests: ">"}, count=1)
    entry_id = resp[0][1][0][0]
    await redis_client.xclaim(keys.requests, CONSUMER_GROUP, "ghost", 0, [entry_id], retrycount=9, idle=10_000_000,
                              justid=True)
    proc = start_worker(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, name="w-dl",
                        env={**FAST_CLAIM, "MAX_DELIVERIES": 5})
    try:
        events = await read_events(redis_client, keys, rid, timeout=30)
        ev = events[-1]
        assert ev["k"] == "err" and ev["code"] == "worker_lost" and ev["retryable"] is False
        check_seqs(events)                                  # final seq follows the delivered tokens
        # dead letter + ack follow the final (one MULTI on {q})
        assert await eventually(lambda: redis_client.xlen(keys.dead), timeout=10)
        dead = await redis_client.xrange(keys.dead)
        assert len(dead) == 1 and b"delivered 10 times" in dead[0][1][b"reason"]
        assert await pending_after_acks(redis_client, keys) == 0
        ok = await submit(redis_client, keys, max_tokens=5)
        assert (await read_events(redis_client, keys, ok))[-1]["k"] == "done"
    finally:
        proc.stop()


async def test_redis_refusing_writes_loses_no_output_and_ends_the_request_typed(tiny_model_dir, tmp_path):
    """Redis full (`maxmemory` below its use, `noeviction`): every output write is refused with
    OOM. Nothing the engine produced may be dropped: the tokens stay queued, the request is given
    up after repeated refusals (engine slot freed) and, once Redis accepts writes again, the client
    finds every token followed by a retryable `output_write_failed`; the entry is acked and its
    concurrency lease released; the worker keeps serving."""
    server = LocalRedis().start()
    client = aioredis.from_url(server.url)
    keys = Keys("oom")
    proc = start_worker(server.url, "oom", tiny_model_dir, tmp_path, name="w-oom", metrics=True,
                        env={**FAST_CLAIM, "CLAIM_IDLE_MS": 60000, "MAX_BATCH": 1, "MAX_SEQ_LEN": 16384})
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        gw = "g-oom"
        rid = new_rid()
        await client.zadd(keys.conc("k"), {rid: int(time.time() * 1000) + 600_000})
        # long enough that the tiny model is still generating when the writer gives up (~5 s of
        # refusals): 2000 tokens took less than that on a fast CPU, and the request ended "done"
        await submit(client, keys, rid, gw=gw, key_id="k", prompt=PROMPT, max_tokens=16000, temperature=0.0)
        await wait_for_tokens(client, keys, rid, 10)
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory", str(used // 2))
        refused_at = await last_seq(client, keys, rid)
        found: dict = {}

        async def given_up() -> bool:      # the writer gave up: the engine dropped the request (its slot free)
            nonlocal found
            found = await scrape(proc)
            return sum(metric(found, "worker_num_requests_running", lane=lane) for lane in ("interactive", "batch")) \
                == 0 and metric(found, "worker_kv_cache_usage_perc") == 0
        assert await eventually(given_up, timeout=60, interval=0.1), proc.log()[-3000:]
        assert metric(found, "worker_generation_tokens_total") < 16000    # stopped early, not run to its end
        assert metric(found, "worker_redis_errors_total", kind="refused") > 0
        assert await last_seq(client, keys, rid) <= refused_at + 50      # writes really were refused
        await client.config_set("maxmemory", "0")                       # Redis accepts writes again

        events = await read_events(client, keys, rid, timeout=30)
        check_seqs(events)                                              # 1..S, no gap, no repeat
        final = events[-1]
        assert final["k"] == "err" and final["code"] == "output_write_failed" and final["retryable"] is True
        assert final["seq"] > refused_at            # tokens made while Redis refused were kept, then written
        assert final["seq"] < 16000
        ref = await submit(client, keys, prompt=PROMPT, max_tokens=final["seq"], temperature=0.0)
        assert text_of(events) == text_of(await read_events(client, keys, ref, timeout=60))
        # live: the inbox plus what a gateway reads from history to fill a gap; a live copy whose
        # own XADD was refused is dropped (history has it), which only the refusal can cause
        live, _ = await read_inbox(client, keys, gw, {rid}, timeout=10)
        assert [e["seq"] for e in client_view(live[rid], events)] == [e["seq"] for e in events]
        filled = {e["seq"] for e in events} - {e["seq"] for e in live[rid]}
        assert all(seq <= refused_at + 50 for seq in filled), sorted(filled)
        assert await pending_after_acks(client, keys) == 0
        assert await client.zscore(keys.conc("k"), rid) is None
        assert await owner_of(client, keys, rid) is None
        assert proc.alive()
    finally:
        proc.stop()
        await client.aclose()
        server.stop()


async def test_a_constrained_request_continues_on_another_worker(redis_server, redis_client, stream_prefix,
                                                                 tiny_model_dir, tmp_path):
    """Structured output across a SIGKILL: the claiming worker rebuilds the grammar's matcher by
    replaying the delivered tokens, so the document is finished under the same schema (and, greedy
    or seeded, is the very document an uninterrupted run writes)."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 10000, "maxLength": 10200},
                                               "color": {"enum": ["red", "green"]}}, "required": ["text", "color"]}
    grammar = {"type": "json_schema", "schema": schema}
    keys = Keys(stream_prefix)
    procs = two_workers(redis_server.url, stream_prefix, tiny_model_dir, tmp_path, {**FAST_CLAIM, "MAX_SEQ_LEN": 8192})
    try:
        greedy, seeded = new_rid(), new_rid()
        await submit_together(redis_client, keys, [entry(greedy, max_tokens=4000, temperature=0.0, grammar=grammar),
                                                   entry(seeded, max_tokens=4000, temperature=0.9, seed=7,
                                                         grammar=grammar)])
        await wait_for_tokens(redis_client, keys, greedy, 20)
        owner = await owner_of(redis_client, keys, greedy)
        victim = next(p for p, name in zip(procs, ("wa", "wb")) if name == owner)
        [engine] = engine_pids(victim.pid)
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        assert await eventually(lambda: not pid_alive(engine), timeout=10), "the engine process outlived its worker"
        for rid, params in ((greedy, dict(temperature=0.0)), (seeded, dict(temperature=0.9, seed=7))):
            before = await history(redis_client, keys, rid)
            events = await read_events(redis_client, keys, rid, timeout=60)
            assert events[-1]["k"] == "done" and events[-1]["finish_reason"] == "stop", events[-1]
            check_seqs(events)
            if rid == greedy:   # (the seeded one may not have started, or have run elsewhere)
                assert before and before[-1]["k"] == "tok", f"finished before the kill ({len(ids_of(before))} tokens)"
                assert {e["ep"] for e in events} == {1, 2}
            jsonschema.validate(json.loads(text_of(events)), schema)
            ref = await submit(redis_client, keys, prompt=PROMPT, max_tokens=4000, grammar=grammar, **params)
            assert ids_of(await read_events(redis_client, keys, ref, timeout=60)) == ids_of(events)
    finally:
        for p in procs:
            p.stop()

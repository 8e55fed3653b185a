"""Every MULTI and script the worker sends stays in one hash slot: a real `python -m worker`
against a redis-server in cluster mode that owns all 16384 slots (one node, so an ordinary
client needs no redirects, but Redis enforces CROSSSLOT on transactions and scripts exactly
as a multi-node cluster does). Streams, cancels, an attach, a lease release and a dead letter
all go through it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.localredis import free_cluster_port
from shared.streams import ENTRY_FIELD, Keys, encode_attach, encode_cancel
from tests.stack_fixtures import start_worker
from tests.worker_redis import (check_seqs, new_rid, owner_of, pending_after_acks, read_events, read_inbox, submit,
                                wait_for_tokens)


@pytest.fixture
def cluster_mode_redis():
    port = free_cluster_port()          # its cluster bus port (+10000) must be free and valid too
    data = tempfile.mkdtemp(prefix="llm-cluster-")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--cluster-enabled", "yes", "--cluster-config-file", f"{data}/nodes.conf",
                             "--dir", data, "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server (cluster mode) exited with {proc.returncode}")
            rc = subprocess.run(["redis-cli", "-p", str(port), "cluster", "addslotsrange", "0", "16383"],
                                capture_output=True, text=True)
            if rc.returncode == 0 and "OK" in rc.stdout:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not assign slots: {rc.stdout} {rc.stderr}")
            time.sleep(0.1)
        while "cluster_state:ok" not in subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"],
                                                       capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError("cluster state never became ok")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_worker_keeps_every_transaction_in_one_slot(cluster_mode_redis, tiny_model_dir, tmp_path):
    client = aioredis.from_url(cluster_mode_redis)
    keys = Keys("cl")
    # the server really enforces slots: a cross-slot MULTI is refused
    with pytest.raises(ResponseError, match="CROSSSLOT|EXECABORT|same slot"):
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(keys.meta("a"), 1)
            pipe.set(keys.requests, 1)
            await pipe.execute()
    proc = start_worker(cluster_mode_redis, "cl", tiny_model_dir, tmp_path, name="w-cl",
                        env={"MAX_BATCH": 4, "WORKER_HEARTBEAT_S": 0.5, "CLAIM_IDLE_MS": 5000})
    try:
        gw, gw2 = "g-a", "g-b"
        done_rid, cancel_rid, attach_rid = new_rid(), new_rid(), new_rid()
        await client.zadd(keys.conc("k"), {done_rid: int(time.time() * 1000) + 60_000})
        await submit(client, keys, done_rid, gw=gw, key_id="k", max_tokens=12)
        await submit(client, keys, cancel_rid, gw=gw, max_tokens=900, prompt="Count forever")
        await submit(client, keys, attach_rid, gw=gw, max_tokens=200, prompt="Another long one")
        await wait_for_tokens(client, keys, cancel_rid, 3)
        await client.xadd(keys.ctl(await owner_of(client, keys, cancel_rid)), {ENTRY_FIELD: encode_cancel(cancel_rid)})
        await wait_for_tokens(client, keys, attach_rid, 3)
        await client.hset(keys.meta(attach_rid), "gw", gw2)
        await client.xadd(keys.ctl("w-cl"), {ENTRY_FIELD: encode_attach(attach_rid, gw2, 1)})
        await client.xadd(keys.requests, {ENTRY_FIELD: b"\xc1 poison"})       # dead letter + ack on {q}

        live, _ = await read_inbox(client, keys, gw, {done_rid, cancel_rid}, timeout=60)
        moved, _ = await read_inbox(client, keys, gw2, {attach_rid}, timeout=60)
        assert moved[attach_rid][0]["k"] == "att"
        for rid, reason in ((done_rid, None), (cancel_rid, "cancelled"), (attach_rid, None)):
            events = await read_events(client, keys, rid)
            check_seqs(events)
            assert events[-1]["k"] == "done", events[-1]
            if reason:
                assert events[-1]["finish_reason"] == reason
        assert await pending_after_acks(client, keys) == 0
        assert await client.zscore(keys.conc("k"), done_rid) is None
        assert await client.xlen(keys.dead) == 1
        log = proc.log()
        assert "CROSSSLOT" not in log and "loop failed" not in log, log[-3000:]
        assert proc.alive()
    finally:
        proc.stop()
        await client.aclose()


async def test_history_calls_carry_one_request_each_where_the_node_enforces_slots(cluster_mode_redis):
    """The writer batches many requests into one history script call, which a node in cluster
    mode refuses (CROSSSLOT: each request's keys are in their own slot). Through a plain client
    it must notice the node's mode and write one request a call, so every request is written."""
    from shared.config import Settings
    from shared.redis_client import connect
    from shared.streams import decode_event_list
    from worker.engine import StepOutput
    from worker.events import InFlight, Progress
    from worker.output_writer import OutputWriter

    client = connect(cluster_mode_redis, socket_timeout=None)
    keys = Keys("hb")
    try:
        writer = OutputWriter(client, keys, Settings(stream_prefix="hb"), "w")
        states = [InFlight.start(f"r{i}", f"{i}-0", None, Progress(), epoch=1, gw="g") for i in range(6)]
        for st in states:
            await client.hset(keys.meta(st.rid), "epoch", 1)
            st.add_output(StepOutput(st.rid, " x", [5], False, None, 1, 1))
        await writer.commit(states)
        assert all(st.written_seq == 1 and not st.failures for st in states)
        inbox = [e for _, f in await client.xrange(keys.inbox("g")) for e in decode_event_list(f[ENTRY_FIELD])]
        assert sorted(e["rid"] for e in inbox) == [st.rid for st in states]
    finally:
        await client.aclose()

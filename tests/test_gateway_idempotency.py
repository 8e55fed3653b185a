"""Idempotency keys (issue 26 item 8): a `generate` sent again with the same key attaches to the
request the first one started instead of running it twice, per owner, over WebSocket and HTTP;
and a gateway lost between queueing a request and sending its `accepted` costs no double work,
with the SDKs' default keys.

Real Redis, real gateways, a real worker process (the synthetic engine: the production worker
service, its text a function of the token index, so an answer's exact text is known).
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import uuid

import httpx

from llm_stream_client import StreamClient
from shared.streams import CONSUMER_GROUP
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import StackSpec, gateway_in_process
from tests.worker_redis import read_events
from worker.synthetic import token_at

KEY_A, KEY_B = "sk-idem-a", "sk-idem-b"
API_KEYS = f"alice:{hashlib.sha256(KEY_A.encode()).hexdigest()},bob:{hashlib.sha256(KEY_B.encode()).hexdigest()}"


def expected_text(n: int) -> str:
    return "".join(token_at(i)[1] for i in range(1, n + 1))

STACK = StackSpec("w-idem", synthetic=True)


def settings(stack, **kw):
    return stack.settings(**{"api_keys": API_KEYS, **kw})


async def entries(redis_client, stack) -> int:
    """Request entries ever queued on the stack's prefix (delivered or not)."""
    groups = await redis_client.xinfo_groups(stack.keys.requests)
    return int(next(g for g in groups if g["name"] == CONSUMER_GROUP.encode())["entries-read"] or 0) + \
        int(next(g for g in groups if g["name"] == CONSUMER_GROUP.encode())["lag"] or 0)


async def test_a_repeated_generate_attaches_to_the_first_request(redis_server, redis_client, stack):
    async with gateway_in_process(settings(stack)) as gw:
        before = await entries(redis_client, stack)
        a1 = await GatewayClient.connect(gw.ws_url, headers={"Authorization": f"Bearer {KEY_A}"})
        first = await a1.generate("g1", prompt="x", max_tokens=40, idempotency_key="order-17")
        # the same socket: a second id for the same work is a client bug, said so
        await a1.send(type="generate", id="g2", prompt="x", max_tokens=40, idempotency_key="order-17")
        assert (await a1.recv("g2"))["code"] == "duplicate_id"
        # another socket of the same key (a reconnect that never saw `accepted`): the same request,
        # from its first token, under the id this socket chose; it streams there from now on, like
        # a resume, and the first socket is told so instead of being left silent
        a2 = await GatewayClient.connect(gw.ws_url, headers={"Authorization": f"Bearer {KEY_A}"})
        assert await a2.generate("again", prompt="x", max_tokens=40, idempotency_key="order-17") == first
        chunks, done = await a2.until_done("again")
        assert "".join(c["text"] for c in chunks) == expected_text(40) and done["seq"] == 40
        assert chunks[0]["seq"] - chunks[0]["tokens"] == 0
        _, taken = await a1.until_done("g1")
        assert taken["type"] == "done" and (taken["finish_reason"] != "error" or
                                            taken["error"]["code"] == "resumed_elsewhere"), taken
        # another API key with the same idempotency key: its own, new request
        b = await GatewayClient.connect(gw.ws_url, headers={"Authorization": f"Bearer {KEY_B}"})
        assert await b.generate("g1", prompt="x", max_tokens=5, idempotency_key="order-17") != first
        await b.until_done("g1")
        assert await entries(redis_client, stack) - before == 2
        for c in (a1, a2, b):
            await c.close()


async def test_anonymous_keys_must_carry_128_bits_and_are_shared_by_anonymous_clients(redis_server, redis_client,
                                                                                    stack):
    async with gateway_in_process(settings(stack, api_keys="")) as gw:   # keys optional
        c1 = await GatewayClient.connect(gw.ws_url)
        await c1.send(type="generate", id="s", prompt="x", max_tokens=5, idempotency_key="short-key")
        refused = await c1.recv("s")
        assert refused["type"] == "error" and refused["code"] == "invalid_request" and "128 bits" in refused["message"]
        secret = uuid.uuid4().hex
        await c1.send(type="generate", id="s", prompt="x", max_tokens=12, idempotency_key=secret)
        first = await c1.recv("s")
        c2 = await GatewayClient.connect(gw.ws_url)      # another anonymous identity: the secret is the proof
        await c2.send(type="generate", id="t", prompt="x", max_tokens=12, idempotency_key=secret)
        assert (await c2.recv("t"))["request_id"] == first["request_id"]
        chunks, _ = await c2.until_done("t")
        assert "".join(ch["text"] for ch in chunks) == expected_text(12)
        chunks, done = await c1.until_done("s")      # all of it, or handed over to c2 (typed)
        assert "".join(ch["text"] for ch in chunks) == expected_text(12) or \
            done["error"]["code"] == "resumed_elsewhere"
        for c in (c1, c2):
            await c.close()


async def test_the_http_idempotency_key_header(redis_server, redis_client, stack):
    async with gateway_in_process(settings(stack)) as gw:
        before = await entries(redis_client, stack)
        body = {"model": gw.settings.served_model_name, "prompt": "x", "max_tokens": 20}
        headers = {"Authorization": f"Bearer {KEY_A}", "Idempotency-Key": "invoice-9"}
        async with httpx.AsyncClient(base_url=gw.base, timeout=30) as http:
            first = await http.post("/v1/completions", json=body, headers=headers)
            second = await http.post("/v1/completions", json=body, headers=headers)
            bad = await http.post("/v1/completions", json=body, headers={**headers, "Idempotency-Key": "a b"})
        assert first.status_code == second.status_code == 200
        assert first.json()["id"] == second.json()["id"]
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"] == expected_text(20)
        assert await entries(redis_client, stack) - before == 1
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"


async def test_a_gateway_lost_before_accepted_costs_no_double_work(redis_server, redis_client, stack):
    """Gateway A queues requests and dies before their `accepted` goes out (its submit never
    returns, then its sockets are dropped: what a SIGKILL right after the submit looks like to
    the clients). The SDK sends each generate again, through gateway B, with its default
    idempotency key: each request runs once and every answer is exact."""
    async with gateway_in_process(settings(stack)) as gw_a, \
            gateway_in_process(settings(stack)) as gw_b:
        queued: list[str] = []
        dead = asyncio.Event()

        def submit_then_die(real_submit):
            async def submit(entry, **kwargs):
                first = await real_submit(entry, **kwargs)
                if first is None:         # queued (after `dead` is set, A reads the second generates
                    queued.append(entry.rid)   # its dropped sockets had buffered: B started them first)
                await dead.wait()                      # the reply never comes back while A "lives"
                return first
            return submit

        gw_a.probe.intercept_submit(submit_then_die)
        before = await entries(redis_client, stack)
        clients = [StreamClient([gw_a.ws_url, gw_b.ws_url], api_key=KEY_A, backoff_base_s=0.05) for _ in range(4)]
        try:
            for client in clients:
                await client.connect()
            # two requests a client: the first is queued by A, the second never gets read there
            gens = [client.generate(f"q{i}-{j}", max_tokens=30 + 2 * i + j)
                    for i, client in enumerate(clients) for j in range(2)]
            assert await eventually(lambda: len(queued) == len(clients), timeout=20)
            gw_a.probe.drop_connections()          # the gateway is gone
            texts = await asyncio.wait_for(asyncio.gather(*(g.collect() for g in gens)), 60)
        finally:
            dead.set()
            for client in clients:
                await client.close()
        assert texts == [expected_text(30 + 2 * i + j) for i in range(len(clients)) for j in range(2)]
        assert set(queued) <= {g.request_id for g in gens}          # the requests A queued are the ones that ran
        assert await entries(redis_client, stack) - before == len(gens)     # and nothing ran twice
        assert all(client.reconnects >= 1 for client in clients)



async def test_a_resend_racing_the_orphan_sweep_completes_exactly(redis_server, redis_client, stack):
    """Issue 34 item 6, the re-send/orphan race: a client's socket drops right after `generate`
    (its `accepted` lost) while its request is queued, the resume grace runs out, and it sends
    the generate again with the same idempotency key on another gateway just as the orphan sweep
    acts. The sweep's check and cancel are one step, so the re-send lands either before it (the
    sweep leaves the re-attached request alone) or after it (the re-send starts the request
    again rather than attaching to a cancelled one). Both orders, made deterministic: the
    worker is stopped (the requests stay queued) and the sweep is held at its decision on one
    request. Each answer is exact; before the fix, the second one ended `cancelled`."""
    g = settings(stack, resume_grace_s=0.2, sweep_interval_s=0.05)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    keys = stack.keys
    early_key, late_key = f"early-{uuid.uuid4().hex}", f"late-{uuid.uuid4().hex}"
    rids: dict[str, str] = {}
    deciding, decide = asyncio.Event(), asyncio.Event()

    def hold_the_early_one(real):
        async def cancel_orphan(rid, att=None):
            if rid == rids.get("early"):
                deciding.set()
                await decide.wait()
            return await real(rid, att)
        return cancel_orphan

    stack.worker.signal(signal.SIGSTOP)        # nothing runs: both requests stay queued
    try:
        async with gateway_in_process(g) as gw_a, gateway_in_process(g) as gw_b:
            for gw in (gw_a, gw_b):             # any replica's sweeper may take an orphan
                gw.probe.intercept_orphan_cancel(hold_the_early_one)
            before = await entries(redis_client, stack)
            c1 = await GatewayClient.connect(gw_a.ws_url, headers=auth)
            rids["early"] = await c1.generate("e", prompt="x", max_tokens=30, idempotency_key=early_key)
            rids["late"] = await c1.generate("l", prompt="x", max_tokens=31, idempotency_key=late_key)
            c1.ws.transport.abort()                  # gone: both are parked, the grace runs out

            async def swept() -> bool:     # the late one cancelled; the sweep holds at the early one
                return deciding.is_set() and bool(await redis_client.exists(keys.cancel(rids["late"])))
            assert await eventually(swept, timeout=10)
            c2 = await GatewayClient.connect(gw_b.ws_url, headers=auth)
            early = await c2.send_generate("e", prompt="x", max_tokens=30, idempotency_key=early_key)
            assert early["type"] == "accepted" and early["request_id"] == rids["early"], early   # attached
            late = await c2.send_generate("l", prompt="x", max_tokens=31, idempotency_key=late_key)
            assert late["type"] == "accepted" and late["request_id"] != rids["late"], late       # started again
            decide.set()                               # the sweep decides now: the early one was resumed
            stack.worker.signal(signal.SIGCONT)
            for cid, n in (("e", 30), ("l", 31)):
                chunks, done = await c2.until_done(cid, timeout=30)
                assert done["finish_reason"] == "length", (cid, done)
                assert "".join(ch["text"] for ch in chunks) == expected_text(n) and done["seq"] == n
            # the key names the new request now: sent once more, it attaches to that one
            again = await c2.send_generate("l2", prompt="x", max_tokens=31, idempotency_key=late_key)
            assert again["request_id"] == late["request_id"]
            chunks, _ = await c2.until_done("l2", timeout=30)
            assert "".join(ch["text"] for ch in chunks) == expected_text(31)
            await c2.close()
        cancelled = await read_events(redis_client, keys, rids["late"], timeout=30)
        assert [(e["k"], e["seq"], e.get("finish_reason")) for e in cancelled] == [("done", 0, "cancelled")]
        assert not await redis_client.exists(keys.cancel(rids["early"]))
        # the early request ran once, the late one's original never ran (cancelled) and its restart once
        assert await entries(redis_client, stack) - before == 3
    finally:
        stack.worker.signal(signal.SIGCONT)

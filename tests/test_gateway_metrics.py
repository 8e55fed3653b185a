"""The gateway's request metrics move as documented (docs/operations.md, "Metrics"): time to first
meaningful token, time to last token, cancels by origin, socket closes by reason, resumes by
outcome. Real gateway, real worker (synthetic engine), real sockets; read from the gateway's own
Prometheus registry."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import StackSpec, gateway_in_process
from tests.worker_redis import read_events

STACK = StackSpec("w-gm", synthetic=True)


def value(gw, name: str, **labels) -> float:
    return gw.probe.metric(name, labels)


async def final_of(redis_client, stack, rid: str) -> dict:
    """The last event the worker wrote for `rid` (its history): what the request really did."""
    return (await read_events(redis_client, stack.keys, rid, timeout=30))[-1]


async def test_request_cancel_resume_and_close_metrics(make_settings, stack, redis_client):
    settings = make_settings(resume_grace_s=0.3, sweep_interval_s=0.1)
    async with gateway_in_process(settings) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        request_id = await c.generate("a", prompt="x", max_tokens=20)
        a_chunks, a_done = await c.until_done("a")
        assert value(gw, "gateway_time_to_first_meaningful_token_seconds_count") == 1
        assert value(gw, "gateway_time_to_last_token_seconds_count") == 1
        assert value(gw, "gateway_time_to_last_token_seconds_sum") >= value(gw, "gateway_ttft_seconds_sum")

        rid_b = await c.generate("b", prompt="x", max_tokens=2000)
        await c.send(type="cancel", id="b")
        _, done = await c.until_done("b")
        assert done["finish_reason"] == "cancelled"
        assert value(gw, "gateway_cancels_total", origin="client") == 1
        assert (await final_of(redis_client, stack, rid_b))["finish_reason"] == "cancelled"   # the worker stopped it

        await c.send(type="resume", id="again", last_seq=0, request_id=request_id)
        again_chunks, again_done = await c.until_done("again")
        # the resume delivered the finished request again, whole
        assert "".join(ch["text"] for ch in again_chunks) == "".join(ch["text"] for ch in a_chunks)
        assert (again_done["seq"], again_done["finish_reason"]) == (a_done["seq"], a_done["finish_reason"])
        await c.send(type="resume", id="nope", last_seq=0, request_id=uuid.uuid4().hex)
        assert (await c.recv("nope"))["code"] == "resume_expired"
        assert value(gw, "gateway_resumes_total", outcome="attached") == 1
        assert value(gw, "gateway_resumes_total", outcome="resume_expired") == 1

        # a socket that drops with a request running: not resumed within the grace, it is cancelled
        rid_c = await c.generate("c", prompt="x", max_tokens=2000)
        c.ws.transport.abort()
        assert await eventually(lambda: value(gw, "gateway_socket_closes_total", reason="lost") == 1)
        assert await eventually(lambda: value(gw, "gateway_cancels_total", origin="orphan") == 1, timeout=10)
        final = await final_of(redis_client, stack, rid_c)          # the worker stopped it, short of 2000
        assert final["finish_reason"] == "cancelled" and final["usage"]["completion_tokens"] < 2000

        polite = await GatewayClient.connect(gw.ws_url)
        await polite.close()
        assert await eventually(lambda: value(gw, "gateway_socket_closes_total", reason="client") == 1)

        # an HTTP client that goes away cancels its request
        body = {"model": gw.settings.served_model_name, "prompt": "x", "max_tokens": 2000, "stream": True}
        async with httpx.AsyncClient(base_url=gw.base, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                rid_http = resp.headers["x-request-id"]
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        break
        assert await eventually(lambda: value(gw, "gateway_cancels_total", origin="http_disconnect") == 1)
        final = await final_of(redis_client, stack, rid_http)       # the worker stopped it, short of 2000
        assert final["finish_reason"] == "cancelled" and final["usage"]["completion_tokens"] < 2000
        assert await eventually(lambda: value(gw, "gateway_live_workers") == 1, timeout=10)
        assert value(gw, "gateway_queue_depth", state="queued") == 0
        text = (await asyncio.to_thread(lambda: httpx.get(gw.base + "/metrics").text))
        for name in ("gateway_cancels_total", "gateway_socket_closes_total", "gateway_resumes_total",
                     "gateway_time_to_first_meaningful_token_seconds_bucket", "gateway_time_to_last_token_seconds_bucket"):
            assert name in text

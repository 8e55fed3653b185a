"""The Python client SDK (clients/python) against the real stack: Redis, gateway, worker (tiny model).

Generate, cancel, many concurrent requests on one socket, typed refusals, and the point of the
SDK: a gateway SIGKILLed mid-answer is invisible to the caller, whose iterator yields exactly
the text of an uninterrupted greedy run.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal

import pytest

from gateway.settings import GatewaySettings
from llm_stream_client import GenerationFailed, RequestRefused, StreamClient, Unauthorized
from tests.stack_fixtures import gateway_in_process, prefix_with_worker, start_gateway

GW_ENV = {"RESUME_GRACE_S": 10, "FLUSH_INTERVAL_MS": 30}


@pytest.fixture(scope="module")
def sdk_stack(redis_server, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with prefix_with_worker(redis_server.url, tiny_model_dir, logs, name="w-sdk") as prefix:
        yield prefix


def settings(redis_server, prefix, **kw) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, stream_prefix=prefix, heartbeat_s=5, **kw)


async def test_generate_and_concurrent_requests_on_one_socket(redis_server, sdk_stack):
    async with gateway_in_process(settings(redis_server, sdk_stack)) as gw:
        async with StreamClient(gw.ws_url) as client:
            alone = {}
            for i in range(3):
                alone[i] = await client.generate(f"Story {i}:", max_tokens=24, temperature=0).collect()
            gens = [client.generate(f"Story {i}:", max_tokens=24, temperature=0) for i in range(3)]
            seqs = {i: [] for i in range(3)}

            async def consume(i):
                async for chunk in gens[i]:
                    seqs[i].append(chunk.seq)
                return gens[i]

            done = await asyncio.gather(*(consume(i) for i in range(3)))
            assert client.reconnects == 0
            for i, gen in enumerate(done):
                assert gen.text == alone[i] and gen.text, i
                assert gen.result.finish_reason in ("stop", "length")
                assert seqs[i] == sorted(set(seqs[i])) and gen.result.seq == seqs[i][-1]
                assert gen.request_id is not None
            assert len({g.request_id for g in done}) == 3
            messages = await client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=5).collect()
            assert isinstance(messages, str)


async def test_cancel_ends_with_cancelled(redis_server, sdk_stack):
    async with gateway_in_process(settings(redis_server, sdk_stack)) as gw:
        async with StreamClient(gw.ws_url) as client:
            gen = client.generate("Once upon a time", max_tokens=2000, temperature=0)
            async for chunk in gen:
                await gen.cancel()
            assert gen.result.finish_reason == "cancelled"
            assert 0 < gen.result.usage["completion_tokens"] < 2000


async def test_refusals_are_typed(redis_server, sdk_stack):
    key = "sk-test-sdk"
    api_keys = f"tester:{hashlib.sha256(key.encode()).hexdigest()}"
    async with gateway_in_process(settings(redis_server, sdk_stack, api_keys=api_keys, max_tokens_cap=64)) as gw:
        with pytest.raises(Unauthorized):
            async with StreamClient(gw.ws_url, api_key="wrong", max_reconnect_attempts=2):
                pass
        async with StreamClient(gw.ws_url, api_key=key) as client:
            with pytest.raises(RequestRefused) as refused:
                await client.generate("x", max_tokens=65).collect()
            assert refused.value.code == "max_tokens_too_large" and not refused.value.retryable
            with pytest.raises(RequestRefused) as refused:
                await client.generate("x", temperature=5).collect()
            assert refused.value.code == "invalid_request"
            assert await client.generate("x", max_tokens=4, temperature=0).collect() is not None
            assert client.reconnects == 0       # refusals never cost the socket
    assert issubclass(GenerationFailed, Exception)


async def test_gateway_killed_mid_stream_is_invisible_to_the_caller(redis_server, sdk_stack, tmp_path):
    """Two gateways; the client's socket is on A, A is SIGKILLed after 20 tokens: the client
    reconnects to B, resumes with its last seq and request_id, and the caller's iterator yields
    exactly the greedy reference text, once."""
    gw_a, base_a = start_gateway(redis_server.url, sdk_stack, tmp_path, name="gw-a", env=GW_ENV)
    gw_b, base_b = start_gateway(redis_server.url, sdk_stack, tmp_path, name="gw-b", env=GW_ENV)
    urls = [b.replace("http", "ws") + "/v1/stream" for b in (base_a, base_b)]
    try:
        async with StreamClient(urls[1]) as ref_client:
            reference = await ref_client.generate("Once upon a time", max_tokens=400, temperature=0).collect()
        async with StreamClient(urls, backoff_base_s=0.1) as client:
            gen = client.generate("Once upon a time", max_tokens=400, temperature=0)
            tokens = 0
            killed_at = None
            async for chunk in gen:
                tokens += chunk.tokens
                if killed_at is None and tokens >= 20:
                    killed_at = chunk.seq
                    gw_a.signal(signal.SIGKILL)
            assert killed_at is not None and killed_at < gen.result.seq
            assert client.reconnects == 1
            assert gen.text == reference
            assert tokens == gen.result.usage["completion_tokens"]
            assert gen.result.finish_reason in ("length", "stop")
    finally:
        gw_a.stop()
        gw_b.stop()

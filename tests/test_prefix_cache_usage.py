"""The prefix cache is visible to users (issue 25 item 2): the second request that shares a long
prompt prefix reports the prompt tokens the worker's cache served, in the WebSocket `done.usage`
and in OpenAI's own `usage.prompt_tokens_details.cached_tokens`, through the official SDK."""

from __future__ import annotations

import openai
import pytest

from tests.gateway_client import GatewayClient
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker

SYSTEM = "You are a careful assistant. " * 30      # ~180 tokens: several full KV blocks


@pytest.fixture(scope="module")
def cache_stack(redis_server, tiny_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("pc-logs"),
                            name="w-prefix-usage") as prefix:
        yield prefix


async def test_cached_prompt_tokens_are_reported_on_both_apis(redis_server, cache_stack):
    async with gateway_in_process(gateway_settings(redis_server.url, cache_stack)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        usages = []
        for i, question in enumerate(("What is Redis?", "What is a stream?")):
            await c.send(type="generate", id=f"q{i}", max_tokens=4, temperature=0,
                         messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
            _, done = await c.until_done(f"q{i}")
            usages.append(done["usage"])
        await c.close()
        assert usages[0]["cached_tokens"] == 0
        assert 100 <= usages[1]["cached_tokens"] < usages[1]["prompt_tokens"]     # the system prompt's blocks

        client = openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)
        answer = await client.chat.completions.create(
            model=gw.settings.served_model_name, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And a consumer group?"}])
        assert answer.usage.prompt_tokens_details.cached_tokens >= 100
        stream = await client.chat.completions.create(
            model=gw.settings.served_model_name, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And XAUTOCLAIM?"}])
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert usage and usage[0].prompt_tokens_details.cached_tokens >= 100

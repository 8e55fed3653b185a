"""Tenants apart in the prefix cache (issue 34 item 2, vLLM's `cache_salt`): tenant B sending
tenant A's exact prompt gets `cached_tokens` 0 and is computed cold (the worker's prefix-cache
hit counter does not move); the same tenant still hits; an explicit `cache_salt` shares on
purpose across keys, over the WebSocket and OpenAI's API; the route key is scoped the same way.

Real Redis, a real in-process gateway with two API keys, a real worker on the tiny model."""

from __future__ import annotations

import hashlib
import uuid

import openai
import pytest

from gateway.cache_scope import cache_scope
from shared.routing import route_key
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings, metric, scrape, worker_process

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
API_KEYS = f"alice:{hashlib.sha256(KEY_A.encode()).hexdigest()},bob:{hashlib.sha256(KEY_B.encode()).hexdigest()}"
SYSTEM = "You are a careful assistant for the accounts team. " * 20     # several full KV blocks


@pytest.fixture(scope="module")
def cache_stack(redis_server, tiny_model_dir, tmp_path_factory):
    prefix = f"wtenant{uuid.uuid4().hex[:8]}"
    with worker_process(redis_server.url, prefix, tiny_model_dir, tmp_path_factory.mktemp("tenant-logs"),
                        name="w-tenant", metrics=True) as worker:
        yield prefix, worker


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def test_tenants_share_no_cached_blocks_unless_they_agree_on_a_salt(redis_server, cache_stack):
    prefix, worker = cache_stack
    settings = gateway_settings(redis_server.url, prefix, api_keys=API_KEYS)
    async with gateway_in_process(settings) as gw:
        usages = []

        async def ask(key: str, rid: str, question: str, **extra) -> dict:
            c = await GatewayClient.connect(gw.ws_url, headers={"Authorization": f"Bearer {key}"})
            await c.send(type="generate", id=rid, max_tokens=2, temperature=0, messages=messages(question), **extra)
            _, done = await c.until_done(rid)
            await c.close()
            usages.append(done["usage"])
            return done["usage"]

        before = await scrape(worker)
        hits0 = metric(before, "worker_prefix_cache_hits_total")
        queries0 = metric(before, "worker_prefix_cache_queries_total")
        assert (await ask(KEY_A, "a1", "What is in ledger 7?"))["cached_tokens"] == 0
        assert (await ask(KEY_B, "b1", "What is in ledger 7?"))["cached_tokens"] == 0     # A's exact prompt: cold
        assert (await ask(KEY_A, "a2", "What is in ledger 7?"))["cached_tokens"] >= 100    # the same tenant hits
        # an explicit salt is shared on purpose, across keys; it is its own scope (no hit on A's own blocks)
        assert (await ask(KEY_A, "a3", "And ledger 8?", cache_salt="team-shared"))["cached_tokens"] == 0
        assert (await ask(KEY_B, "b2", "And ledger 8?", cache_salt="team-shared"))["cached_tokens"] >= 100
        # the worker computed B's first prompt cold: its hit counter holds exactly the hits reported
        # (a2's and b2's), and every prompt token of the five requests was looked up
        reported_hits = sum(u["cached_tokens"] for u in usages)
        prompt_tokens = sum(u["prompt_tokens"] for u in usages)

        async def counters() -> bool:
            found = await scrape(worker)
            return (metric(found, "worker_prefix_cache_queries_total") - queries0 == prompt_tokens
                    and metric(found, "worker_prefix_cache_hits_total") - hits0 == reported_hits)
        assert await eventually(counters, timeout=15)

        # OpenAI's API: the body's `cache_salt` (vLLM's field), and the default scope per key
        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0)
        answer = await client(KEY_B).chat.completions.create(
            model=gw.settings.served_model_name, max_tokens=2, temperature=0,
            messages=messages("And ledger 8?"), extra_body={"cache_salt": "team-shared"})
        assert answer.usage.prompt_tokens_details.cached_tokens >= 100
        answer = await client(KEY_B).chat.completions.create(
            model=gw.settings.served_model_name, max_tokens=2, temperature=0, messages=messages("And ledger 9?"))
        assert answer.usage.prompt_tokens_details.cached_tokens >= 100     # B's own scope, warmed by b1
        fresh = await client(KEY_A).chat.completions.create(
            model=gw.settings.served_model_name, max_tokens=2, temperature=0, messages=messages("Hello?"),
            extra_body={"cache_salt": "nobody-else"})
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        # the Responses API takes the same field: B's response under the shared salt hits A's blocks
        shared = await client(KEY_B).responses.create(
            model=gw.settings.served_model_name, max_output_tokens=2, temperature=0, instructions=SYSTEM,
            input="And ledger 8?", extra_body={"cache_salt": "team-shared"})
        assert shared.usage.input_tokens_details.cached_tokens >= 100
        alone = await client(KEY_B).responses.create(
            model=gw.settings.served_model_name, max_output_tokens=2, temperature=0, instructions=SYSTEM,
            input="And ledger 8?", extra_body={"cache_salt": "another-team"})
        assert alone.usage.input_tokens_details.cached_tokens == 0


def test_route_keys_are_scoped_like_the_cache():
    opening = messages("What is in ledger 7?")
    a, b = cache_scope("alice", None), cache_scope("bob", None)
    assert a != b and route_key(None, None, opening, a) != route_key(None, None, opening, b)
    assert route_key("conv-1", None, None, a) != route_key("conv-1", None, None, b)
    shared = cache_scope("alice", "team"), cache_scope("bob", "team")
    assert shared[0] == shared[1] != a
    # key-less servers: every anonymous client is in the one deployment-wide scope, keys unchanged
    assert cache_scope("anon:1f2e", None) == cache_scope("anon:9a9a", None) == ""
    assert route_key(None, None, opening, "") == route_key(None, None, opening)

"""What vLLM's clients and benchmarks send, against the real stack (Redis, an in-process
gateway, a worker process on the tiny model): `GET /health` and `/version`, `ignore_eos`,
`stream_options.continuous_usage_stats`, and guidellm itself (the vLLM project's serving
benchmark) run with its default request shape, which must finish with no errored request."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.settings import GatewaySettings
from shared.streams import ENTRY_FIELD, Keys, RequestEntry
from tests.gateway_client import eventually
from tests.stack_fixtures import gateway_in_process, prefix_with_worker

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def vllm_stack(redis_server, tiny_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("logs"), name="w-vllm") as prefix:
        yield prefix


def settings(redis_server, prefix) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, stream_prefix=prefix, heartbeat_s=5)


async def test_health_and_version(redis_server, vllm_stack):
    async with gateway_in_process(settings(redis_server, vllm_stack)) as gw:
        async with httpx.AsyncClient(base_url=gw.base) as http:
            # ready once its inbox reader's first read has come back (503 until then, as /readyz)
            assert await eventually(lambda: _ok(http, "/health"), timeout=30)
            for path in ("/health", "/v1/health"):
                r = await http.get(path)
                assert r.status_code == 200 and r.json() == {"status": "ok"}, path
            version = (await http.get("/version")).json()
            assert isinstance(version["version"], str) and version["version"]
            await gw.probe.drain(timeout=5)          # what SIGTERM starts: load balancers must stop sending
            r = await http.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "draining"}


async def test_health_waits_for_a_live_worker_where_readyz_does_not(redis_server, stream_prefix):
    """A stack whose worker is still loading its model: /health (what guidellm checks before it
    sends) answers 503 with the reason, so a benchmark started too early stops at its check
    instead of getting `overloaded` for every request; /readyz (a load balancer's) stays 200, so
    the gateway keeps answering clients with typed errors meanwhile."""
    async with gateway_in_process(settings(redis_server, stream_prefix)) as gw:   # no worker on it
        async with httpx.AsyncClient(base_url=gw.base) as http:
            assert await eventually(lambda: _ok(http, "/readyz"), timeout=30)
            for path in ("/health", "/v1/health"):
                r = await http.get(path)
                assert r.status_code == 503, (path, r.text)
                assert r.json() == {"status": "unavailable", "reason": "no worker is alive to serve requests yet"}
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text


async def _ok(http, path: str) -> bool:
    return (await http.get(path)).status_code == 200


async def test_ignore_eos_reaches_the_engine_and_runs_to_max_tokens(redis_server, redis_client, vllm_stack):
    async with gateway_in_process(settings(redis_server, vllm_stack)) as gw:
        client = AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=60)
        out = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
        entries = await redis_client.xrange(Keys(vllm_stack).requests)
        sent = [RequestEntry.decode(fields[ENTRY_FIELD]) for _, fields in entries]
        assert [e.params.ignore_eos for e in sent if e.rid == out.id.split("-", 1)[1]] == [True]
        plain = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        entries = await redis_client.xrange(Keys(vllm_stack).requests)
        sent = [RequestEntry.decode(fields[ENTRY_FIELD]) for _, fields in entries]
        assert [e.params.ignore_eos for e in sent if e.rid == plain.id.split("-", 1)[1]] == [False]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(redis_server, vllm_stack, chat):
    async with gateway_in_process(settings(redis_server, vllm_stack)) as gw:
        client = AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=60)
        options = {"include_usage": True, "continuous_usage_stats": True}
        if chat:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=40, temperature=0,
                stream=True, stream_options=options, extra_body={"ignore_eos": True})
        else:
            stream = await client.completions.create(model=MODEL, prompt="Count to ten", max_tokens=40, temperature=0,
                                                     stream=True, stream_options=options,
                                                     extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 40 and final.usage.prompt_tokens > 0
        with_text = [c for c in chunks if c.choices and ((c.choices[0].delta.content if chat else c.choices[0].text))]
        assert with_text and all(c.usage is not None for c in with_text)
        counts = [c.usage.completion_tokens for c in with_text]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] <= 40
        assert {c.usage.prompt_tokens for c in chunks if c.usage} == {final.usage.prompt_tokens}
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks if c.usage)
        # without the option the chunks carry no usage (OpenAI's shape)
        plain = await client.completions.create(model=MODEL, prompt="Count", max_tokens=5, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        plain_chunks = [c async for c in plain]
        assert plain_chunks[-1].usage is not None and all(c.usage is None for c in plain_chunks[:-1])


def _guidellm() -> list[str]:
    exe = Path(sys.executable).with_name("guidellm")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "guidellm"]


async def test_guidellm_with_its_defaults_finishes_with_no_errors(redis_server, vllm_stack, tiny_model_dir, tmp_path):
    """guidellm as its README runs it: the openai_http backend (which checks GET /health and asks
    /v1/models for the model), synthetic prompts of fixed lengths (it sends `ignore_eos` and
    `continuous_usage_stats`), a synchronous profile, stopped by a request count. The tokenizer
    is the model's own, from a directory (no hub)."""
    async with gateway_in_process(settings(redis_server, vllm_stack)) as gw:
        report = tmp_path / "guidellm.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = await asyncio.create_subprocess_exec(
            *_guidellm(), "run", "--backend", f"kind=openai_http,target={gw.base}",
            "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=6",
            "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
            "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=tmp_path)
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        text = out.decode(errors="replace")
        assert proc.returncode == 0, text[-4000:]
        data = json.loads(report.read_text())
        totals = data["benchmarks"][0]["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["successful"] >= 6, (totals, text[-3000:])

"""`n` choices and completions `echo` with prompt logprobs over the OpenAI API (issue 36),
driven with the official `openai` package and raw SSE.

`n`: each choice is a request of its own, seeded seed + i, so a seeded answer is reproducible,
its choices differ, and choice i is exactly what a single request with seed + i answers; the
prompt is counted once in the usage and the choices' completion tokens summed; streamed, every
chunk names its choice's `index` and each choice finishes exactly once; a client that goes away
cancels every choice; the later choices take the prompt's KV blocks from the prefix cache.
`echo`: the prompt comes before the answer; with `logprobs`, its tokens carry theirs (the first
null) in the completions shape, and they are what a request with the whole text as its prompt
reports; `max_tokens: 0` answers the prompt alone; token-id prompts answer as their text does.

Real Redis, an in-process gateway, a tiny-model worker process (SmolLM2's real tokenizer).
"""

from __future__ import annotations

import hashlib
import re
import uuid

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from tests.gateway_client import GatewayClient, eventually
from shared.localredis import free_port
from tests.stack_fixtures import StackSpec, gateway_in_process, scrape
from tests.test_openai_api import sse_dropped_after

STACK = StackSpec("w-choices", env={"WORKER_METRICS_PORT": str(free_port())})
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, in a land far away, there lived a lighthouse keeper who " * 3


def oai(gw, key: str = "none") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0, timeout=60)


async def test_seeded_choices_are_reproducible_differ_and_each_is_its_single_request(stack):
    async with gateway_in_process(stack.settings()) as gw:
        client = oai(gw)
        ask = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
        r = await client.completions.create(n=3, **ask)
        again = await client.completions.create(n=3, **ask)
        texts = [c.text for c in r.choices]
        assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
        assert [c.text for c in again.choices] == texts
        singles = [await client.completions.create(**{**ask, "seed": 11 + i}) for i in range(3)]
        assert [s.choices[0].text for s in singles] == texts
        assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens       # the prompt once
        assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 24
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, temperature=1.0, seed=3, n=2)
        assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content != \
            chat.choices[1].message.content
        assert chat.usage.completion_tokens == 10


async def test_streamed_choices_carry_their_index_and_each_ends_once(stack):
    async with gateway_in_process(stack.settings()) as gw:
        client = oai(gw)
        ask = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=4)
        whole = await client.completions.create(**ask)
        texts, finishes, usage = {}, {}, None
        async for chunk in await client.completions.create(stream=True, stream_options={"include_usage": True},
                                                           **ask):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason is not None:
                    assert c.index not in finishes, "a choice ends exactly once"
                    finishes[c.index] = c.finish_reason
        assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
        assert finishes == {i: "length" for i in range(4)}
        assert usage.completion_tokens == 48 and usage.prompt_tokens == whole.usage.prompt_tokens
        # the later choices took the prompt's blocks from the cache (the first computed them)
        before = await prefix_hits(stack)
        fresh = {**ask, "prompt": "A different opening: " + PROMPT, "stream": False}
        await client.completions.create(**fresh)
        assert await prefix_hits(stack) - before >= 3 * 16      # 3 later choices, at least a block each


async def prefix_hits(stack) -> float:
    return sum(v for (name, _), v in (await scrape(stack.worker)).items() if name == "worker_prefix_cache_hits_total")


async def test_a_client_that_goes_away_cancels_every_choice(stack):
    async with gateway_in_process(stack.settings()) as gw:
        async with httpx.AsyncClient(base_url=gw.base, timeout=60) as http:
            def cancelled(text: str) -> float:
                m = re.search(r'^gateway_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
                return float(m.group(1)) if m else 0.0
            before = cancelled((await http.get("/metrics")).text)
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "n": 3, "stream": True,
                    "temperature": 1.0, "ignore_eos": True}
            await sse_dropped_after(http, "/v1/completions", body, 2)

            async def all_cancelled() -> bool:
                return cancelled((await http.get("/metrics")).text) == before + 3
            assert await eventually(all_cancelled, timeout=10, interval=0.05), (before, (await http.get("/metrics")).text)


async def test_an_answer_is_all_its_choices_or_an_error_and_a_retry_gets_the_same_answer(stack):
    """Per-key limits count each choice: when the third cannot start (429), the two that did are
    cancelled and nothing is left running; an Idempotency-Key names every choice (`<key>:i`)."""
    key = "sk-choices"
    keys = f"tester:{hashlib.sha256(key.encode()).hexdigest()}"
    async with gateway_in_process(stack.settings(api_keys=keys, per_key_concurrency=2)) as gw:
        client = oai(gw, key)
        ask = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0)
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(n=3, **ask)
        assert info.value.body["code"] == "concurrency_limit"
        redis = aioredis.from_url(stack.redis_url)
        try:    # the two cancelled choices end (their worker confirms) and give their slots back
            async def slots_free() -> bool:
                return await redis.zcard(stack.keys.conc("tester")) == 0
            assert await eventually(slots_free, timeout=20, interval=0.05)
        finally:
            await redis.aclose()
        idem = {"Idempotency-Key": f"answer-{uuid.uuid4().hex}"}
        first = await client.completions.create(n=2, extra_headers=idem, **ask)
        again = await client.completions.create(n=2, extra_headers=idem, **ask)
        assert again.id == first.id and [c.text for c in again.choices] == [c.text for c in first.choices]


async def test_refusals_name_their_parameter(stack):
    async with gateway_in_process(stack.settings(max_n=4)) as gw:
        client = oai(gw)
        ask = dict(model=MODEL, prompt="Hi", max_tokens=2)
        for fields, param in [({"n": 5}, "n"), ({"n": 0}, "n"), ({"best_of": 3}, "best_of"),
                              ({"n": 2, "extra_body": {"resumable": True}}, "resumable"),
                              ({"prompt": ["a", "b"]}, "prompt"), ({"max_tokens": 0}, "max_tokens")]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(**{**ask, **fields})
            assert info.value.body["param"] == param, (fields, info.value.body)
        same = await client.completions.create(**ask, n=2, best_of=2, temperature=0)   # best_of = n: the n
        assert len(same.choices) == 2 and same.choices[0].text == same.choices[1].text


async def test_echo_with_logprobs_gives_the_prompts_tokens_as_a_whole_prompt_would(stack):
    async with gateway_in_process(stack.settings()) as gw:
        client = oai(gw)
        r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2)
        plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        lp = r.choices[0].logprobs
        n_prompt = r.usage.prompt_tokens
        assert r.choices[0].text == PROMPT + plain.choices[0].text and r.usage.completion_tokens == 4
        assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens[:n_prompt]) == PROMPT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert all(len(top) in (2, 3) and top.get(tok) == p for tok, p, top in
                   zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
        # the prompt alone (max_tokens 0, as lm-evaluation-harness asks): the same prompt entries
        alone = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                                temperature=0)
        w = alone.choices[0]
        assert w.text == PROMPT and alone.usage.completion_tokens == 0 and w.finish_reason == "length"
        assert w.logprobs.tokens == lp.tokens[:n_prompt] and w.logprobs.text_offset == lp.text_offset[:n_prompt]
        assert w.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-5)
        # a token-id prompt (lm-evaluation-harness's) answers as its text does
        ids = (await httpx.AsyncClient(base_url=gw.base).post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
        by_ids = await client.completions.create(model=MODEL, prompt=[ids], max_tokens=4, temperature=0, echo=True,
                                                 logprobs=2)
        assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
        assert by_ids.choices[0].text == r.choices[0].text
        # streamed: the prompt and its logprobs come first, in the first chunk
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True)]
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
        assert chunks[0].choices[0].text.startswith(PROMPT)
        assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


async def test_the_websocket_generate_frame_takes_echo_and_prompt_logprobs(stack):
    async with gateway_in_process(stack.settings()) as gw:
        ws = await GatewayClient.connect(gw.ws_url)
        try:
            await ws.generate("e", prompt=PROMPT, max_tokens=3, echo=True, prompt_logprobs=1)
            chunks, done = await ws.until_done("e")
        finally:
            await ws.close()
        assert done["type"] == "done" and done["finish_reason"] == "length"
        first = chunks[0]
        assert first["prompt_text"] == PROMPT and "logprob" not in first["prompt_logprobs"][0]
        assert all(len(e["top_logprobs"]) == 1 for e in first["prompt_logprobs"][1:])
        assert "".join(e["token"] for e in first["prompt_logprobs"]) == PROMPT
        assert all("prompt_text" not in c for c in chunks[1:])

"""vLLM's `POST /tokenize` and `POST /detokenize` (gateway.openai.tokenize): a request/reply over
Redis with a live worker, answered by its engine's tokenizer and prompt building.

Real Redis, an in-process gateway, a worker process on the tiny model (SmolLM2's real
tokenizer), in its engine process (the default) and with ENGINE_PROCESS=false."""

from __future__ import annotations

import hashlib
import time
import uuid

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.openai import tokenize as tokenize_api
from shared.streams import Keys
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker
from worker.engine import build_prompt_ids

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, a lighthouse keeper counted 12 ships."
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
MAX_SEQ_LEN = 1536


@pytest.fixture(scope="module", params=["engine-process", "engine-thread"])
def tok_stack(request, redis_server, tiny_model_dir, tmp_path_factory):
    env = {"MAX_SEQ_LEN": MAX_SEQ_LEN, "ENGINE_PROCESS": "true" if request.param == "engine-process" else "false"}
    with prefix_with_worker(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("tok-logs"),
                            name=f"w-tok-{request.param}", env=env) as prefix:
        yield prefix


async def post(gw, path: str, body, **kw) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.base, timeout=30) as http:
        return await http.post(path, json=body, **kw)


async def test_a_prompt_gets_the_worker_tokenizers_ids(redis_server, tok_stack, tokenizer):
    want = tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    async with gateway_in_process(gateway_settings(redis_server.url, tok_stack)) as gw:
        r = await post(gw, "/tokenize", {"model": MODEL, "prompt": PROMPT})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": len(want), "max_model_len": MAX_SEQ_LEN, "tokens": want, "token_strs": None}
        r = await post(gw, "/tokenize", {"prompt": PROMPT, "return_token_strs": True, "add_special_tokens": False})
        got = r.json()
        assert got["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
        # and back: /detokenize gives the text again
        r = await post(gw, "/detokenize", {"model": MODEL, "tokens": want})
        assert r.status_code == 200 and r.json() == {"prompt": PROMPT}, r.text
        assert gw.probe.subscriptions == 0      # every one-shot reply subscription is gone


async def test_a_chat_gets_exactly_the_ids_a_generate_runs(redis_server, tok_stack, tokenizer):
    sent = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]}]
    # what the request entry carries for those: developer is system, text parts joined
    entry = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    async with gateway_in_process(gateway_settings(redis_server.url, tok_stack)) as gw:
        for tools in (None, [WEATHER]):
            r = await post(gw, "/tokenize", {"model": MODEL, "messages": sent, "tools": tools,
                                             "return_token_strs": True})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["tokens"] == build_prompt_ids(tokenizer, None, entry, tools)
            assert got["count"] == len(got["tokens"])
            assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
            # the generate itself: its prompt is as many tokens
            client = AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=60)
            done = await client.chat.completions.create(model=MODEL, messages=sent, max_tokens=1, temperature=0,
                                                        **({"tools": tools} if tools else {}))
            assert done.usage.prompt_tokens == got["count"]
        # vLLM's chat options: no assistant turn opened, or the last message left open
        talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
        for options, kwargs in (({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                                ({"continue_final_message": True}, {"continue_final_message": True,
                                                                    "add_generation_prompt": False}),
                                ({"add_special_tokens": True}, {"add_generation_prompt": True})):
            r = await post(gw, "/tokenize", {"messages": talk, **options})
            assert r.status_code == 200, (options, r.text)
            want = tokenizer.apply_chat_template(talk, tokenize=True, return_dict=False, **kwargs)
            if options.get("add_special_tokens"):
                text = tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True)
                want = tokenizer(text, add_special_tokens=True)["input_ids"]
            assert r.json()["tokens"] == list(want), options
        assert gw.probe.subscriptions == 0


def _error(r: httpx.Response, status: int, code: str, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    return error


async def test_bad_requests_are_typed_400s_naming_their_parameter(redis_server, tok_stack, tokenizer):
    async with gateway_in_process(gateway_settings(redis_server.url, tok_stack, max_prompt_chars=100)) as gw:
        async with httpx.AsyncClient(base_url=gw.base, timeout=30) as http:
            r = await http.post("/tokenize", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        _error(await post(gw, "/tokenize", {"prompt": 5}), 400, None, "prompt")
        _error(await post(gw, "/tokenize", {"prompt": "x", "chat_template": "{{x}}"}), 400,
               "unsupported_parameter", "chat_template")
        _error(await post(gw, "/tokenize", {"messages": []}), 400, "invalid_request", "messages")
        _error(await post(gw, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                            "continue_final_message": True, "add_generation_prompt": True}),
               400, "invalid_request", "continue_final_message")
        _error(await post(gw, "/tokenize", {"prompt": "x" * 101}), 400, "prompt_too_large", "prompt")
        _error(await post(gw, "/tokenize", {"model": "gpt-4o", "prompt": "x"}), 404, "model_not_found", "model")
        _error(await post(gw, "/detokenize", {"model": "gpt-4o", "tokens": [1]}), 404, "model_not_found", "model")
        _error(await post(gw, "/detokenize", {"tokens": "12"}), 400, None, "tokens")
        _error(await post(gw, "/detokenize", {"tokens": [1] * 101}), 400, "prompt_too_large", "tokens")
        # out of the vocabulary: below 0 (the gateway sees it), at its size (the worker does)
        for bad in (-1, len(tokenizer), 2**40):
            error = _error(await post(gw, "/detokenize", {"tokens": [1, bad]}), 400, "invalid_request", "tokens")
            assert str(bad) in error["message"]
        assert gw.probe.subscriptions == 0


async def test_api_keys_are_checked(redis_server, tok_stack):
    keys = f"a:{hashlib.sha256(b'sk-good').hexdigest()}"
    async with gateway_in_process(gateway_settings(redis_server.url, tok_stack, api_keys=keys)) as gw:
        _error(await post(gw, "/tokenize", {"prompt": "x"}), 401, "unauthorized", None)
        _error(await post(gw, "/detokenize", {"tokens": [1]}, headers={"Authorization": "Bearer sk-bad"}), 401,
               "unauthorized", None)
        r = await post(gw, "/detokenize", {"tokens": [1]}, headers={"Authorization": "Bearer sk-good"})
        assert r.status_code == 200, r.text


async def test_no_worker_alive_is_a_503_with_retry_after(redis_server, redis_client):
    prefix = f"tok{uuid.uuid4().hex[:8]}"
    async with gateway_in_process(gateway_settings(redis_server.url, prefix)) as gw:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = await post(gw, path, body)
            _error(r, 503, "overloaded", None)
            assert r.headers["Retry-After"] == "1"
        assert gw.probe.subscriptions == 0
    assert not [k for k in await redis_client.keys(f"{prefix}:*") if b":{w:" in k]


async def test_a_worker_that_never_answers_is_a_503_and_leaves_nothing_behind(redis_server, redis_client,
                                                                              monkeypatch):
    """A worker in the registry that does not answer (hung, or older than tokenize): 503
    `stalled` after REPLY_TIMEOUT_S; one that left the registry is never sent anything."""
    monkeypatch.setattr(tokenize_api, "REPLY_TIMEOUT_S", 0.3)
    keys = Keys(f"tok{uuid.uuid4().hex[:8]}")
    await redis_client.hset(keys.worker("mute"), mapping={"capacity": 4, "state": "ready"})
    await redis_client.zadd(keys.workers, {"mute": int(time.time() * 1000) + 60_000})
    async with gateway_in_process(gateway_settings(redis_server.url, keys.prefix)) as gw:
        error = _error(await post(gw, "/tokenize", {"prompt": "x"}), 503, "stalled", None)
        assert "mute" in error["message"]
        assert await redis_client.xlen(keys.ctl("mute")) == 1
        assert gw.probe.subscriptions == 0
        # it deregisters (one DEL of its hash and control stream); a snapshot that still lists it
        # sends it nothing: no control stream is made again for it
        await redis_client.delete(keys.worker("mute"), keys.ctl("mute"))
        gw.probe.keep_worker_snapshot(3600)     # the snapshot still lists it
        assert await gw.probe.live_workers() == ["mute"]
        _error(await post(gw, "/detokenize", {"tokens": [1]}), 503, "overloaded", None)
        assert not await redis_client.exists(keys.ctl("mute"))
        assert gw.probe.subscriptions == 0

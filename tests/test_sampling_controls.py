"""vLLM's sampling controls from a client's field to the worker's `SamplingParams`: accepted on
the WebSocket `generate` and the OpenAI bodies, refused out of range with a typed error naming
the field, carried through the Redis request entry (and left out of it while neutral, so workers
older than a control read requests that do not use it). tests/test_engine_penalties.py checks
what the engine does with them, tests/test_openai_compat_table.py each one through the API."""

from __future__ import annotations

import json
import time

import msgpack
import pytest

from gateway.new_request import sampling_params
from gateway.openai.schema import parse_body
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import parse_client_message
from shared.sampling import NEUTRAL, SamplingParams
from shared.streams import ENTRY_FIELD, Keys, RequestEntry
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import gateway_in_process, gateway_settings

CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.3,
            "logit_bias": {"42": 5, "7": -100}, "min_p": 0.1, "top_k": 40, "min_tokens": 3,
            "stop_token_ids": [2, 99], "include_stop_str_in_output": True, "skip_special_tokens": False}


def generate(**fields):
    return parse_client_message({"type": "generate", "id": "a", "prompt": "hi", **fields})


def test_every_control_reaches_the_request_entry_and_survives_redis():
    params = sampling_params(generate(**CONTROLS), 16)
    assert params == SamplingParams(max_tokens=16, presence_penalty=0.5, frequency_penalty=-1.25,
                                    repetition_penalty=1.3, logit_bias={42: 5.0, 7: -100.0}, min_p=0.1, top_k=40,
                                    min_tokens=3, stop_token_ids=[2, 99], include_stop_str_in_output=True,
                                    skip_special_tokens=False)
    entry = RequestEntry(rid="r", params=params, prompt="hi")
    assert RequestEntry.decode(entry.encode()) == entry
    # neutral controls are not written: a worker that predates them reads the entry as before
    plain = msgpack.unpackb(RequestEntry(rid="r", params=sampling_params(generate(), 16), prompt="hi").encode())
    assert not set(NEUTRAL) & set(plain["params"])
    assert sampling_params(generate(top_k=-1, logit_bias={}), 16) == SamplingParams(max_tokens=16)   # vLLM's "off"


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", "1.1"),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 100.5}), ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("min_p", -0.1), ("min_p", 1.01), ("top_k", -2), ("top_k", 1001), ("min_tokens", -1),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(129))), ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", 0)])
def test_bad_values_are_invalid_requests_naming_the_field(field, value):
    with pytest.raises(ProtocolError) as info:
        generate(**{field: value})
    assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.param == field


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ProtocolError) as info:
        sampling_params(generate(min_tokens=9), 8)
    assert info.value.param == "min_tokens" and info.value.request_id == "a"


@pytest.mark.parametrize("raw", [
    {"presence_penalty": 9.0}, {"repetition_penalty": -1.0}, {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: 500}},
    {"min_p": 2.0}, {"min_tokens": 99}, {"stop_token_ids": ["a"]}, {"skip_special_tokens": 1}])
def test_a_malformed_control_in_a_redis_entry_is_refused(raw):
    with pytest.raises(ValueError):
        RequestEntry.decode(msgpack.packb({"v": 1, "rid": "a", "prompt": "x", "params": {"max_tokens": 8, **raw}}))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_both_openai_bodies_carry_the_controls(chat):
    body = {"model": "m", "max_tokens": 16, **CONTROLS, "top_k": -1, "presence_penalty": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    _, fields = parse_body(json.dumps(body).encode(), chat)
    msg = parse_client_message({"type": "generate", "id": "a", **fields})
    assert sampling_params(msg, 16) == SamplingParams(
        max_tokens=16, frequency_penalty=-1.25, repetition_penalty=1.3, logit_bias={42: 5.0, 7: -100.0}, min_p=0.1,
        min_tokens=3, stop_token_ids=[2, 99], include_stop_str_in_output=True, skip_special_tokens=False)


async def test_the_websocket_carries_the_controls_and_names_a_bad_one(redis_server, redis_client, stream_prefix):
    """Over a real socket: a generate with every control is accepted and its Redis entry holds
    them (a registered worker that reads nothing: the entry stays queued, to be read here); a
    bad value is an `error` frame with code invalid_request and the field in `param`."""
    keys = Keys(stream_prefix)
    await redis_client.zadd(keys.workers, {"w-idle": int(time.time() * 1000)})   # admission sees a live worker
    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw:
        c = await GatewayClient.connect(gw.ws_url)
        request_id = await c.generate("ok", prompt="hi", max_tokens=6, **CONTROLS)
        ((_, fields),) = await redis_client.xrange(keys.requests)
        entry = RequestEntry.decode(fields[ENTRY_FIELD])
        assert entry.rid == request_id and entry.params == sampling_params(generate(temperature=0.0, **CONTROLS), 6)
        for field, value in (("presence_penalty", 3), ("min_tokens", 7), ("logit_bias", {"a": 1})):
            await c.send(type="generate", id="bad", prompt="hi", max_tokens=6, **{field: value})
            reply = await c.recv("bad")
            assert (reply["type"], reply["code"], reply["param"]) == ("error", "invalid_request", field), reply
        await c.close()


def test_docs_protocol_lists_every_generate_field():
    """docs/protocol.md's `generate` table has a row for each field the gateway accepts."""
    import re
    from pathlib import Path

    from shared.protocol import Generate
    text = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    table = text.split("### `generate`", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `([a-z_]+)`", table, re.M))
    assert set(Generate.model_fields) - {"v", "type"} == documented

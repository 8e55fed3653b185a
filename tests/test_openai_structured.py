"""Structured output and tool calling through the OpenAI API (issue 28 items 3 and 4), with the
official `openai` package and LangChain's `bind_tools`, and `response_format` on the WebSocket.

Real Redis, an in-process gateway, a worker running a tiny random Qwen2 whose chat template takes
tools (tests/tool_model.py). The model's words are arbitrary, so the tests check what is enforced
(every JSON answer validates against its schema; a required or named call is made, with
arguments that validate against the function's parameters) and how answers are read and
streamed, not the model's judgement.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.gateway_client import GatewayClient
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker
from tests.test_openai_api import sse_events
from tests.tool_model import make_tool_model_dir

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "age"]},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"]},
    "enums-arrays": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
        "required": ["color", "tags"]},
}


SCHEMA_LIMIT = 1500      # the worker's GRAMMAR_MAX_SCHEMA_BYTES here: every other schema here fits (<= ~0.7 KB)
BIG = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(60)}}   # ~1.9 KB


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("tool-model") / "qwen2")


@pytest.fixture(scope="module")
def tool_stack(redis_server, tool_model_dir, tmp_path_factory):
    with prefix_with_worker(redis_server.url, tool_model_dir, tmp_path_factory.mktemp("tool-logs"),
                            name="w-tools", env={"GRAMMAR_MAX_SCHEMA_BYTES": SCHEMA_LIMIT}) as prefix:
        yield prefix


@pytest.fixture
async def gw(redis_server, tool_stack):
    async with gateway_in_process(gateway_settings(redis_server.url, tool_stack)) as gw:
        yield gw


def client(gw) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key="none", max_retries=0, timeout=120)


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name],
                                                   "strict": True}}


async def chat(gw, **fields):
    return await client(gw).chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 200, **fields})


async def streamed(gw, **fields) -> tuple[str, dict[int, dict], str | None, list]:
    """(content, tool calls by index as accumulated from deltas, finish_reason, chunks)."""
    content, calls, finish, chunks = "", {}, None, []
    async for c in await chat(gw, stream=True, **fields):
        chunks.append(c)
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.index not in calls:    # a call's first delta: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish, chunks


# ---------------------------------------------------------------- response_format

@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_json_schema_answers_validate(gw, name):
    for seed in (1, 2):
        r = await chat(gw, response_format=json_schema(name), temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
        content, calls, finish, _ = await streamed(gw, response_format=json_schema(name), temperature=1.0, seed=seed)
        assert content == r.choices[0].message.content and calls == {} and finish == "stop"


async def test_json_object_and_text(gw):
    r = await chat(gw, response_format={"type": "json_object"}, max_tokens=30, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith("{")      # a random model need not close it within max_tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = await chat(gw, max_tokens=10, temperature=0)
    same = await chat(gw, max_tokens=10, temperature=0, response_format={"type": "text"})
    assert plain.choices[0].message.content == same.choices[0].message.content


async def test_completions_take_response_format(gw):
    r = await client(gw).completions.create(model=MODEL, prompt="A JSON object:", max_tokens=200, temperature=0,
                                            extra_body={"response_format": json_schema("enums-arrays")})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["enums-arrays"])


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema"},                                                  # no json_schema
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},   # no name
    {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
    {"type": "yaml"},
    # the engine's compiler refuses these (the worker answers before any token)
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
])
async def test_a_bad_response_format_is_a_typed_400(gw, fmt):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            r = await chat(gw, response_format=fmt, stream=stream)
            if stream:
                async for _ in r:
                    pass
        body = info.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == "response_format", body


async def test_a_schema_over_the_size_limit_is_a_typed_400_naming_its_field(gw):
    """GRAMMAR_MAX_SCHEMA_BYTES refuses in the worker, before any compile: a 400 whose `param` is
    the field the schema came from (`tools` for a forced call's), streamed or not."""
    big_fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG}}
    big_tool = {"type": "function", "function": {"name": "big", "parameters": BIG}}
    for fields, param in (({"response_format": big_fmt}, "response_format"),
                          ({"tools": [big_tool], "tool_choice": "required"}, "tools")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                r = await chat(gw, stream=stream, **fields)
                if stream:
                    async for _ in r:
                        pass
            body = info.value.body
            assert (body["type"], body["param"]) == ("invalid_request_error", param), body
            assert "GRAMMAR_MAX_SCHEMA_BYTES" in body["message"] and str(SCHEMA_LIMIT) in body["message"], body


# ---------------------------------------------------------------- tools

def check_call(name: str, arguments: str) -> None:
    schema = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}[name]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_forced_call_is_made_and_validates(gw, choice):
    """A forced call is made, validates and streams the same; also with a `response_format` beside
    it, accepted as OpenAI accepts it (the Agents SDK sends its output_type so) and changing
    nothing: a forced turn has no text to format."""
    made = []
    for seed in (1, 2, 3):
        r = await chat(gw, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=seed)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, r
        (call,) = msg.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        check_call(call.function.name, call.function.arguments)
        content, calls, finish, chunks = await streamed(gw, tools=[WEATHER, TIME], tool_choice=choice,
                                                        temperature=1.0, seed=seed)
        assert content == "" and finish == "tool_calls" and list(calls) == [0]
        assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments
        made.append(call.function)
    r = await chat(gw, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=1,
                   response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "tool_calls" and [c.function for c in r.choices[0].message.tool_calls] \
        == made[:1]


async def test_auto_and_none(gw):
    """`auto`: the model is free (a random one rarely calls), and whatever it says comes back as
    content or calls, with the finish reason that says what ended it (the same streamed);
    `none`: plain text, the tools not shown."""
    for seed in (1, 2):
        r = await chat(gw, tools=[WEATHER], tool_choice="auto", temperature=1.0, seed=seed, max_tokens=20)
        choice, msg = r.choices[0], r.choices[0].message
        assert (msg.content or "") or msg.tool_calls
        if msg.tool_calls:
            assert choice.finish_reason == "tool_calls", r
            for call in msg.tool_calls:
                assert call.function.name == "get_weather"
        elif r.usage.completion_tokens < 20:
            assert choice.finish_reason == "stop", r            # ended by the model, before max_tokens
        else:
            assert r.usage.completion_tokens == 20 and choice.finish_reason in ("length", "stop"), r
        content, calls, finish, _ = await streamed(gw, tools=[WEATHER], tool_choice="auto", temperature=1.0,
                                                   seed=seed, max_tokens=20)
        assert finish == choice.finish_reason and content == (msg.content or "")
        assert [c["name"] for c in calls.values()] == [c.function.name for c in msg.tool_calls or ()]
    without = await chat(gw, max_tokens=10, temperature=0)
    none = await chat(gw, tools=[WEATHER], tool_choice="none", max_tokens=10, temperature=0)
    assert none.choices[0].message.content == without.choices[0].message.content
    assert none.choices[0].finish_reason == without.choices[0].finish_reason
    assert none.usage.prompt_tokens == without.usage.prompt_tokens       # the tools are not in the prompt
    assert none.choices[0].message.tool_calls is None


async def test_tool_results_go_back_to_the_model(gw, tool_model_dir):
    """The agent loop: the assistant's call appended as the SDK returns it, then the tool's
    answer, which reaches the model's prompt: the prompt the worker counts is the model's chat
    template over the whole conversation, the tool's text included (rendered here with the
    model's own tokenizer), and a longer tool answer makes it longer by just that."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    r = await chat(gw, tools=[WEATHER], tool_choice="required", temperature=0)
    call = r.choices[0].message.tool_calls[0]
    counted = []
    for result in ('{"temp": 21}', '{"temp": 21, "sky": "clear", "wind": "a light breeze from the west"}'):
        messages = [*CHAT, r.choices[0].message.model_dump(),
                    {"role": "tool", "tool_call_id": call.id, "content": result}]
        again = await chat(gw, messages=messages, tools=[WEATHER], max_tokens=10, temperature=0)
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
        rendered = tokenizer.apply_chat_template(
            [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
             {"role": "tool", "tool_call_id": call.id, "content": result}],
            tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        assert f"<tool_response>\n{result}\n</tool_response>" in rendered
        assert again.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"]), \
            (again.usage, rendered)
        counted.append(again.usage.prompt_tokens)
    assert counted[1] > counted[0]
    with pytest.raises(openai.BadRequestError) as info:    # a tool answer must say which call
        await chat(gw, messages=[*CHAT, {"role": "tool", "content": "x"}])
    assert info.value.body["param"] == "messages[1].tool_call_id"


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),                                    # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
async def test_bad_tools_are_typed_400s(gw, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        await chat(gw, **fields)
    assert info.value.body["param"] == param, info.value.body


async def test_raw_sse_tool_call_deltas(gw):
    """OpenAI's wire shape: the first delta of a call carries id, type and name; then arguments."""
    import httpx
    async with httpx.AsyncClient(base_url=gw.base, timeout=60) as http:
        resp = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True})
    events = [json.loads(d) for _, d in sse_events(resp.text.split("\n")) if d != "[DONE]"]
    deltas = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"] and deltas[0]["type"] == "function" and deltas[0]["function"]["name"] == "get_weather"
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    check_call("get_weather", "".join(d["function"]["arguments"] for d in deltas))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def tool_parts(events: list[tuple[int | None, dict]]) -> tuple[str, dict[int, dict], list[str]]:
    """Content, tool calls by index (id, name, arguments joined from the deltas), finish reasons."""
    content, calls, finish = "", {}, []
    for _, e in events:
        for ch in e.get("choices", []):
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                for field in ("id", "name"):
                    got = tc.get(field) or tc["function"].get(field)
                    if got:
                        assert call[field] is None, ("sent twice", tc)
                        call[field] = got
                call["arguments"] += tc["function"].get("arguments") or ""
            if ch.get("finish_reason"):
                finish.append(ch["finish_reason"])
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", "auto"])
async def test_tool_call_deltas_resume_exactly_at_every_event(redis_server, tool_stack, choice):
    """`GET /v1/streams/{id}` with `Last-Event-ID` after any event of a tool-calling answer goes on
    with the same call ids, no repeated head, and the arguments' rest (issue 34 item 1): what the
    client had plus what the resume sends is the uninterrupted stream, on another gateway too."""
    import httpx
    body = {"model": MODEL, "messages": CHAT, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 60,
            "temperature": 1.0, "seed": 7, "stream": True, "resumable": True}
    settings = gateway_settings(redis_server.url, tool_stack, resume_rate_per_min=0, resume_grace_s=30)
    async with gateway_in_process(settings) as gw, gateway_in_process(settings) as other:
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(gw.base + "/v1/chat/completions", json=body)
            ref = [(eid, json.loads(d)) for eid, d in sse_events(resp.text.split("\n")) if d != "[DONE]"]
            full = tool_parts(ref)
            if choice == "required":
                assert full[1] and full[2] == ["tool_calls"], full
            oai_id = ref[0][1]["id"]
            points = sorted({0} | {eid for eid, _ in ref if eid is not None})
            for k, base in ((k, (gw, other)[i % 2].base) for i, k in enumerate(points)):
                got = await http.get(base + f"/v1/streams/{oai_id}", headers={"Last-Event-ID": str(k)})
                assert got.status_code == 200, (k, got.text)
                rest = [(eid, json.loads(d)) for eid, d in sse_events(got.text.split("\n")) if d != "[DONE]"]
                assert not any("error" in e for _, e in rest), (k, rest)
                # all finals carry the last token's id: a client that saw the finish chunk is done
                before = [(eid, e) for eid, e in ref if eid is not None and eid <= k
                          and not any(ch.get("finish_reason") for ch in e.get("choices", []))]
                assert tool_parts(before + rest) == full, k


# ---------------------------------------------------------------- LangChain

async def test_langchain_bind_tools(gw):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class get_weather(BaseModel):
        """The forecast for a city."""
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(model=MODEL, base_url=gw.base + "/v1", api_key="none", max_retries=0, temperature=0,
                     max_tokens=200)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = await bound.ainvoke([HumanMessage("Weather in Paris for 3 days?")])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    get_weather.model_validate(call["args"])
    # streamed: LangChain gathers the tool call chunks into the same call
    gathered = None
    async for chunk in bound.astream([HumanMessage("Weather in Paris for 3 days?")]):
        gathered = chunk if gathered is None else gathered + chunk
    assert [c["name"] for c in gathered.tool_calls] == ["get_weather"] and gathered.tool_calls[0]["args"] == call["args"]
    # the agent loop: the call and its result go back
    reply = await llm.bind_tools([get_weather]).ainvoke(
        [HumanMessage("Weather in Paris for 3 days?"), msg, ToolMessage('{"temp": 21}', tool_call_id=call["id"])])
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------- WebSocket

async def test_websocket_generate_takes_response_format(gw):
    ws = await GatewayClient.connect(gw.ws_url)
    try:
        await ws.send(type="generate", id="j1", messages=CHAT, max_tokens=200, temperature=0,
                      response_format=json_schema("nested"))
        events, done = await ws.until_done("j1")
        text = "".join(e["text"] for e in events if e["type"] == "chunk")
        assert done["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
        await ws.send(type="generate", id="j2", messages=CHAT, response_format={"type": "json_schema"})
        err = await ws.recv("j2")
        assert err["type"] == "error" and err["code"] == "invalid_request" and "response_format" in err["message"]
        # refused by the worker (over GRAMMAR_MAX_SCHEMA_BYTES): a typed error naming the field
        await ws.send(type="generate", id="j3", messages=CHAT,
                      response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": BIG}})
        _, done = await ws.until_done("j3")
        error = done.get("error") or done
        assert (error["code"], error.get("param")) == ("invalid_request", "response_format"), done
        assert "GRAMMAR_MAX_SCHEMA_BYTES" in error["message"], done
    finally:
        await ws.close()


async def tool_frames_until_done(ws: GatewayClient, id: str) -> list[dict]:
    """Every frame of `id` until its `done`: chunks and typed tool frames, in order."""
    frames = []
    while not frames or frames[-1]["type"] != "done":
        frames.append(await ws.recv(id, timeout=60))
        assert frames[-1]["type"] != "error", frames[-1]
    return frames


def calls_of(frames: list[dict]) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for f in frames:
        if f["type"] == "tool_call":
            assert f["index"] not in calls, f
            calls[f["index"]] = {"call_id": f["call_id"], "name": f["name"], "deltas": "", "done": None}
        elif f["type"] == "tool_call_delta":
            calls[f["index"]]["deltas"] += f["arguments"]
        elif f["type"] == "tool_call_done":
            assert calls[f["index"]]["done"] is None, f
            calls[f["index"]]["done"] = f["arguments"]
            assert f["call_id"] == calls[f["index"]]["call_id"] and f["name"] == calls[f["index"]]["name"]
    return calls


async def test_websocket_tool_calls_come_as_typed_frames_also_after_a_resume(gw):
    """A generate with tools gets `tool_call` / `tool_call_delta` / `tool_call_done` frames
    before the chunk (or `done`) whose `seq` they carry, the chunks still holding all the text;
    a socket dropped after its first chunk and resumed on another misses none and gets none twice."""
    ws = await GatewayClient.connect(gw.ws_url)
    try:
        await ws.send(type="generate", id="t1", messages=CHAT, max_tokens=200, temperature=0, tools=[WEATHER],
                      tool_choice="required")
        rid = (await ws.recv("t1"))["request_id"]
        frames = await tool_frames_until_done(ws, "t1")
    finally:
        await ws.close()
    for i, f in enumerate(frames):
        if f["type"].startswith("tool_call"):
            assert f["seq"] == next(g for g in frames[i:] if g["type"] in ("chunk", "done"))["seq"]
    (call,) = calls_of(frames).values()
    text = "".join(f["text"] for f in frames if f["type"] == "chunk")
    assert json.loads(text) == {"name": "get_weather", "arguments": json.loads(call["done"])}
    assert call["name"] == "get_weather" and call["call_id"].startswith("call_") and rid not in call["call_id"]
    assert call["done"].startswith(call["deltas"]) and call["deltas"]
    check_call("get_weather", call["done"])
    assert frames[-1]["finish_reason"] == "stop"

    first = await GatewayClient.connect(gw.ws_url)
    await first.send(type="generate", id="t2", messages=CHAT, max_tokens=200, temperature=0, tools=[WEATHER],
                     tool_choice="required")
    rid2 = (await first.recv("t2"))["request_id"]
    had = []
    while not had or had[-1]["type"] != "chunk":
        had.append(await first.recv("t2", timeout=60))
    first.ws.transport.abort()                         # no close frame: a dropped connection
    second = await GatewayClient.connect(gw.ws_url)
    try:
        await second.send(type="resume", id="t2", last_seq=had[-1]["seq"], request_id=rid2)
        assert (await second.recv("t2"))["type"] == "accepted"
        rest = await tool_frames_until_done(second, "t2")
    finally:
        await second.close()
    (again,) = calls_of(had + rest).values()
    assert again["done"] == call["done"] and again["deltas"] == call["deltas"]      # greedy: the same call
    assert again["call_id"] != call["call_id"]                                       # (each request's own)
    assert "".join(f["text"] for f in had + rest if f["type"] == "chunk") == text

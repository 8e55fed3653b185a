"""The OpenAI Responses API (issue 35) through the official `openai` SDK: create (plain, streamed,
background), `responses.stream`, retrieve (poll, and re-attach with `starting_after`), cancel,
delete, input_items, a tool round trip with `function_call_output`, `previous_response_id`.

Real Redis, in-process gateways, a worker running the tiny Qwen2 whose chat template takes tools
(tests/tool_model.py). The model's words are arbitrary: the tests compare the Responses answers
with the chat completion of the same prompt, and check shapes and exactness, not the words.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path
from typing import Annotated

import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.gateway_client import eventually
from tests.stack_fixtures import gateway_in_process, gateway_settings, prefix_with_worker
from tests.tool_model import make_tool_model_dir

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Tell me about the weather in Paris."
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def tool_stack(redis_server, tmp_path_factory):
    model_dir = make_tool_model_dir(tmp_path_factory.mktemp("resp-model") / "qwen2")
    with prefix_with_worker(redis_server.url, model_dir, tmp_path_factory.mktemp("resp-logs"), name="w-resp") as prefix:
        yield prefix


KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
API_KEYS = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())


@pytest.fixture
async def gw(redis_server, tool_stack):
    async with gateway_in_process(gateway_settings(redis_server.url, tool_stack, resume_grace_s=0,
                                                   api_keys=API_KEYS)) as gw:
        yield gw


def client(gw, key: str = KEYS["alice"]) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0, timeout=120)


async def chat_text(gw, messages, **fields) -> str:
    r = await client(gw).chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)
    return r.choices[0].message.content


async def finished(c: AsyncOpenAI, resp_id: str):
    """Poll until the response has ended; the last poll."""
    polls = []

    async def ended():
        polls.append(await c.responses.retrieve(resp_id))
        return polls[-1].status not in ("queued", "in_progress")
    assert await eventually(ended, timeout=60, interval=0.1)
    return polls[-1]


def check_sequence(events: list) -> None:
    """Numbered 0.. without a gap, opened and closed as OpenAI's are."""
    assert [e.sequence_number for e in events] == list(range(events[0].sequence_number,
                                                              events[0].sequence_number + len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed")


async def test_create_plain_and_streamed_agree_with_chat(gw):
    c = client(gw)
    want = await chat_text(gw, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
                           max_tokens=30)
    r = await c.responses.create(model=MODEL, input=PROMPT, instructions="Be brief.", max_output_tokens=30,
                                 temperature=0, metadata={"k": "v"}, user="u1", reasoning={"effort": None})
    assert r.id.startswith("resp_") and r.object == "response" and r.output_text == want
    assert r.status in ("completed", "incomplete") and r.metadata == {"k": "v"}
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    u = r.usage
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"

    events = [e async for e in await c.responses.create(model=MODEL, input=PROMPT, instructions="Be brief.",
                                                         max_output_tokens=30, temperature=0, stream=True)]
    check_sequence(events)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and events[-1].response.usage.output_tokens == u.output_tokens

    async with c.responses.stream(model=MODEL, input=PROMPT, instructions="Be brief.", max_output_tokens=30,
                                  temperature=0) as stream:
        seen = [e async for e in stream]
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == want
    if seen[-1].type == "response.completed":    # (the SDK's final response is a completed one's only)
        assert (await stream.get_final_response()).output_text == want


async def test_storage_poll_input_items_delete_and_other_keys(gw):
    c = client(gw)
    r = await c.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
                                                                                   "text": PROMPT}]}],
                                 max_output_tokens=8, temperature=0)
    got = await c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = await c.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == [PROMPT]
    bob = client(gw, KEYS["bob"])
    for call in (bob.responses.retrieve(r.id), bob.responses.delete(r.id), bob.responses.input_items.list(r.id),
                 bob.responses.create(model=MODEL, input="hi", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):      # another key's: as if it did not exist
            await call
    await c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(r.id)
    unstored = await c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(unstored.id)


async def test_background_poll_reattach_and_cancel(gw):
    c = client(gw)
    r = await c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=40, temperature=0, background=True)
    assert r.status == "queued" and r.background

    final = await finished(c, r.id)
    want = await chat_text(gw, [{"role": "user", "content": PROMPT}], max_tokens=40)
    assert final.output_text == want

    everything = [e async for e in await c.responses.retrieve(r.id, stream=True)]
    check_sequence(everything)
    n = len(everything) // 2
    rest = [e async for e in await c.responses.retrieve(r.id, stream=True, starting_after=n)]
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in everything[n + 1:]]

    long = await c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2000, background=True,
                                    extra_body={"priority": "interactive"})
    cancelled = await c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert (await c.responses.retrieve(long.id)).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        await c.responses.cancel(final.id if not final.background else (await c.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=2)).id)


async def test_tool_round_trip_and_previous_response_id(gw):
    c = client(gw)
    r = await c.responses.create(model=MODEL, input=PROMPT, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=100)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = [e async for e in await c.responses.create(model=MODEL, input=PROMPT, tools=[WEATHER],
                                                         tool_choice={"type": "function", "name": "get_weather"},
                                                         max_output_tokens=100, stream=True)]
    check_sequence(events)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments and json.loads(args)

    follow = await c.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=20,
                                      temperature=0, input=[{"type": "function_call_output",
                                                             "call_id": calls[0].call_id, "output": "sunny"}])
    # the same conversation sent whole, as chat messages
    want = await chat_text(gw, [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}], tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=20)
    assert follow.output_text == want and follow.previous_response_id == r.id
    assert follow.usage.input_tokens_details.cached_tokens > 0      # the same worker held the first turn's prefix


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"previous_response_id": "resp_" + "1" * 32}, "previous_response_id"),
    ({"include": ["bogus"]}, "include"),
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"frequency": 1}, "frequency"),
])
async def test_refusals_are_typed_400s(gw, fields, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
        await client(gw).responses.create(**{"model": MODEL, "input": PROMPT, **fields}) if "frequency" not in fields \
            else await client(gw).responses.create(model=MODEL, input=PROMPT, extra_body=fields)
    assert info.value.body["param"] == param



async def test_langchain_chat_openai_on_the_responses_api(gw):
    """LangChain's `ChatOpenAI(use_responses_api=True)`: a forced call, then the agent loop's
    next turn with the call's result, plain and streamed."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    class get_weather(BaseModel):
        """The forecast for a city."""
        city: str = Field(max_length=12)

    llm = ChatOpenAI(model=MODEL, base_url=gw.base + "/v1", api_key=KEYS["alice"], max_retries=0, temperature=0,
                     max_tokens=60, use_responses_api=True)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = await bound.ainvoke([HumanMessage(PROMPT)])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    get_weather.model_validate(call["args"])
    gathered = None
    async for chunk in bound.astream([HumanMessage(PROMPT)]):
        gathered = chunk if gathered is None else gathered + chunk
    assert [c["name"] for c in gathered.tool_calls] == ["get_weather"]
    reply = await llm.bind_tools([get_weather]).ainvoke(
        [HumanMessage(PROMPT), msg, ToolMessage('{"temp": 21}', tool_call_id=call["id"])])
    assert reply.response_metadata["status"] in ("completed", "incomplete")
    streamed = None
    async for chunk in llm.astream([HumanMessage(PROMPT)]):
        streamed = chunk if streamed is None else streamed + chunk
    plain = await llm.ainvoke([HumanMessage(PROMPT)])
    assert streamed.text == plain.text and plain.text



async def test_openai_agents_sdk_tool_round_trip(gw):
    """The OpenAI Agents SDK (`openai-agents`): an `Agent` with a `function_tool` on the Responses
    API runs the whole loop here: the model calls the tool (forced on the first turn, with the
    agent's `output_type` sent as `text.format` beside it; the SDK resets `tool_choice` after a
    tool ran), the SDK runs the tool and sends its output back as a `function_call_output`, and
    the next turn answers in the output type's JSON (the grammar ends it). Plain, then streamed
    (`Runner.run_streamed`, the SDK reading the typed events): the same run."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)           # no trace export to OpenAI's servers
    ran: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The forecast for a city."""
        ran.append(city)
        return f"sunny in {city}"

    class Forecast(BaseModel):
        sky: str = Field(max_length=12)

    c = client(gw)
    agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather],
                  output_type=Forecast, model=OpenAIResponsesModel(model=MODEL, openai_client=c),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=100))
    result = await Runner.run(agent, PROMPT, max_turns=3)
    call, output, answer = result.new_items
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert isinstance(answer, MessageOutputItem) and isinstance(result.final_output, Forecast)
    assert call.raw_item.name == "get_weather" and ran == [json.loads(call.raw_item.arguments)["city"]]
    assert output.output == f"sunny in {ran[0]}"
    # the server's side of the round trip: the second response got the tool's output for that call
    first, second = (r.response_id for r in result.raw_responses)
    assert [o.call_id for o in (await c.responses.retrieve(first)).output] == [call.raw_item.call_id]
    sent = [i for i in (await c.responses.input_items.list(second, order="asc")).data
            if i.type == "function_call_output"]
    assert [(i.call_id, i.output) for i in sent] == [(call.raw_item.call_id, output.output)]
    assert Forecast.model_validate_json((await c.responses.retrieve(second)).output_text) == result.final_output

    streamed = Runner.run_streamed(agent, PROMPT, max_turns=3)
    names = [e.name async for e in streamed.stream_events() if e.type == "run_item_stream_event"]
    assert names == ["tool_called", "tool_output", "message_output_created"]
    assert streamed.final_output == result.final_output and ran == [ran[0], ran[0]]


NODE = shutil.which("node")
NODE_DIR = Path(__file__).resolve().parent / "node"


@pytest.mark.skipif(NODE is None, reason="node is not installed (scripts/setup.sh installs it with npm)")
async def test_node_sdk_background_stream_dropped_and_resumed(gw):
    """The official `openai` npm package (tests/node, installed by scripts/setup.sh): a background
    stream dropped after its first text delta and re-attached with `starting_after` gets exactly
    the events after the last one it had; together they are the whole replay, ending as the poll."""
    assert (NODE_DIR / "node_modules" / "openai").is_dir(), "tests/node is not installed: run scripts/setup.sh"
    proc = await asyncio.create_subprocess_exec(
        NODE, str(NODE_DIR / "background_resume.mjs"), gw.base + "/v1", KEYS["alice"], MODEL, PROMPT, "60",
        cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)
    first, rest, whole = got["first"], got["rest"], got["whole"]
    assert first[0]["type"] == "response.created" and first[0]["response"]["background"]
    assert first[-1]["type"] == "response.output_text.delta" and rest
    assert first + rest == whole                       # nothing missed, nothing twice
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] in ("response.completed", "response.incomplete")
    polled = got["polled"]
    text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    assert polled.pop("output_text") == text           # (the SDK's own reading of the output)
    assert whole[-1]["response"] == polled
    assert text == await chat_text(gw, [{"role": "user", "content": PROMPT}], max_tokens=60)

"""The body of `POST /v1/responses`, translated into the chat request it is here.

A response is a chat completion underneath: its `input` items become chat messages (a
`function_call` item an assistant message's tool call, a `function_call_output` a tool message),
`instructions` a leading system message, its function `tools`, `tool_choice` and `text.format`
chat's tools and `response_format`, and from there chat's prompt building, grammar and tool-call
parsing do the work (gateway.openai.schema, gateway.openai.structured). What a field does here
(used, accepted and ignored, refused unless neutral) follows chat's rule and docs/clients.md's
compatibility table.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai import structured
from gateway.openai.errors import APIError, _unsupported
from gateway.openai.logprobs import CHAT_TOP_MAX
from gateway.openai.schema import _chat_messages, json_object, validated
from shared.structured import tool_mode

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values about tools and reasoning this server has not: nothing to include, nothing changes
INCLUDE_IGNORED = {"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                   "web_search_call.action.sources", "message.input_image.image_url",
                   "computer_call_output.output.image_url", "code_interpreter_call.outputs"}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    stream: bool = False
    stream_options: dict | None = None
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)   # as chat's: prefix-cache scope (gateway.cache_scope)
    metadata: dict[str, str] | None = None
    # accepted and ignored (as chat's IGNORED)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    reasoning: dict | None = None
    prompt_cache_retention: str | None = None
    # refused unless neutral
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    # extension (docs/clients.md)
    priority: Literal["interactive", "batch"] | None = None


def _text_parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _unsupported(f"{where}.content[{j}]", f"of type {kind!r} is not supported (text parts only: "
                                                        "input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages (not yet checked by chat's rules)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text_parts(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)   # one turn's calls: one assistant message
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs call_id", param=f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text_parts(output, where)})
        else:
            raise _unsupported(f"{where}.type", f"{kind!r} is not supported (message, function_call, "
                                                "function_call_output)")
    return out


def input_items(items: str | list[dict], hex_id: str) -> list[dict]:
    """`input` as the items `GET /v1/responses/{id}/input_items` lists, each with an id."""
    raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}] \
        if isinstance(items, str) else items
    listed = []
    for i, item in enumerate(raw):
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        item.setdefault("id", f"{prefix}_{hex_id}_in{i}")
        if kind != "function_call_output":
            item.setdefault("status", "completed")
        listed.append(item)
    return listed


def output_messages(output: list[dict]) -> list[dict]:
    """A finished response's output items as the chat messages of its turn."""
    out: list[dict] = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []))
            out.append({"role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return out


def _chat_tools(body: ResponsesBody) -> tuple[list | None, Any]:
    tools = []
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(f"tools[{i}].type", f"{kind!r} is not supported by this server (function tools only)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _unsupported("tool_choice", f"{choice.get('type')!r} is not supported (none, auto, required, "
                                              "or {\"type\": \"function\", \"name\": ...})")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def _response_format(body: ResponsesBody) -> dict | None:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def parse(raw: bytes) -> ResponsesBody:
    body = validated(ResponsesBody, json_object(raw))
    for name, neutral in (("max_tool_calls", body.max_tool_calls is None), ("conversation", body.conversation is None),
                          ("prompt", body.prompt is None)):
        if not neutral:
            raise _unsupported(name)
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if set(body.stream_options) - {"include_obfuscation"}:
            raise _unsupported("stream_options." + sorted(set(body.stream_options) - {"include_obfuscation"})[0])
    for value in body.include or ():
        if value != LOGPROBS_INCLUDE and value not in INCLUDE_IGNORED:
            raise APIError(400, f"include: {value!r} is not a supported value", param="include")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= CHAT_TOP_MAX:
        raise APIError(400, f"'top_logprobs' must be 0 to {CHAT_TOP_MAX}", param="top_logprobs")
    if body.background and not body.store:
        raise APIError(400, "a background response must be stored ('store': true)", param="background")
    if body.metadata is not None and len(body.metadata) > 16:
        raise APIError(400, "metadata: at most 16 pairs", param="metadata")
    return body


def generate_fields(body: ResponsesBody, history: list[dict]) -> tuple[dict, list[dict], str | None]:
    """(the protocol's `generate` fields, the conversation without instructions, the tool mode).
    `history`: the stored chain's messages before this turn (previous_response_id)."""
    tools, choice = _chat_tools(body)
    shaped = SimpleNamespace(response_format=_response_format(body), tools=tools, tool_choice=choice)
    fields: dict[str, Any] = structured.structured_fields(shaped, APIError)
    conversation = history + input_messages(body.input)
    prompt = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    if not prompt:
        raise APIError(400, "input must not be empty", param="input")
    fields["messages"] = _chat_messages(prompt)
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    if logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("priority", body.priority),
                        ("prompt_cache_key", body.prompt_cache_key), ("cache_salt", body.cache_salt)):
        if value is not None:
            fields[name] = value
    return fields, conversation, tool_mode(shaped.tools, shaped.tool_choice)


def base_object(body: ResponsesBody, resp_id: str, model: str) -> dict:
    """The response object's fixed fields (everything but status, output, usage, error)."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"id": resp_id, "object": "response", "created_at": int(time.time()), "background": body.background,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "model": model,
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.safety_identifier,
            "service_tier": "default", "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "user": body.user}

"""The OpenAI API's structured output and tool fields, both ways: `response_format`, `tools`,
`tool_choice` and tool messages in (checked here so a bad one is a 400 naming its parameter),
and `tool_calls` out (message, deltas, `finish_reason: "tool_calls"`), read by gateway.openai.tool_calls.

The engine refuses what it cannot compile (a schema xgrammar rejects): that comes back before
any token as `invalid_request` whose `param` is "response_format" (set where the engine raises
it, carried by the worker's `err` event: shared.events.ErrEvent).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from pydantic import ValidationError

from gateway.openai.tool_calls import ToolCallParser
from shared.structured import NamedToolChoice, ResponseFormat, Tool, ToolCall, check_tools, tool_mode

RESPONSE_FORMAT = "response_format"


def _validate(kind, value, param: str, error: Callable[..., Exception]):
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise error(400, f"{param}{'.' + where if where else ''}: {err['msg']}", param=param) from None


def structured_fields(body, error: Callable[..., Exception]) -> dict[str, Any]:
    """`generate` fields for the body's response_format / tools / tool_choice (none when
    absent); `error(status, message, param=...)` is raised for a bad one."""
    fields: dict[str, Any] = {}
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        parsed = _validate(ResponseFormat, fmt, RESPONSE_FORMAT, error)
        if parsed.type != "text":
            fields[RESPONSE_FORMAT] = parsed.model_dump(exclude_none=True)
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if not tools and choice in (None, "none"):
        return fields
    parsed_tools = [_validate(Tool, t, "tools", error) for t in tools or ()]
    if choice is not None and not (isinstance(choice, str) and choice in ("none", "auto", "required")):
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
                and isinstance(choice["function"].get("name"), str)):
            raise error(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", param="tool_choice")
    try:
        typed = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
        check_tools(parsed_tools, typed, True)
    except (ValueError, ValidationError) as exc:
        raise error(400, str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else
                    f"tool_choice: {exc.errors()[0]['msg']}", param="tool_choice") from None
    if tool_mode(parsed_tools, typed) == "forced":
        # OpenAI takes both: the format is for the answer's text, and a forced turn has none (the
        # call's grammar is the whole answer). Agents send both: output_type + tool_choice=required.
        fields.pop(RESPONSE_FORMAT, None)
    fields["tools"] = [t.model_dump(exclude_none=True) for t in parsed_tools]
    fields["tool_choice"] = choice
    return fields


def tool_fields(message: dict, role: str, calls: list | None, i: int, error: Callable[..., Exception]) -> dict:
    """A message's tool fields for `generate`: an assistant's calls, a tool answer's call id."""
    out: dict[str, Any] = {}
    if calls:
        if role != "assistant":
            raise error(400, f"messages[{i}].tool_calls: only an assistant message makes calls",
                        param=f"messages[{i}].tool_calls")
        parsed = []
        for j, call in enumerate(calls):
            if isinstance(call, dict):   # what the SDK dumps back: extra nulls are fine
                call = {k: v for k, v in call.items() if v is not None and k != "index"}
            parsed.append(_validate(ToolCall, call, f"messages[{i}].tool_calls", error).model_dump())
        out["tool_calls"] = parsed
    call_id = message.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise error(400, f"messages[{i}]: a tool message needs 'tool_call_id'", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = call_id
    elif call_id is not None:
        raise error(400, f"messages[{i}].tool_call_id: only a tool message answers a call",
                    param=f"messages[{i}].tool_call_id")
    return out


def parser_for(body, rid: str) -> ToolCallParser | None:
    """A parser for the answer of request `rid`, when it has tools to call."""
    return resumed_parser(tool_mode(getattr(body, "tools", None), getattr(body, "tool_choice", None)), "", rid)


def resumed_parser(mode: str | None, read: str, rid: str) -> ToolCallParser | None:
    """A parser in `mode` that has read `read`, the text a resuming client already has: what it
    sends from then on continues that client's deltas. Call ids derive from the request id, so
    a re-attach or a resume on any replica names each call as the first stream did."""
    if mode is None:
        return None
    parser = ToolCallParser(mode, call_id=lambda i: "call_" + hashlib.sha256(f"{rid}/{i}".encode()).hexdigest()[:24])
    if read:
        parser.feed(read)
    return parser


def delta(content: str, calls: list[dict]) -> dict:
    d: dict[str, Any] = {}
    if content:
        d["content"] = content
    if calls:
        d["tool_calls"] = calls
    return d


def finish_reason(parser: ToolCallParser | None, reason: str) -> str:
    """`tool_calls` when the answer made calls and ended by itself."""
    return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason


def message(parser: ToolCallParser | None, text: str) -> dict:
    """The assistant message of a whole (non-streamed) answer."""
    if parser is None:
        return {"role": "assistant", "content": text}
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    content += rest
    calls = parser.tool_calls()
    return {"role": "assistant", "content": content or (None if calls else ""), **({"tool_calls": calls} if calls else {})}

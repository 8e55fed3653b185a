"""Structured output and tool calling as `generate` carries them (docs/protocol.md): the
`response_format`, `tools` and `tool_choice` fields, tool calls in chat messages, and the grammar
each request gets in the engine (`grammar_for`, worker.engine.grammar).

Kept apart from shared.protocol, which imports these types: the shapes are OpenAI's, strict
like every `generate` field (a client bug surfaces as `invalid_request`).

Forced tool calls (`tool_choice: "required"` or a named function) are a JSON grammar: the output
is one object `{"name": ..., "arguments": {...}}` whose arguments follow the function's
`parameters` schema (vLLM's way), whatever tool-call format the model's template teaches. With
`tool_choice: "auto"` the model is free and its own format is parsed (Hermes `<tool_call>`
tags, gateway.tool_calls).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

FUNCTION_NAME = r"^[A-Za-z0-9_\-]{1,64}$"
ToolMode = Literal["forced", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ResponseFormat(_Strict):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ..., "description": ...}}`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ResponseFormat":
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise ValueError(f"'json_schema' goes with type 'json_schema', not {self.type!r}")
            return self
        spec = self.json_schema
        if spec is None:
            raise ValueError("type 'json_schema' needs 'json_schema': {name, schema}")
        extra = set(spec) - {"name", "schema", "strict", "description"}
        if extra:
            raise ValueError(f"json_schema.{sorted(extra)[0]} is not a known field")
        name = spec.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError("json_schema.name must be a string of 1-64 characters")
        if not isinstance(spec.get("schema", {}), dict):
            raise ValueError("json_schema.schema must be an object (a JSON schema)")
        return self


class Function(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None      # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: Function


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str          # JSON text, as OpenAI sends it back


class ToolCall(_Strict):
    """A call an assistant message made (sent back in the conversation)."""
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, chat: bool) -> None:
    """The combinations that mean something (ValueError otherwise)."""
    if (tools or choice not in (None, "none")) and not chat:
        raise ValueError("'tools' need 'messages' (chat), not 'prompt'")
    if choice not in (None, "none", "auto") and not tools:
        raise ValueError("'tool_choice' names a tool call but 'tools' is empty")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools or ()}:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in 'tools'")


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolMode | None:
    """How the answer is read: one forced call (`forced`), free text that may hold calls in the
    model's own format (`auto`), or plain text (None: no tools, or `tool_choice: "none"`)."""
    if not tools or choice == "none":
        return None
    return "auto" if choice in (None, "auto") else "forced"


def _call_schema(tool: Tool, i: int, defs: dict) -> dict:
    """The schema of one call, `{"name", "arguments"}`. Parameters with local `$ref`s (pydantic's
    and LangChain's carry `$defs`) move to the grammar's root `$defs` as "t<i>", their own
    definitions as "t<i>__<name>", with the refs rewritten: inside the call schema, "#" would
    name the wrong root (and xgrammar follows no pointer through `anyOf`'s list)."""
    params = tool.function.parameters or {"type": "object", "properties": {}}
    if _has_local_ref(params):
        own = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}
        base = f"t{i}"
        defs[base] = _rebase({k: v for k, v in params.items() if k not in ("$defs", "definitions")}, base)
        defs.update({f"{base}__{name}": _rebase(value, base) for name, value in own.items()})
        params = {"$ref": f"#/$defs/{base}"}
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                             "arguments": params},
            "required": ["name", "arguments"]}


def _has_local_ref(schema) -> bool:
    if isinstance(schema, list):
        return any(_has_local_ref(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in schema.values())


def _rebase(schema, base: str):
    """`schema` with its local `$ref`s pointing where _call_schema moved their targets."""
    if isinstance(schema, list):
        return [_rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebase(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                out["$ref"] = f"#/$defs/{base}__{ref[len(root):]}"
                break
        else:
            out["$ref"] = f"#/$defs/{base}{ref[1:]}"
    return out


def grammar_for(response_format: ResponseFormat | None, tools: list[Tool] | None,
                choice: ToolChoice | None) -> dict | None:
    """The engine's grammar spec (worker.engine.grammar) for a request, or None (free text)."""
    if tool_mode(tools, choice) == "forced":    # `param`: a refused schema names `tools`
        if isinstance(choice, NamedToolChoice):
            tools = [next(t for t in tools if t.function.name == choice.function.name)]
        defs: dict = {}
        schemas = [_call_schema(t, i, defs) for i, t in enumerate(tools)]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return {"type": "json_schema", "schema": {**schema, "$defs": defs} if defs else schema, "param": "tools"}
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": response_format.json_schema.get("schema", {})}

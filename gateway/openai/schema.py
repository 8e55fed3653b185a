"""The OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) and their translation
into the protocol's `generate` fields (`parse_body`), with what each field does here.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.openai import structured
from gateway.openai.errors import APIError, _unsupported
from gateway.openai.logprobs import CHAT_TOP_MAX, COMPLETIONS_TOP_MAX
from shared.errors import ErrorCode

# ---------------------------------------------------------------- request bodies
#
# What a field does here is one of three things, and docs/clients.md's compatibility table says
# which for each (tests/test_openai_compat_table.py walks that table against this code):
#   * used: it does what OpenAI documents;
#   * accepted and ignored: it cannot change the answer (`IGNORED` below) — vLLM's stance, so
#     that what SDKs and frameworks send by default works;
#   * refused unless neutral: a value that would change the answer and that this server cannot
#     honour (`suffix`, `functions`, ...) is a 400 `unsupported_parameter` naming
#     it; the value that changes nothing (`suffix: ""`, `functions: []`, ...) is accepted.
# A field this list does not know is refused too (extra="forbid"): nothing unknown is ignored.

# accepted and ignored: name -> why ignoring it changes no answer (quoted in docs/clients.md)
IGNORED: dict[str, str] = {
    "user": "an end-user tag; this server keeps no per-user state",
    "safety_identifier": "an end-user tag for OpenAI's abuse monitoring",
    "store": "this server stores no completions",
    "metadata": "tags for stored completions; nothing is stored",
    "service_tier": "this server has one tier (the `priority` extension picks a lane)",
    "prompt_cache_retention": "a cache-retention hint",
    "verbosity": "a style hint to OpenAI's GPT-5 models; the served model has no such control",
    "reasoning_effort": "the served model does not reason",
    "parallel_tool_calls": "the calls the model writes are all returned; a forced call is one call",
    "prediction": "predicted output only speeds OpenAI up; the answer is the same",
}


B = TypeVar("B", bound=BaseModel)


class _Body(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (extra="forbid")."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    # accepted and ignored (IGNORED)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    # extensions (documented in docs/clients.md)
    priority: Literal["interactive", "batch"] | None = None
    resumable: bool = False
    ignore_eos: bool | None = None        # vLLM's: run to max_tokens (benchmarks such as guidellm send it)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)   # vLLM's: prefix-cache scope (gateway.cache_scope)
    # vLLM's sampling extensions (SAMPLING_FIELDS; ranges checked by the protocol's `Generate`)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


class ChatBody(_Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    parallel_tool_calls: bool | None = None        # IGNORED
    prediction: dict | None = None                 # IGNORED


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]     # text, or token ids (vLLM's; lm-eval sends them)
    response_format: dict | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None



# refused unless neutral: name -> the test of a value that changes nothing
_COMMON_NEUTRAL: dict[str, Any] = {}       # both endpoints: none left (n, penalties and logit_bias are used)
# passed on as they are when given (OpenAI's penalties and logit_bias, vLLM's extensions)
SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
                   "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")
_CHAT_NEUTRAL: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
_COMPLETION_NEUTRAL: dict[str, Any] = {
    "suffix": lambda v: not v,                                  # null or ""
}
# include_obfuscation is ignored (no obfuscation padding here); continuous_usage_stats is vLLM's:
# with include_usage, every chunk carries the usage so far
STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}


def _check_neutral(body: _Body, neutral: dict[str, Any]) -> None:
    for name, is_neutral in neutral.items():
        if not is_neutral(getattr(body, name)):
            raise _unsupported(name, "is not supported by this server")


def _check_common(body: _Body) -> None:
    _check_neutral(body, _COMMON_NEUTRAL)
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        extra = set(body.stream_options) - STREAM_OPTIONS
        if extra:
            raise _unsupported(f"stream_options.{sorted(extra)[0]}")


# What an assistant message carries besides its text when an answer is appended back to the
# conversation (`messages.append(resp.choices[0].message.model_dump())`): accepted when empty;
# refused when they hold something the model would have to see and cannot be shown here.
# `annotations` (citations of the content) are kept out of the prompt by OpenAI too: any list.
_MESSAGE_ECHO_EMPTY: dict[str, Any] = {
    "refusal": lambda v: v is None,
    "audio": lambda v: v is None,
    "function_call": lambda v: v is None,
    "annotations": lambda v: v is None or isinstance(v, list),
}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", *_MESSAGE_ECHO_EMPTY}


def _chat_messages(raw: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        extra = set(m) - _MESSAGE_KEYS
        if extra:
            raise _unsupported(f"messages[{i}].{sorted(extra)[0]}")
        for name, is_empty in _MESSAGE_ECHO_EMPTY.items():
            if not is_empty(m.get(name)):
                raise _unsupported(f"messages[{i}].{name}", "must be null or empty: this server takes text "
                                                            "and tool calls only (no audio or refusals)")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant", "tool"):
            raise _unsupported(f"messages[{i}].role", f"{m.get('role')!r} is not supported (system, developer, "
                                                      "user, assistant, tool)")
        content = m.get("content")
        calls = m.get("tool_calls") or None
        if content is None and role == "assistant" and calls:    # a message that only called tools
            content = ""
        if isinstance(content, list):   # content parts: only text
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(f"messages[{i}].content", "parts other than text are not supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": role, "content": content, **structured.tool_fields(m, role, calls, i, APIError)})
    return out


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object."""
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def validated(kind: type[B], data: dict) -> B:
    """`data` as a `kind` body; a 400 naming the first field that is wrong (an unknown one:
    `unsupported_parameter`)."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise _unsupported(param, "is not a recognized or supported parameter") from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None


def parse_body(raw: bytes, chat: bool) -> tuple[_Body, dict]:
    """JSON body -> (validated OpenAI body, the protocol's `generate` fields)."""
    body = validated(ChatBody if chat else CompletionBody, json_object(raw))
    _check_common(body)
    fields: dict[str, Any] = structured.structured_fields(body, APIError)
    if isinstance(body, ChatBody):
        _check_neutral(body, _CHAT_NEUTRAL)
        fields["messages"] = _chat_messages(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        _check_neutral(body, _COMPLETION_NEUTRAL)
        fields.update(_completion_prompt(body))
        max_tokens = body.max_tokens
    fields.update(_logprob_fields(body))
    if body.n is not None and body.n < 1:
        raise APIError(400, "'n' must be at least 1", param="n", code=_INVALID)
    if max_tokens == 0 and echo_only(body):
        max_tokens = 1          # vLLM's way: one token runs for the prompt's logprobs, and is not shown
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    for name, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("seed", body.seed), ("stop", stop), ("priority", body.priority),
                        ("prompt_cache_key", body.prompt_cache_key),   # routes it to the worker holding its cache
                        ("ignore_eos", body.ignore_eos or None),
                        ("cache_salt", body.cache_salt),
                        *((name, getattr(body, name)) for name in SAMPLING_FIELDS)):
        if value is not None:
            fields[name] = value
    return body, fields


_INVALID = ErrorCode.INVALID_REQUEST.value


def _completion_prompt(body: "CompletionBody") -> dict:
    """One prompt, as text or as token ids (a list of ids, or a list holding one string or one
    list of ids); `echo` (the prompt before the answer) and, with `logprobs`, its tokens'
    logprobs; `best_of` only as the `n` it equals (no choices are generated to be dropped)."""
    prompt = body.prompt
    if isinstance(prompt, list) and not (prompt and all(type(t) is int for t in prompt)):
        if len(prompt) != 1:
            raise _unsupported("prompt", "must be one prompt (batched prompts are not supported; send one "
                                         "request each, or use `n` for several answers to one prompt)")
        prompt = prompt[0]
    fields: dict[str, Any] = {"prompt_ids" if isinstance(prompt, list) else "prompt": prompt}
    if body.echo:
        fields["echo"] = True
        if body.logprobs is not None:
            fields["prompt_logprobs"] = body.logprobs
    if body.best_of not in (None, 1, body.n or 1):
        raise _unsupported("best_of", "must equal 'n' here: this server returns every choice it generates "
                                      "(best_of > n is not supported, as in vLLM's V1 engine)")
    return fields


def echo_only(body: _Body) -> bool:
    """Completions `echo` with `max_tokens: 0`: the prompt (and its logprobs) alone, as
    lm-evaluation-harness's loglikelihood requests ask."""
    return isinstance(body, CompletionBody) and bool(body.echo) and body.max_tokens == 0


def _logprob_fields(body: _Body) -> dict:
    """Chat `logprobs: true` + `top_logprobs` (0-20), completions `logprobs` (0-5 alternatives)
    -> the protocol's `logprobs` / `top_logprobs`."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code=_INVALID)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= CHAT_TOP_MAX:
            raise APIError(400, f"'top_logprobs' must be 0 to {CHAT_TOP_MAX}", param="top_logprobs", code=_INVALID)
        return {"logprobs": True, "top_logprobs": body.top_logprobs or 0} if body.logprobs else {}
    if body.logprobs is None:
        return {}
    if not 0 <= body.logprobs <= COMPLETIONS_TOP_MAX:
        raise APIError(400, f"'logprobs' must be 0 to {COMPLETIONS_TOP_MAX}", param="logprobs", code=_INVALID)
    return {"logprobs": True, "top_logprobs": body.logprobs}


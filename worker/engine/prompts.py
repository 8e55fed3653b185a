"""A prompt or chat messages -> token ids, with any tokenizer (no torch needed)."""

from __future__ import annotations

import json


def _plain_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Fallback for tokenizers without a chat template (base models)."""
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def _hermes_call(call: dict) -> str:
    fn = call.get("function", {})
    return f'<tool_call>\n{{"name": {json.dumps(fn.get("name"))}, "arguments": {fn.get("arguments") or "{}"}}}\n</tool_call>'


def _hermes_tools_prompt(tools: list[dict]) -> str:
    """The tools as Qwen2.5's template (Hermes format) shows them, for templates that take none."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _for_template(messages: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """Messages as chat templates read them. Templates that know tool calls (Qwen2.5's, ...)
    take an assistant's `tool_calls` with `arguments` as an object (OpenAI sends JSON text);
    others get the calls in the content as Hermes `<tool_call>` text, and the tools in a
    system message."""
    knows_tools = "tool_calls" in template
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls and knows_tools:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                               for c in calls]
        elif calls:
            del m["tool_calls"]
            m["content"] = "\n".join([m.get("content") or ""] + [_hermes_call(c) for c in calls]).strip()
        out.append(m)
    if tools and "tools" not in template:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + _hermes_tools_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": _hermes_tools_prompt(tools)})
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def build_prompt_ids(tokenizer, prompt: str | None, messages: list[dict] | None,
                     tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids for a raw prompt, or for chat messages rendered with the model's chat template
    (with the assistant turn opened, as OpenAI-style chat endpoints do), and the `tools` the
    model may call (passed to the template, which shows them in the model's own format).

    The keywords are vLLM's /tokenize options (worker.tokenization); their defaults are what a
    generate runs. `continue_final_message`: the last message stays open (no turn end, no new
    turn). `add_special_tokens`: None is the tokenizer's for a raw prompt and the template's
    alone for a chat; True adds the tokenizer's special tokens on top of a chat's template,
    False none to a raw prompt."""
    if (prompt is None) == (messages is None):
        raise ValueError("exactly one of prompt/messages is required")
    if messages is not None:
        template = getattr(tokenizer, "chat_template", None)
        if template:
            messages = _for_template(messages, tools, template if isinstance(template, str) else str(template))
            extra = {"tools": tools} if tools and "tools" in str(template) else {}
            if continue_final_message:
                extra["continue_final_message"] = True
            if add_special_tokens:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False, **extra)
                return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                return_dict=False, **extra)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        prompt = _plain_chat(_for_template(messages, tools, ""), add_generation_prompt and not continue_final_message)
    special = True if add_special_tokens is None else add_special_tokens
    return [int(t) for t in tokenizer(prompt, add_special_tokens=special)["input_ids"]]

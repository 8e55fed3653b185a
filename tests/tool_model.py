"""A tiny random Qwen2 whose chat template takes tools (Qwen2.5-Instruct's, Hermes `<tool_call>`
format), for the tool-calling tests. Offline like tests/tiny_model.py: the tokenizer is SmolLM2's
real one (read from its GGUF by make_tiny_model_dir, which has ChatML's <|im_start|>/<|im_end|>),
with Qwen2.5's template set on it; the weights are random, so what the model says is arbitrary.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from tests.tiny_model import make_tiny_model_dir

# Qwen2.5-Instruct's chat template (tools in the system turn, calls as Hermes <tool_call> JSON,
# tool results as <tool_response> in a user turn)
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def make_tool_model_dir(path: str | os.PathLike, *, seed: int = 0) -> Path:
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tok = AutoTokenizer.from_pretrained(str(make_tiny_model_dir(path.parent / (path.name + "-llama"))))
    tok.chat_template = QWEN25_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=end,
                         tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path

"""The choices of one OpenAI answer (`n`): each is its own request, with its own id, seq and end,
and they are written as one response (gateway.openai.response) whose `choices[i].index` says
which is which.

Why one request per choice: every request property that took work to get right — failover
continuation, a seeded run's exactness, cancel, per-key limits, the prefix cache — holds for
each choice as it is, with nothing new on the worker or the wire. The choices share the
prompt's KV blocks through the prefix cache: they carry the same prompt and route key, so they
land on the same worker, where the first computes the prompt and the others, arriving in the
same step, wait a step and take its blocks (kv_cache_manager: a block another request fills
this step is not computed twice). A seeded choice `i` runs with seed + i (vLLM's rule), so a
run is reproducible and its choices differ.

Usage follows OpenAI: the prompt counted once (its cached part: what the cache served the
choice that got least of it), each choice's completion tokens summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import Done, TokenLogprob


@dataclass
class Choice:
    index: int
    tools: object | None = None          # a gateway.openai.tool_calls parser when the request has tools
    seq: int = 0                         # tokens delivered so far (a stream's running usage)
    parts: list[str] = field(default_factory=list)     # stream: false
    logprobs: list[TokenLogprob] | None = None         # stream: false, when the chunks carry logprobs
    done: Done | None = None
    error_written: bool = False


def seed_of(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed (vLLM's rule: seed + index; wraps within the protocol's range)."""
    return None if seed is None else (seed + index) % 2**63


def usage_of_all(dones: list[Done], *, echo_only: bool = False) -> dict:
    """OpenAI's usage of the whole answer: the prompt once, each choice's completion tokens.
    `echo_only` (completions `echo` with `max_tokens: 0`): the one token each ran for the
    prompt's logprobs is not part of the answer."""
    first = dones[0].usage
    p = first.prompt_tokens
    c = 0 if echo_only else sum(d.usage.completion_tokens for d in dones)
    cached = min(d.usage.cached_tokens for d in dones)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}

"""What goes into and comes out of the engine: plain dataclasses, no torch.

Kept apart from the engine so that the worker service, the synthetic engine and the output
writer can use them without importing torch and transformers (a synthetic worker then starts in
a fraction of a second instead of seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from shared.errors import ErrorCode
from shared.sampling import SamplingParams

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: Literal["interactive", "batch"] = "interactive"
    skip_tokens: int = 0  # tokens already delivered by an earlier run: generated again, not emitted
    # Continuation (failover): output tokens an earlier run already delivered. They are context,
    # count toward max_tokens, prime the detokenizer and stop strings (and a seeded generator),
    # and are not emitted again: only new tokens come out.
    generated_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # EOS ids are masked out of sampling (benchmarks: forced lengths)
    # Prefix caching: requests share cached KV blocks only with requests of the same salt (e.g.
    # one per tenant, so no tenant can tell from its latency what another one sent)
    cache_salt: str = ""
    # echo: the prompt as text (None: the prompt ids decoded)
    prompt_text: str | None = None


class EngineRejected(Exception):
    """The request can never run here (the caller reports `code` to the client)."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param      # the request field it is about (e.g. response_format), if one


def _wire(key: str, *, usual: object = None, sparse: bool = False, decode=None, **kwargs):
    """A StepOutput field with its key on the engine pipe (worker.engine_wire). `sparse`: most
    outputs have the `usual` value, and only the others send theirs; `decode` turns what msgpack
    gives back into the field's type."""
    return field(metadata={"key": key, "sparse": sparse, "usual": usual, "decode": decode}, **kwargs)


@dataclass(slots=True)
class StepOutput:
    """What one request produced in one step. Every field names its key on the engine pipe
    (`_wire`), so a new field crosses it with no other change."""
    rid: str = _wire("r")
    text: str = _wire("t")
    token_ids: list[int] = _wire("i")
    finished: bool = _wire("f", sparse=True, usual=False)
    finish_reason: FinishReason | None = _wire("fr", sparse=True)
    prompt_tokens: int = _wire("p")
    completion_tokens: int = _wire("c")
    error_code: ErrorCode | None = _wire("ec", sparse=True, decode=ErrorCode, default=None)
    error_message: str | None = _wire("em", sparse=True, default=None)
    # wall clock (ms) when the step produced this output: outputs may reach Redis later, batched
    emitted_ms: int = _wire("e", default_factory=lambda: int(time.time() * 1000))
    # final outputs: the prompt tokens whose KV came from the prefix cache instead of being
    # computed (OpenAI's usage.prompt_tokens_details.cached_tokens)
    cached_tokens: int = _wire("ct", sparse=True, usual=0, default=0)
    # final outputs: wall clock (ms) when the request first ran (its queue time ends there; 0:
    # it never ran, e.g. cancelled while waiting)
    admitted_ms: int = _wire("a", sparse=True, usual=0, default=0)
    # requests that ask for logprobs: one entry per id of token_ids (worker.engine.logprobs.entry)
    logprobs: list | None = _wire("lp", sparse=True, default=None)
    # errors: the request field the error is about (EngineRejected.param), if one
    error_param: str | None = _wire("ep", sparse=True, default=None)
    # the first output of a request that asks for echo / prompt logprobs: [prompt text or None,
    # per prompt token its entry (the first one's logprob None) or None] (logprobs.prompt_echo)
    prompt: list | None = _wire("pr", sparse=True, default=None)

"""How one request wants its tokens chosen: the sampling parameters a client sends, the gateway
validates and the engine applies.

A plain dataclass with no codec of its own: the Redis request entry (`shared.streams.
RequestEntry`) carries it as a field, and the engine (`worker.engine.types.EngineRequest`) takes
it as it is, so neither the engine nor the gateway depends on the wire format for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# vLLM's bounds (sampling_params.py): penalties additive in [-2, 2], repetition > 0; OpenAI's
# logit_bias values in [-100, 100]; how many ids a request may list (vLLM v1's caps)
PENALTY_MAX = 2.0
LOGIT_BIAS_MAX = 100.0
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 128


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # structured output: a grammar the tokens must follow (worker.engine.grammar: {"type":
    # "json_object"} or {"type": "json_schema", "schema": {...}}); None: free text
    grammar: dict | None = None
    # per output token its logprob and this many most likely alternatives (0-20); None: none
    logprobs: int | None = None
    # EOS ids are never sampled: the answer runs to max_tokens (vLLM's extension; benchmarks
    # such as guidellm force output lengths with it)
    ignore_eos: bool = False
    # vLLM's per-request controls (worker.engine.penalties, worker.engine.logit_bias): OpenAI's
    # presence / frequency penalties (over the output so far), the repetition penalty (prompt and
    # output, as transformers' RepetitionPenaltyLogitsProcessor), a bias per token id, min-p,
    # no end (EOS, stop ids, stop strings) before min_tokens, more ids that end the answer, the
    # stop string / token kept in the text, special tokens shown. Each is dropped from the Redis
    # entry while neutral (`NEUTRAL`), so a request that uses none reads as before.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # prompt logprobs (completions `echo` + `logprobs`, vLLM's `prompt_logprobs`): per prompt token
    # its logprob (the first: none) and this many alternatives, on the first output; None: none
    prompt_logprobs: int | None = None
    # the first output carries the prompt as text (completions `echo`)
    echo: bool = False

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: a replay on another worker yields the same tokens."""
        return self.temperature == 0.0 or self.seed is not None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


NEUTRAL: dict[str, object] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                              "logit_bias": None, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [],
                              "include_stop_str_in_output": False, "skip_special_tokens": True}


def _number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def invalid_control(p: SamplingParams) -> tuple[str, str] | None:
    """(field, why) of the first control of `NEUTRAL` out of range, else None: what the Redis
    entry's decoding and the engine refuse (the gateway's schema refuses the same first)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (_number(v) and -PENALTY_MAX <= v <= PENALTY_MAX):
            return name, f"must be a number from -{PENALTY_MAX:g} to {PENALTY_MAX:g}"
    if not (_number(p.repetition_penalty) and p.repetition_penalty > 0):
        return "repetition_penalty", "must be a number greater than 0"
    if not (_number(p.min_p) and 0 <= p.min_p <= 1):
        return "min_p", "must be a number from 0 to 1"
    if not (type(p.min_tokens) is int and 0 <= p.min_tokens <= p.max_tokens):
        return "min_tokens", "must be an integer from 0 to max_tokens"
    ids = p.stop_token_ids
    if not (isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS and all(type(i) is int and i >= 0 for i in ids)):
        return "stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"
    bias = p.logit_bias
    if bias is not None and not (isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS and all(
            type(k) is int and k >= 0 and _number(v) and -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX for k, v in bias.items())):
        return "logit_bias", (f"must map at most {MAX_LOGIT_BIAS} token ids to numbers from -{LOGIT_BIAS_MAX:g} "
                              f"to {LOGIT_BIAS_MAX:g}")
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        if type(getattr(p, name)) is not bool:
            return name, "must be a boolean"
    return None

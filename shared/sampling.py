"""How one request wants its tokens chosen: the sampling parameters a client sends, the gateway
validates and the engine applies.

A plain dataclass with no codec of its own: the Redis request entry (`shared.streams.
RequestEntry`) carries it as a field, and the engine (`worker.engine.types.EngineRequest`) takes
it as it is, so neither the engine nor the gateway depends on the wire format for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # prompt logprobs (completions `echo` + `logprobs`, vLLM's `prompt_logprobs`): per prompt token
    # its logprob (the first: none) and this many alternatives, on the first output; None: none
    prompt_logprobs: int | None = None
    # the first output carries the prompt as text (completions `echo`)
    echo: bool = False

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: a replay on another worker yields the same tokens."""
        return self.temperature == 0.0 or self.seed is not None

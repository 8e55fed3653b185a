"""One request's state inside the engine, shared by the scheduler (what runs), the KV cache
manager (which blocks it holds), the runner (what to feed the model) and the engine's
postprocessing (what to emit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from worker.engine.detokenize import IncrementalDetokenizer
    from worker.engine.grammar import Matcher
    from worker.engine.types import EngineRequest

Lane = Literal["interactive", "batch"]


@dataclass(eq=False, slots=True)
class Sequence:
    req: "EngineRequest"
    detok: "IncrementalDetokenizer"
    generator: torch.Generator | None  # seeded sampling only; unseeded rows share the engine's
    arrival: int                    # admission order tiebreak (FIFO within a lane)
    # every token of the context: prompt, tokens delivered by an earlier run, new output
    tokens: list[int] = field(default_factory=list)
    computed: int = 0               # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)  # KV block table: position p is in blocks[p // block_size]
    new_tokens: int = 0             # tokens sampled by this engine
    starved: int = 0                # consecutive steps it waited for admission / a prefill chunk
    preemptions: int = 0            # times its KV blocks were taken back (it recomputes them)
    finished: bool = False
    # The request's row in the runner's batch while running (input_batch.py: sampling parameters,
    # block table, ...; taken on admission, given back on preemption or end); -1: none.
    slot: int = -1
    admitted_ms: int = 0            # wall clock of its first scheduled prompt chunk (queue time ends)
    # Prefix caching (kv_cache_manager.py, block_pool.py): the names of the context's leading full blocks (computed
    # once each, as they are looked up or fill), the chain's root (the model), its salt (the
    # request's cache scope) and the block it enters at (after an operator-shared prefix), how many of
    # `blocks` are named in the pool (taken from the cache or published once computed), and the
    # context tokens its first pass took from the cache instead of computing them.
    cache_root: bytes = b""
    cache_salt: bytes = b""
    salt_at: int = 0
    block_names: list[bytes] = field(default_factory=list)
    published: int = 0
    cached_tokens: int = 0
    # structured output: the request's matcher (worker.engine.grammar), None when unconstrained
    grammar: "Matcher | None" = None
    # Copied from the request once: read for every row of every step (plain attributes, not
    # properties over `req`, because at a few hundred rows per step each lookup is host time).
    rid: str = field(init=False)
    lane: Lane = field(init=False)
    prompt_len: int = field(init=False)
    completion_base: int = field(init=False)   # output tokens an earlier run delivered
    max_tokens: int = field(init=False)
    skip_tokens: int = field(init=False)
    ignore_eos: bool = field(init=False)
    top_logprobs: int = field(init=False)      # logprobs: alternatives per token; -1: no logprobs
    stop_ids: frozenset = field(init=False)    # stop_token_ids: more ids that end it (as EOS does)
    include_stop: bool = field(init=False)     # an ending token's text is kept (include_stop_str_in_output)
    text_offset: int = 0                       # logprobs: the output's length in token strings so far
    # echo / prompt logprobs (logprobs.prompt_echo): sent with the first emitted token; the
    # alternatives wanted per prompt token (-1: none) and the rows computed so far, one per
    # prompt position but the last (the runner adds them as prefill chunks run)
    echo: bool = False
    prompt_lp_k: int = -1
    prompt_rows: list = field(default_factory=list)

    def __post_init__(self) -> None:
        req, params = self.req, self.req.params
        self.rid = req.rid
        self.lane = req.priority
        self.prompt_len = len(req.prompt_ids)
        self.completion_base = len(req.generated_ids)
        self.max_tokens = params.max_tokens
        self.skip_tokens = req.skip_tokens
        self.ignore_eos = req.ignore_eos
        self.top_logprobs = -1 if params.logprobs is None else params.logprobs
        self.stop_ids = frozenset(params.stop_token_ids)
        self.include_stop = params.include_stop_str_in_output

    @property
    def completion_tokens(self) -> int:
        """Output tokens so far, including those an earlier run delivered (continuation)."""
        return self.completion_base + self.new_tokens

    @property
    def wants_prompt_rows(self) -> bool:
        """Prompt logprobs still to compute: the prefix cache must not skip a position."""
        return self.prompt_lp_k >= 0 and len(self.prompt_rows) < self.prompt_len - 1

    @property
    def pending(self) -> int:
        """Context tokens not yet in the cache (1 for a decoding request)."""
        return len(self.tokens) - self.computed

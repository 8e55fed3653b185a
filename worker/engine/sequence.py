"""One request's state inside the engine, shared by the scheduler (what runs), the runner (what
to feed the model) and the engine's postprocessing (what to emit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from worker.engine.detokenize import IncrementalDetokenizer
    from worker.engine.engine import EngineRequest

Lane = Literal["interactive", "batch"]


@dataclass(eq=False)
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

    @property
    def lane(self) -> Lane:
        return self.req.priority

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Output tokens so far, including those an earlier run delivered (continuation)."""
        return len(self.req.generated_ids) + self.new_tokens

    @property
    def pending(self) -> int:
        """Context tokens not yet in the cache (1 for a decoding request)."""
        return len(self.tokens) - self.computed

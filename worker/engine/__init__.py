"""Continuous-batching inference engine (slot KV cache, chunked prefill, two lanes with aging).

Modules: `engine` (public API, per-request updates), `scheduler` (what runs each step),
`runner` (one forward pass + sampling), `attention` (slot attention plugged into transformers),
`kv_cache`, `sampling`, `detokenize`, `sequence` (per-request state), `model_support` (which
models are accepted), `config`, `loading`.

The worker owns one `Engine` in a dedicated thread: `add`/`cancel` between steps, `step()` in a
loop while `has_work`.
"""

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, EngineRejected, EngineRequest, StepOutput, eos_token_ids
from worker.engine.loading import build_prompt_ids, load_model

__all__ = [
    "Engine", "EngineConfig", "EngineRejected", "EngineRequest", "StepOutput",
    "build_prompt_ids", "eos_token_ids", "load_model",
]

"""Continuous-batching inference engine (paged KV cache with recompute preemption and prefix caching, chunked prefill, two lanes with aging).

Modules: `engine` (public API, per-token outputs), `scheduler` (what runs each step, and the
update after it), `kv_cache_manager` (the blocks each request holds; prefix cache hits),
`block_pool` (who holds which block; content names), `kv_cache` (the KV memory), `runner` (one
forward pass + sampling), `input_batch` (the runner's per-row state), `decoder` (the forward loop
over the model's own modules, fused projections), `attention` (paged attention plugged into
transformers), `paged_attention` (the CUDA kernel: every token reads its blocks in place),
`cuda_graphs` (decode steps replayed as graphs), `sampling`, `logprobs` (for the requests that
ask), `grammar` (structured output) and `grammar_compile` (its schemas compiled beside the step), `detokenize`, `sequence` (per-request state), `types`
(requests in, outputs out), `prompts`, `model_support` (which models are accepted), `host_lists`
(per-row lists to tensors), `config`, `loading`, `model_files` (where weights come from),
`quantize` and `cpu_kernels` (4-bit weights on CPUs), `threads` (torch threads).

The worker owns one `Engine` in a dedicated thread (of its engine process, worker.engine_process): `add`/`cancel` between steps, `step()` in a
loop while `has_work`.

The request/output types and prompt building import without torch (`types`, `prompts`); the
engine itself, its config and the model loader are imported on first use, so a process that
never builds an engine (the synthetic worker, the output writer's users) never loads torch.
"""

from importlib import import_module

from worker.engine.prompts import build_prompt_ids
from worker.engine.types import EngineRejected, EngineRequest, StepOutput

_LAZY = {"Engine": "worker.engine.engine", "eos_token_ids": "worker.engine.engine",
         "EngineConfig": "worker.engine.config", "load_model": "worker.engine.loading"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")


__all__ = [
    "Engine", "EngineConfig", "EngineRejected", "EngineRequest", "StepOutput",
    "build_prompt_ids", "eos_token_ids", "load_model",
]

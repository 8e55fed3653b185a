"""Tiny random models of every family the engine accepts, and the loop that runs prompts through
the engine the way the family tests check it (requests joining one per step, prompts in chunks
of 8, so steps mix prompt chunks with decode rows). Shared by `test_engine_families.py` (CPU
attention) and `paged_attention_checks.py` (the CUDA kernel, graphs on and off)."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from shared.streams import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


class Tok:
    """Just enough tokenizer for the engine's detokenizer (text is not what these tests check)."""
    eos_token_id = 2

    def decode(self, ids, **_):
        return " ".join(str(i) for i in ids)


FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-linear-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                                         max_window_layers=1)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)),
}

PROMPTS = [[1, 17, 99, 3, 250, 41, 7, 300, 12, 5, 77, 401, 9, 66, 123, 8, 4, 200, 33, 11, 90],
           [1, 5], [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410]]


def reference(model, prompt, n):
    """`generate`'s greedy continuation of `prompt`, `n` tokens, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_tokens(model, prompts, n: int, *, max_batch: int, tokenizer=None, **config):
    """Greedy tokens of each prompt (request ids r0, r1, ...) through an engine built with
    `max_batch`, max_seq_len 128, prefill_chunk 8 and `config`; one request joins per step, every
    one runs to `n` tokens (EOS ignored). Returns (tokens by request id, the engine)."""
    engine = Engine(model, tokenizer or Tok(), EngineConfig(max_batch=max_batch, max_seq_len=128, prefill_chunk=8,
                                                            **config))
    engine.eos_ids = set()
    outs: dict[str, list[int]] = {}
    step = 0
    while step < len(prompts) or engine.has_work:
        if step < len(prompts):
            engine.add(EngineRequest(f"r{step}", prompts[step], SamplingParams(max_tokens=n, temperature=0.0)))
        for o in engine.step():
            assert o.finish_reason in (None, "length"), o
            outs.setdefault(o.rid, []).extend(o.token_ids)
        step += 1
    return outs, engine


def assert_engine_equals_generate(model, n: int, label: str) -> None:
    """Each of PROMPTS through the engine (`engine_tokens`, 2 rows) gives generate()'s greedy
    tokens alone (EOS ignored in both)."""
    refs = [reference(model, p, n) for p in PROMPTS]
    model.generation_config.eos_token_id = None
    outs, _ = engine_tokens(model, PROMPTS, n, max_batch=2)
    for i, ref in enumerate(refs):
        assert outs[f"r{i}"] == ref, f"{label} r{i}"

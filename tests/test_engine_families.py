"""Every model family the engine accepts, as a tiny random model, against `model.generate`; and
the configs it cannot run exactly, refused at load with a clear error."""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from shared.streams import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest
from worker.engine.model_support import UnsupportedModel

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


class _Tok:
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


def _reference(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_equals_generate(family):
    """Batched, chunked prefill (chunk 8 < window-crossing prompts), requests joining late: each
    request's greedy tokens equal generate() alone. With a window of 8 and 20+ token contexts,
    ignoring the window changes the output."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    n = 20
    refs = [_reference(model, p, n) for p in PROMPTS]
    model.generation_config.eos_token_id = None
    engine = Engine(model, _Tok(), EngineConfig(max_batch=2, max_seq_len=128, prefill_chunk=8))
    engine.eos_ids = set()
    outs: dict[str, list[int]] = {}
    step = 0
    while step < len(PROMPTS) or engine.has_work:
        if step < len(PROMPTS):
            engine.add(EngineRequest(f"r{step}", PROMPTS[step], SamplingParams(max_tokens=n, temperature=0.0)))
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
        step += 1
    for i, ref in enumerate(refs):
        assert outs[f"r{i}"] == ref, f"{family} r{i}"


def test_window_really_matters():
    """The window families would fail the test above if the window were ignored: the same
    weights without the window give different tokens."""
    torch.manual_seed(0)
    windowed = FAMILIES["mistral-window"]().eval()
    full = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    assert _reference(windowed, PROMPTS[0], 20) != _reference(full, PROMPTS[0], 20)


@pytest.mark.parametrize("build, reason", [
    (lambda: Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "head_dim": 16})), "family"),
    (lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0})), "dynamic"),
    (lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64})), "longrope"),
])
def test_unsupported_configs_are_refused_at_load(build, reason):
    model = build().eval()
    with pytest.raises(UnsupportedModel) as exc:
        Engine(model, _Tok(), EngineConfig(max_batch=2, max_seq_len=64))
    assert reason in str(exc.value)


def test_soft_capping_is_refused_even_in_an_accepted_family():
    config = LlamaConfig(**COMMON)
    config.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModel, match="soft-capped"):
        Engine(LlamaForCausalLM(config).eval(), _Tok(), EngineConfig(max_batch=2, max_seq_len=64))

"""Every model family the engine accepts, as a tiny random model, against `model.generate`; and
the configs it cannot run exactly, refused at load with a clear error."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM)

from tests.engine_families import COMMON, FAMILIES, PROMPTS, Tok, assert_engine_equals_generate, reference
from worker.engine import Engine, EngineConfig
from worker.engine.decoder import rms_norm, rotate
from worker.engine.model_support import UnsupportedModel


def _operations(fn, *args) -> int:
    """How many ATen operations `fn(*args)` dispatches (each costs host time; on a GPU, a launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Count():
        fn(*args)
    return Count.calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_equals_generate(family):
    """Batched, chunked prefill (chunk 8 < window-crossing prompts), requests joining late: each
    request's greedy tokens equal generate() alone. With a window of 8 and 20+ token contexts,
    ignoring the window changes the output."""
    torch.manual_seed(0)
    assert_engine_equals_generate(FAMILIES[family]().eval(), 20, family)


def test_window_really_matters():
    """The window families would fail the test above if the window were ignored: the same
    weights without the window give different tokens."""
    torch.manual_seed(0)
    windowed = FAMILIES["mistral-window"]().eval()
    full = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    assert reference(windowed, PROMPTS[0], 20) != reference(full, PROMPTS[0], 20)


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
        Engine(model, Tok(), EngineConfig(max_batch=2, max_seq_len=64))
    assert reason in str(exc.value)


def test_soft_capping_is_refused_even_in_an_accepted_family():
    config = LlamaConfig(**COMMON)
    config.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModel, match="soft-capped"):
        Engine(LlamaForCausalLM(config).eval(), Tok(), EngineConfig(max_batch=2, max_seq_len=64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "llama3-rope", "qwen2", "qwen3", "mistral"])
def test_decoder_norms_and_rope_are_the_models_own_bit_for_bit(family, dtype):
    """The decoder's few-operation norm and rotation (decoder.py) take the fast path for every
    accepted family and give exactly the model's module outputs, on inputs they were not
    checked on at load."""
    from worker.engine.decoder import Decoder
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    for module in model.modules():   # trained norms are not all ones (then bf16 rounding differs between forms)
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.data.normal_(1.0, 0.2)
    model = model.to(dtype)
    decoder = Decoder(model)
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(11, COMMON["hidden_size"], generator=generator) * 3).to(dtype)
    for ours, theirs in zip(decoder.layers, model.model.layers):
        for fast, module in ((ours.input_norm, theirs.input_layernorm), (ours.post_norm, theirs.post_attention_layernorm)):
            assert fast is not module     # a fast path was taken ...
            assert torch.equal(fast(x), module(x))    # ... and is exact
            # ... in few dispatches: torch's rms_norm alone in fp32; in bf16 (where its
            # rounding differs from the module's) cast, unweighted rms_norm, cast, weight
            assert _operations(fast, x) <= (1 if dtype == torch.float32 else 4)
            # the operation-by-operation form equals the module in every dtype
            assert torch.equal(rms_norm(x, module.weight, module.variance_epsilon), module(x))
        assert ours.act is torch.nn.functional.silu
        if ours.q_norm is not None:
            heads = (torch.randn(11, ours.heads, ours.head_dim, generator=generator) * 3).to(dtype)
            assert ours.q_norm is not theirs.self_attn.q_norm
            assert torch.equal(ours.q_norm(heads), theirs.self_attn.q_norm(heads))
    assert torch.equal(decoder.norm(x), model.model.norm(x))
    # RoPE at positions far apart, q and k rotated together as the decoder does
    layer = decoder.layers[0]
    positions = torch.tensor([[0, 1, 5, 63, 64, 200, 311, 480, 7, 2, 100]])
    cos, sin = model.model.rotary_emb(x[None], positions)
    q = (torch.randn(1, layer.heads, 11, layer.head_dim, generator=generator) * 3).to(dtype)
    k = (torch.randn(1, layer.kv_heads, 11, layer.head_dim, generator=generator) * 3).to(dtype)
    apply = sys.modules[type(layer.attn).__module__].apply_rotary_pos_emb
    want_q, want_k = apply(q, k, cos, sin)
    half = layer.head_dim // 2   # rotate_half's negated half, moved onto sin
    signed = torch.cat((-sin[0, :, None, :half], sin[0, :, None, half:]), dim=-1)
    # the decoder's per-position tables hold exactly what the rotary module computes for them
    assert torch.equal(decoder.cos_table[positions[0]], cos[0, :, None])
    assert torch.equal(decoder.signed_sin_table[positions[0]], signed)
    both = rotate(torch.cat((q[0], k[0]), 0).transpose(0, 1), cos[0, :, None], signed)   # [T, H + KVH, D]
    assert torch.equal(both[:, : layer.heads].transpose(0, 1), want_q[0])
    assert torch.equal(both[:, layer.heads :].transpose(0, 1), want_k[0])


def test_a_norm_that_differs_is_called_as_the_models_module():
    from worker.engine.decoder import Decoder

    class OffsetNorm(torch.nn.Module):   # Gemma-style (1 + weight): not what rms_norm computes
        def __init__(self, norm):
            super().__init__()
            self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

        def forward(self, x):
            x32 = x.float()
            return ((1 + self.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))).to(x.dtype)

    torch.manual_seed(0)
    model = FAMILIES["llama"]().eval()
    model.model.layers[1].post_attention_layernorm = OffsetNorm(model.model.layers[1].post_attention_layernorm)
    decoder = Decoder(model)
    assert decoder.layers[1].post_norm is model.model.layers[1].post_attention_layernorm
    assert decoder.layers[0].post_norm is not model.model.layers[0].post_attention_layernorm


def test_a_rotary_embedding_that_differs_is_refused(monkeypatch):
    """An interleaved (GPT-J style) rotation is not the rotate-half the decoder computes."""
    from transformers.models.llama import modeling_llama

    from worker.engine.decoder import Decoder

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", interleaved)
    with pytest.raises(UnsupportedModel, match="rotary"):
        Decoder(FAMILIES["llama"]().eval())

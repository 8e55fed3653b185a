"""4-bit projections on CPU (`QUANTIZATION=int4`, worker/engine/quantize.py): the quantizer keeps
a Q4 GGUF's own values, the engine over a 4-bit model equals `generate` on that same model, and
settings that cannot work are refused up front."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shared.config import Settings
from shared.streams import SamplingParams
from tests.engine_families import COMMON, PROMPTS, assert_engine_equals_generate, reference
from worker.engine import Engine, EngineConfig, EngineRequest, build_prompt_ids, load_model
from worker.engine.config import settings_dtype
from worker.engine.quantize import GROUP, Int4Linear, int4_linear, quantize_int4

# head_dim 32 and 2 KV heads: k/v projections of 64 rows, one block of the kernel's packing
SHAPE = dict(COMMON, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def q4_1_weight(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A weight in llama.cpp's Q4_1 form, w = d * q + m per group of 32, with q spanning 0..15 in
    every group (as the quantizer that made it leaves it) and d, m exact in bf16."""
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, groups, GROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = 2.0 ** torch.randint(-8, -3, (out_features, groups, 1), generator=generator)
    m = -8 * d + torch.randint(-4, 5, (out_features, groups, 1), generator=generator) * d / 4
    return (d * q + m).view(out_features, in_features)


def dequantized(linear: Int4Linear) -> torch.Tensor:
    """The dense weight an Int4Linear multiplies by, read back through the kernel (no bias)."""
    eye = torch.eye(linear.in_features, dtype=linear.scales_zeros.dtype)
    return int4_linear(eye, linear.packed, linear.scales_zeros).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_q4_1_weight_is_recovered_exactly(dtype):
    generator = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(96, 128, bias=False)
    dense.weight.data = q4_1_weight(128, 96, generator)
    linear = Int4Linear.quantize(dense, dtype)
    assert linear.packed.dtype == torch.uint8 and linear.packed.numel() == 128 * 96 // 2   # 4 bits a weight
    assert torch.equal(dequantized(linear).float(), dense.weight)


def test_other_weights_round_to_the_nearest_level_of_their_group():
    generator = torch.Generator().manual_seed(1)
    dense = torch.nn.Linear(64, 64, bias=True)
    dense.weight.data = torch.randn(64, 64, generator=generator)
    linear = Int4Linear.quantize(dense, torch.float32)
    groups = dense.weight.view(64, 2, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (dequantized(linear) - dense.weight).view(64, 2, GROUP).abs()
    assert (error <= step[..., None] / 2 + 1e-6).all()
    x = torch.randn(5, 64, generator=generator)
    assert torch.allclose(linear(x), x @ dequantized(linear).t() + dense.bias, atol=1e-4)


def test_a_row_gives_the_same_bits_in_any_batch():
    """What lets batched engine steps equal generate: no output row depends on the others."""
    generator = torch.Generator().manual_seed(2)
    dense = torch.nn.Linear(128, 192, bias=False)
    dense.weight.data = torch.randn(192, 128, generator=generator)
    linear = Int4Linear.quantize(dense)
    x = torch.randn(40, 128, generator=generator).to(torch.bfloat16)
    whole = linear(x)
    for rows in (1, 3, 16, 33):
        assert torch.equal(linear(x[:rows]), whole[:rows])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_equals_generate_on_the_same_4bit_model(family):
    """fp32 activations, so attention rounds alike in both and any difference would be the
    4-bit path's: the decoder's fused q/k/v and gate/up over packed rows, batching, chunked
    prefill. Qwen2's projections carry biases."""
    torch.manual_seed(0)
    build = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
             "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE))}[family]
    model = build().eval()
    quantize_int4(model, torch.float32)
    assert type(model.model.layers[0].self_attn.q_proj) is Int4Linear
    assert type(model.model.layers[1].mlp.down_proj) is Int4Linear
    assert type(model.lm_head) is torch.nn.Linear   # the head stays dense
    alone = reference(model, PROMPTS[0], 16)
    assert_engine_equals_generate(model, 16, family)
    # the engine's decoder fused the projections: generate now reads views of the fused tensors
    # (the scales strided), and must still give the same tokens
    assert reference(model, PROMPTS[0], 16) == alone


def test_quantizing_changes_the_models_tokens():
    """The test above would pass vacuously if quantizing left the projections as they were."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    before = reference(model, PROMPTS[0], 16)
    quantize_int4(model, torch.float32)
    assert reference(model, PROMPTS[0], 16) != before


def test_a_shape_the_kernel_cannot_pack_is_refused_and_nothing_changes():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()   # k/v projections of 32 rows
    with pytest.raises(ValueError, match="out_features % 64"):
        quantize_int4(model)
    assert all(type(m) is not Int4Linear for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32


def test_settings_that_cannot_work_are_refused():
    assert settings_dtype(Settings(device="cpu", quantization="int4"), "cpu") == torch.bfloat16
    assert settings_dtype(Settings(device="cpu", quantization="int4", dtype="bfloat16"), "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16 activations"):
        settings_dtype(Settings(device="cpu", quantization="int4", dtype="float32"), "cpu")
    with pytest.raises(ValueError, match="CPU workers"):
        settings_dtype(Settings(device="cuda", quantization="int4"), "cuda")
    assert settings_dtype(Settings(device="cpu"), "cpu") == torch.float32


@pytest.mark.slow
def test_smollm2_in_4_bits_answers_like_float32_and_the_engine_like_generate():
    """The real model: its Q4_1 projections loaded as 4-bit weights. Its greedy answer to a short
    question is float32's, and the engine gives generate's tokens for it."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {}
    for quantization in ("none", "int4"):
        model, tok = load_model(Settings(model_path="", device="cpu", quantization=quantization))
        prompt = build_prompt_ids(tok, None, chat)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        answers[quantization] = out[0, len(prompt):].tolist()
    assert model.dtype == torch.bfloat16 and type(model.model.layers[0].mlp.up_proj) is Int4Linear
    assert answers["int4"] == answers["none"]
    assert tok.decode(answers["int4"], skip_special_tokens=True).strip() == "The capital of France is Paris."
    engine = Engine(model, tok, EngineConfig(max_batch=2, max_seq_len=128, prefill_chunk=8, dtype=torch.bfloat16))
    engine.add(EngineRequest("q", prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    tokens = []
    while engine.has_work:
        for o in engine.step():
            tokens.extend(o.token_ids)
    assert tokens == answers["int4"][:len(tokens)] and tokens[-1] in engine.eos_ids

"""The 8-bit-activation CPU kernels (worker/engine/q8_kernels.cpp): llama.cpp's arithmetic on the
weights the other kernels multiply by, row by row whatever the batch or the thread count, and
wired into the 4-bit model so that the engine still equals generate on it."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker.engine import cpu_kernels, q8_kernels, quantize
from worker.engine.quantize import Int4Linear, Int8SplitLinear, quantize_int4

from tests.engine_families import PROMPTS, engine_tokens, reference
from tests.test_engine_quantize import SHAPE, q8_0_weight

pytestmark = pytest.mark.skipif(q8_kernels.load() is None, reason="the kernels cannot be built or run here")


def q4_weights(n: int, k: int, generator: torch.Generator):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
    scales = (torch.rand(n, k // 32, generator=generator) * 0.02 + 0.001).bfloat16()
    zeros = (torch.randn(n, k // 32, generator=generator) * 0.02).bfloat16()
    weight = ((q.view(n, k // 32, 32) - 8).float() * scales.float()[..., None] + zeros.float()[..., None]).view(n, k)
    return q, scales, zeros, weight


def q8_weights(n: int, k: int, generator: torch.Generator):
    s = torch.randint(-127, 128, (n, k), dtype=torch.int32, generator=generator)
    scales = (torch.rand(n, k // 32, generator=generator) * 0.02 + 0.001).bfloat16()
    weight = (s.view(n, k // 32, 32).float() * scales.float()[..., None]).view(n, k)
    return s, scales, weight


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return ((got.float() - want.float()).abs().max() <= rel * want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", [64, 576, 1536])
def test_the_kernels_compute_llama_cpps_arithmetic_on_the_same_weights(dtype, k):
    """x rounded to 8 bits per group of 32, times the 4-bit / 8-bit weights exactly as the other
    kernels hold them: the result of `reference_linear` up to float32 summation order (and the
    one rounding to bf16); with a bias, plus the bias."""
    generator = torch.Generator().manual_seed(k)
    q, scales, zeros, weight = q4_weights(192, k, generator)
    s, scales8, weight8 = q8_weights(128, k, generator)
    bias = torch.randn(192, generator=generator).to(dtype)
    packed4, packed8 = q8_kernels.pack_q4(q), q8_kernels.pack_q8(s)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=generator).to(dtype)
        rel = 1e-2 if dtype == torch.bfloat16 else 1e-4
        assert close(q8_kernels.q4_linear(x, packed4, scales, zeros), q8_kernels.reference_linear(x, weight), rel)
        assert close(q8_kernels.q8_linear(x, packed8, scales8), q8_kernels.reference_linear(x, weight8), rel)
        with_bias = q8_kernels.q4_linear(x, packed4, scales, zeros, bias)
        assert close(with_bias, q8_kernels.reference_linear(x, weight).float() + bias.float(), rel)
        assert with_bias.dtype == dtype and with_bias.shape == (rows, 192)


@pytest.mark.skipif("avx2" not in cpu_kernels.cpu_flags(), reason="no AVX2")
def test_the_avx2_path_computes_the_same():
    """CPUs without AVX512-VNNI (AVX2 only) run the u8 x s8 products as vpmaddubsw + vpmaddwd
    (the 8-bit weights as |s| times x with s's sign, llama.cpp's way, which cannot saturate 16
    bits): forced here on this CPU."""
    generator = torch.Generator().manual_seed(5)
    q, scales, zeros, weight = q4_weights(128, 576, generator)
    s, scales8, weight8 = q8_weights(64, 576, generator)
    s[:, :32] = 127   # the largest products a pair of 16-bit lanes could hold
    s[:, 32:64] = -127
    s[:3, 64:96] = -128   # not in a file llama.cpp writes, but a Q8_0 block can hold it
    weight8 = (s.view(64, 18, 32).float() * scales8.float()[..., None]).view(64, 576)
    x = torch.randn(5, 576, generator=generator)
    x[:, :32] = x[:, :32].abs() + 1
    x[:, 32:96] = -(x[:, 32:96].abs() + 1)
    module = q8_kernels.load()
    try:
        module.set_instruction_set("avx2")
        assert module.instruction_set() == "avx2"
        got4 = q8_kernels.q4_linear(x, q8_kernels.pack_q4(q), scales, zeros)
        got8 = q8_kernels.q8_linear(x, q8_kernels.pack_q8(s), scales8)
    finally:
        module.set_instruction_set("best")
    assert close(got4, q8_kernels.reference_linear(x, weight), 1e-4)
    assert close(got8, q8_kernels.reference_linear(x, weight8), 1e-4)


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count():
    """What makes the engine's batched steps equal generate's one row at a time: each output row
    from its own activation row only, rows split between threads whole."""
    generator = torch.Generator().manual_seed(3)
    q, scales, zeros, _ = q4_weights(256, 576, generator)
    s, scales8, _ = q8_weights(256, 576, generator)
    packed4, packed8 = q8_kernels.pack_q4(q), q8_kernels.pack_q8(s)
    x = torch.randn(7, 576, generator=generator).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((q8_kernels.q4_linear(x, packed4, scales, zeros), q8_kernels.q8_linear(x, packed8, scales8)))
    finally:
        torch.set_num_threads(threads)
    for one_thread, two_threads in zip(*results):
        assert torch.equal(one_thread, two_threads)
    for i in range(7):
        assert torch.equal(q8_kernels.q4_linear(x[i:i + 1].contiguous(), packed4, scales, zeros), results[0][0][i:i + 1])
        assert torch.equal(q8_kernels.q8_linear(x[i:i + 1].contiguous(), packed8, scales8), results[0][1][i:i + 1])


def test_a_4_bit_layer_on_8_bit_activations_stays_close_to_its_dense_weights():
    """Int4Linear below `q8_below_rows` rows: the same weights (its dense read-back), activations
    rounded to 8 bits: within what that rounding moves (~1 % of the largest output here)."""
    torch.manual_seed(0)
    linear = Int4Linear.quantize(torch.nn.Linear(576, 192, bias=True))
    assert linear.q8 is not None
    dense = linear.dequantized()
    linear.with_q8(4)
    x = torch.randn(3, 576).bfloat16()
    want = torch.nn.functional.linear(x.float(), dense.float(), linear.bias.float())
    assert close(linear(x), want, 0.02)
    assert not torch.equal(linear(x), quantize.int4_linear(x, linear.packed, linear.scales_zeros, linear.bias))
    linear.with_q8(0)   # off: the copy is dropped and torch's kernel runs
    assert linear.q8 is None and torch.equal(linear(x), quantize.int4_linear(x, linear.packed, linear.scales_zeros,
                                                                            linear.bias))


def tied_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(SHAPE, tie_word_embeddings=True))).eval()
    generator = torch.Generator().manual_seed(7)
    model.model.embed_tokens.weight.data = q8_0_weight(*model.model.embed_tokens.weight.shape, generator)
    return model


def test_the_kernel_path_names_the_8_bit_activations():
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=8, q8_rows=3)
    assert model.model.layers[0].self_attn.q_proj.q8_below_rows == 3
    assert isinstance(model.lm_head, Int8SplitLinear) and model.lm_head.q8_below_rows == 3
    assert quantize.kernel_path(model) == ("4-bit projections below 8 rows, dense from 8 (8-bit activations below 3 "
                                           "rows); 8-bit head below 8 rows, dense from 8 (8-bit activations below 3 rows)")


def test_the_engine_equals_generate_on_8_bit_activations():
    """Every product on the 8-bit-activation kernels (batch-invariant: a row's bits do not depend
    on the rows beside it): the engine's fused q/k/v and gate/up, chunked prefill and batched
    decode rows give generate's tokens, one request at a time through separate modules."""
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=1 << 20)
    refs = [reference(model, p, 16) for p in PROMPTS]
    model.generation_config.eos_token_id = None
    outs, _ = engine_tokens(model, PROMPTS, 16, max_batch=2, dtype=torch.bfloat16)
    for i, ref in enumerate(refs):
        assert outs[f"r{i}"] == ref, f"r{i}"


def test_the_threshold_is_timed_at_start_and_logged(caplog):
    """INT4_Q8_ROWS=-1 (the default): both kernels timed on the model's own projections and
    head, the choice logged with the timings and applied to every layer."""
    model = tied_model()
    with caplog.at_level(logging.INFO, logger="worker.engine.cpu_kernels"):
        quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=-1)
    line = next(r.getMessage() for r in caplog.records if "8-bit activations" in r.getMessage())
    assert "projections 1: " in line and "head 1: " in line, line
    below = {m.q8_below_rows for m in model.modules() if isinstance(m, Int4Linear)}
    assert len(below) == 1 and below.pop() in (0, cpu_kernels.EVERY_SIZE, *(n + 1 for n in cpu_kernels.Q8_ROW_COUNTS))
    assert all((m.q8 is None) == (m.q8_below_rows == 0) for m in model.modules() if isinstance(m, Int4Linear))


def test_the_threshold_is_timed_on_the_products_a_step_runs():
    """The timing sees the decoder's fused products (q/k/v, o, gate/up, down: four a layer), not
    seven smaller ones: each joined copy multiplies exactly as its parts side by side."""
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=3)
    quantized = [m for m in model.modules() if isinstance(m, Int4Linear)]
    run = quantize.as_run(model, quantized)
    assert len(run) == 4 * len(model.model.layers) and len(quantized) == 7 * len(model.model.layers)
    layer = model.model.layers[0]
    x = torch.randn(2, layer.self_attn.q_proj.in_features).bfloat16()
    parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    for linear in (run[0], *parts):
        linear.q8_below_rows = 2
    with torch.inference_mode():
        for rows in (1, 2):          # the 8-bit-activation kernel, then torch's
            assert torch.equal(run[0](x[:rows]), torch.cat([p(x[:rows]) for p in parts], -1))
    assert run[1] is layer.self_attn.o_proj


def test_the_threshold_is_the_last_row_count_of_an_unbroken_win():
    assert cpu_kernels.below({1: (10.0, 6.0), 2: (12.0, 9.0), 3: (14.0, 13.5), 4: (16.0, 10.0)}) == 3
    assert cpu_kernels.below({1: (10.0, 9.5)}) == 0          # not by 10 %: off
    assert cpu_kernels.below({1: (10.0, 5.0), 8: (20.0, 10.0)}) == 9
    # winning at every count up to the largest the calibration times: at every size (a prefill chunk too)
    assert cpu_kernels.below({1: (10.0, 5.0), 64: (300.0, 200.0)}, every_from=64) == cpu_kernels.EVERY_SIZE
    assert cpu_kernels.below({1: (10.0, 5.0), 64: (300.0, 290.0)}, every_from=64) == 2


def test_without_the_kernels_the_model_keeps_torchs(monkeypatch):
    """Where the extension cannot be built (no compiler) or run (no AVX2), no copies are made and
    nothing changes."""
    monkeypatch.setattr(q8_kernels, "load", lambda: None)
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=-1)
    assert all(m.q8 is None and m.q8_below_rows == 0 for m in model.modules() if isinstance(m, Int4Linear))
    assert model.lm_head.q8_packed is None and "8-bit activations" not in quantize.kernel_path(model)


def test_turned_off_the_kernels_are_neither_built_nor_copied(monkeypatch):
    """INT4_Q8_ROWS=0: no copy of the weights in their layout is made, so a worker without a
    compiler never tries to build them."""
    def no_build():
        raise AssertionError("the kernels were loaded with INT4_Q8_ROWS=0")
    monkeypatch.setattr(q8_kernels, "load", no_build)
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=0)
    assert all(m.q8 is None and m.q8_below_rows == 0 for m in model.modules() if isinstance(m, Int4Linear))
    assert model.lm_head.q8_packed is None

"""The row kernels (worker/engine/row_kernels.py): RMSNorm, RoPE with the KV writes, and decode
attention as one C++ call each. Each computes what torch's operations compute (to within rounding,
or bit for bit where the engine relies on it), each row from its own inputs alone (batch- and
thread-invariant), and `install` makes `generate` run the same kernels as the engine's decoder
loop, so the engine still equals `generate`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.engine_families import COMMON, PROMPTS, Tok, engine_tokens, reference
from worker.engine import row_kernels
from worker.engine.decoder import fold_sign, rotate

pytestmark = pytest.mark.skipif(row_kernels.load() is None, reason="no AVX2+FMA, or no C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]


def kernels():
    return row_kernels.load()


def reference_attention(q, keys, values, table, starts, ends, block_size, scale):
    """Each row's attention over its positions, in float64."""
    out = []
    groups = q.shape[1] // keys.shape[1]
    for r in range(q.shape[0]):
        pos = torch.arange(int(starts[r]), int(ends[r]))
        rows = table[r][pos // block_size] * block_size + pos % block_size
        k = keys[rows].double().repeat_interleave(groups, 1).transpose(0, 1)     # [H, L, D]
        v = values[rows].double().repeat_interleave(groups, 1).transpose(0, 1)
        w = torch.softmax((k @ q[r].double()[:, :, None]).squeeze(-1) * scale, -1)  # [H, L]
        out.append((w[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


def paged(dtype, *, rows=5, kv_heads=2, groups=3, dim=64, block_size=16, blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn((blocks + 1) * block_size, kv_heads, dim, generator=g).to(dtype)
    values = torch.randn((blocks + 1) * block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(rows, kv_heads * groups, dim, generator=g).to(dtype)
    table = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in range(rows)])
    ends = torch.randint(1, 6 * block_size + 1, (rows,), generator=g)
    starts = torch.where(torch.arange(rows) % 2 == 1, (ends - 7).clamp(min=0), torch.zeros_like(ends))   # some windowed
    return q, keys, values, table, starts, ends, block_size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 3, 8])
def test_decode_attention_is_attention_over_each_rows_own_positions(dtype, groups):
    q, keys, values, table, starts, ends, bs = paged(dtype, groups=groups)
    got = kernels().decode_attention(q, keys, values, table, starts, ends, bs, 0.125)
    want = reference_attention(q, keys, values, table, starts, ends, bs, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_rows_do_not_depend_on_their_companions_or_the_threads(dtype):
    q, keys, values, table, starts, ends, bs = paged(dtype, rows=40, blocks=40)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = kernels().decode_attention(q, keys, values, table, starts, ends, bs, 0.1)
        torch.set_num_threads(1)
        for r in (0, 7, 39):
            alone = kernels().decode_attention(q[r : r + 1], keys, values, table[r : r + 1], starts[r : r + 1],
                                               ends[r : r + 1], bs, 0.1)
            assert torch.equal(alone[0], together[r])
    finally:
        torch.set_num_threads(before)


def test_decode_attention_refuses_what_it_cannot_read():
    q, keys, values, table, starts, ends, bs = paged(torch.float32)
    with pytest.raises(RuntimeError, match="non-empty range"):
        kernels().decode_attention(q, keys, values, table, ends, ends, bs, 0.1)
    with pytest.raises(RuntimeError, match="non-empty range"):   # past what the table covers
        kernels().decode_attention(q, keys, values, table, starts, ends + 6 * bs, bs, 0.1)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels().decode_attention(q.bfloat16(), keys, values, table, starts, ends, bs, 0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_llama_rms_norm_row_by_row(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 576, generator=g) * 3).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got = kernels().rms_norm(x, weight, 1e-5)
    x32 = x.float()
    want = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * 8)
    for r in (0, 150, 299):   # a row alone gives the bits it gets among 300 (split over threads)
        assert torch.equal(kernels().rms_norm(x[r : r + 1].contiguous(), weight, 1e-5)[0], got[r])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_gives_rotates_bits_and_writes_only_its_rows(dtype):
    heads, kv_heads, d, tokens = 9, 3, 64, 11
    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    angles = torch.rand(tokens, 1, d, generator=g) * 6
    cos, signed_sin = angles.cos().to(dtype), fold_sign(angles.sin()).to(dtype)
    rows = torch.randperm(40, generator=g)[:tokens]
    keys, values = (torch.full((40, kv_heads, d), 7.0, dtype=dtype) for _ in range(2))
    q = kernels().rope_store(qkv, cos, signed_sin, rows, keys, values, heads, kv_heads)
    qk, v = qkv.view(tokens, heads + 2 * kv_heads, d).split([heads + kv_heads, kv_heads], dim=1)
    want_q, want_k = rotate(qk, cos, signed_sin).split([heads, kv_heads], dim=1)
    assert torch.equal(q, want_q) and torch.equal(keys[rows], want_k) and torch.equal(values[rows], v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert (keys[untouched] == 7).all() and (values[untouched] == 7).all()
    with pytest.raises(RuntimeError, match="out of range"):
        kernels().rope_store(qkv, cos, signed_sin, rows + 40, keys, values, heads, kv_heads)


def _llama(**overrides):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, **overrides})).eval()


def test_the_engine_installs_them_and_still_equals_generate(monkeypatch):
    """The engine swaps the norms, sends its decode rows and `generate`'s one-token queries
    through the kernel, and every request's greedy tokens equal generate's, before and after."""
    model = _llama()
    before = [reference(model, p, 12) for p in PROMPTS]   # torch's norms and SDPA
    engine_calls, generate_calls = [], []
    real = row_kernels.decode_attention
    monkeypatch.setattr(row_kernels, "decode_attention", lambda *a: engine_calls.append(1) or real(*a))
    real_generate = row_kernels.generate_decode_attention

    def spy(*args):
        out = real_generate(*args)
        if args[1].shape[2] == 1:   # a one-token query (prompts go through SDPA)
            generate_calls.append(out is not None)
        return out
    monkeypatch.setattr(row_kernels, "generate_decode_attention", spy)
    outs, engine = engine_tokens(model, PROMPTS, 12, max_batch=2)
    assert row_kernels.installed(model) and row_kernels.installed_attention(model)
    assert all(isinstance(layer.input_layernorm, row_kernels.RowRMSNorm) for layer in model.model.layers)
    assert engine.runner.decoder.layers[0].rope_store is not None
    # decode rows went through the kernel: from the layer loop (steps with prompt rows), or in
    # the whole-stack call (decode_layers.cpp calls it directly)
    assert engine_calls or engine.runner.decoder.decode_layers is not None
    after = [reference(model, p, 12) for p in PROMPTS]   # the kernels' norms and decode attention
    assert generate_calls and all(generate_calls)
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == after == before


def test_switched_off_or_unfit_they_leave_the_model_as_it_is():
    """row_kernels=False installs nothing; 16 query heads per KV head (past the kernel's 8)
    keeps SDPA for attention; either way the engine equals generate."""
    model = _llama()
    outs, engine = engine_tokens(model, PROMPTS[:2], 8, max_batch=2, row_kernels=False)
    assert not row_kernels.installed(model) and not engine.runner.row_attention
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert [outs["r0"], outs["r1"]] == [reference(model, p, 8) for p in PROMPTS[:2]]
    wide = _llama(num_attention_heads=16, num_key_value_heads=1, hidden_size=128)
    outs, engine = engine_tokens(wide, PROMPTS[:2], 8, max_batch=2)
    assert row_kernels.installed(wide) and not row_kernels.installed_attention(wide)
    assert not engine.runner.row_attention
    assert [outs["r0"], outs["r1"]] == [reference(wide, p, 8) for p in PROMPTS[:2]]


def test_a_step_of_decode_rows_is_one_call_through_every_layer(monkeypatch):
    """On 4-bit projections with 8-bit activations, a step of decode rows runs every layer as
    one call (decode_layers.cpp), bit for bit what the layer loop gives; steps with prompt rows
    keep the loop; the tokens are generate's."""
    from tests.test_q8_kernels import tied_model
    from worker.engine import decoder as decoder_module
    from worker.engine.quantize import quantize_int4
    model = tied_model()
    quantize_int4(model, torch.bfloat16, dense_rows=0, q8_rows=1 << 20)
    refs = [reference(model, p, 12) for p in PROMPTS]
    model.generation_config.eos_token_id = None
    calls = []

    class Checked:
        """The extension's DecodeLayers, each call checked against the layer loop on the same
        inputs (the loop writes the same keys and values to the same pool rows again)."""

        def __init__(self, stack):
            self.stack, self.meta = stack, None

        def forward(self, h, cos, sin, *rest):
            out = self.stack.forward(h, cos, sin, *rest)
            loop = h
            for layer in decoder.layers:
                loop = layer(loop, cos, sin, self.meta)
            assert torch.equal(out, loop)
            calls.append(h.shape[0])
            return out

    real_hidden = decoder_module.Decoder.hidden
    decoder = None

    def hidden(self, ids, positions, meta):
        nonlocal decoder
        if self.decode_layers is not None and not isinstance(self.decode_layers, Checked):
            decoder, self.decode_layers = self, Checked(self.decode_layers)
        if isinstance(self.decode_layers, Checked):
            self.decode_layers.meta = meta
        return real_hidden(self, ids, positions, meta)

    monkeypatch.setattr(decoder_module.Decoder, "hidden", hidden)
    outs, engine = engine_tokens(model, PROMPTS, 12, max_batch=2, dtype=torch.bfloat16)
    assert isinstance(engine.runner.decoder.decode_layers, Checked)
    assert 1 in calls and 2 in calls and set(calls) == {1, 2}
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == refs

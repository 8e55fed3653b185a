"""The decoder forward pass the engine runs: transformers' weights, in one loop of few tensor ops.

transformers' `model(...)` wraps every layer, attention, norm and MLP in module calls,
decorators and keyword plumbing, and runs seven projections per layer. Each tensor operation is a
dispatch on the host (on a GPU, a kernel launch): for a small model a decode step is mostly that
host time, at every batch size, unless the whole step is replayed as a CUDA graph. So the loop
below is written for the fewest operations that compute exactly what the model computes
(`bench/decoder_dispatch.py` counts them: a Llama layer's decode step went from 73 operations,
views included, to 32 in fp32 and 46 in bf16, then 38 in bf16 with its norms in 4 operations
instead of 8; a dispatch-bound step takes about half the time):

    h = embed(ids)                                               # [T, hidden], no batch axis
    per layer:  x = rms(h); qkv = x @ Wqkv (+ b)                 # q/k/v fused
                [Qwen3: q, k = rms(q), rms(k) per head]
                q, k = rope(q, k)                                # one rotation over q and k together
                h = h + o_proj(attention.attend(q, k, v))
                x = rms(h); g, u = split(x @ Wgate_up); h = h + down(silu(g) * u)
    logits = lm_head(rms(h)[rows to keep])

On a CPU the row kernels (`row_kernels.py`) replace the norms, RoPE with the KV writes, and the
decode rows' attention by one C++ call each; `install` puts the same kernels into the model, so
what follows still holds.

Exactness: every function here runs the same operations in the same order as the model's own
module (`rms_norm` is LlamaRMSNorm's forward without its no-op dtype casts, or torch's one-op
`F.rms_norm` where that gives the same bits, or in bf16 `F.rms_norm` of the float32 input with
the weight applied after the cast back, which is the module's own order; `rotate` is
`apply_rotary_pos_emb`'s `x * cos + rotate_half(x) * sin`, with the sign of `rotate_half`'s
negated half moved onto sin, which IEEE negation makes exact). That is checked when the
decoder is built, bit for bit on the model's own device and dtype: a norm or activation that
differs is called as the model's module instead, and a rotary embedding that differs refuses
the model. The fused weights are built once and the original projections' weights become views
of them (no second copy), so `model.generate` and this loop read the same numbers; that holds
for 4-bit projections too (`quantize.py`), whose packed rows fuse the same way.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from worker.engine import attention, q8_kernels, row_kernels
from worker.engine.model_support import SUPPORTED_FAMILIES, UnsupportedModel
from worker.engine.quantize import Int4Linear, Int8SplitLinear, fused_groups, int4_linear, join_rows


_LINEAR_ROW_AXES = (("weight", 0), ("bias", 0))


def _fuse(linears: list[torch.nn.Module]) -> tuple[torch.Tensor | None, ...]:
    """The linears' tensors (`nn.Linear`: weight, bias; `Int4Linear`: its `ROW_AXES`) joined
    along their output rows; the linears' own tensors become views of them (no second copy, and
    `model.generate` reads the same numbers)."""
    axes = getattr(linears[0], "ROW_AXES", _LINEAR_ROW_AXES)
    if len(linears) == 1:   # nothing to join: the linear's own tensors
        return tuple(getattr(linears[0], name) for name, _ in axes)
    fused = join_rows(linears, axes)
    for (name, axis), whole in zip(axes, fused):
        if whole is None:
            continue
        start = 0
        for lin in linears:
            part = getattr(lin, name)
            view = whole.narrow(axis, start, part.shape[axis])
            if isinstance(lin, Int4Linear):
                setattr(lin, name, view)   # a buffer
            else:
                setattr(lin, name, torch.nn.Parameter(view, requires_grad=False))
            start += part.shape[axis]
    return tuple(fused)


def projection(linears: list[torch.nn.Module]):
    """One callable x -> the linears' outputs side by side (one matrix product over fused
    weights when there are several): `F.linear` for float weights, the 4-bit kernel for
    `Int4Linear` (quantize.py)."""
    if len({type(lin) for lin in linears}) > 1:
        raise ValueError("projections of different kinds cannot be fused")
    if isinstance(linears[0], Int8SplitLinear):   # the 8-bit LM head: never fused, one module call
        if len(linears) > 1:
            raise ValueError("8-bit heads are not fused")
        return linears[0]
    tensors = _fuse(linears)
    if isinstance(linears[0], Int4Linear):
        packed, scales_zeros, bias, dense, q8_packed, q8_scales, q8_zeros = tensors
        from_rows, q8_below_rows = linears[0].dense_from_rows, linears[0].q8_below_rows
        q8 = None if q8_packed is None else (q8_packed, q8_scales, q8_zeros)
        general = lambda x: int4_linear(x, packed, scales_zeros, bias, dense, from_rows, q8, q8_below_rows)  # noqa: E731
        # what the whole-stack call (decode_layers.cpp) needs to run it as int4_linear does
        general.parts = (dense, from_rows, packed, scales_zeros, *(q8 or (None,) * 3), q8_below_rows, bias)
        if q8 is None or q8_below_rows <= 1:
            return general
        # a decode step's few rows straight to the 8-bit-activation kernel (the fused tensors are
        # contiguous, and so are the decoder's activations): 4 products a layer, each a dispatch
        q4_linear = q8_kernels.load().q4_linear
        call = lambda x: q4_linear(x, q8_packed, q8_scales, q8_zeros, bias) if x.shape[0] < q8_below_rows else general(x)  # noqa: E731
        call.parts = general.parts
        return call
    weight, bias = tensors
    call = lambda x: F.linear(x, weight, bias)  # noqa: E731
    call.parts = (weight, 0, None, None, None, None, None, 0, bias)
    return call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward (and Mistral's, Qwen2's, Qwen3's), minus its casts when they are
    no-ops: statistics in float32, then `weight * normalized`."""
    dtype = x.dtype
    x32 = x if dtype == torch.float32 else x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 if dtype == torch.float32 else x32.to(dtype))


def fold_sign(sin: torch.Tensor) -> torch.Tensor:
    """cat(-sin1, sin2) over the last axis: rotate_half's negation moved onto sin (`rotate`)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, heads, D] with cos, signed_sin [T, 1, D]: `x * cos + rotate_half(x) * sin`
    where rotate_half(x) = cat(-x2, x1); here roll(x) = cat(x2, x1) times cat(-sin1, sin2), the
    same products (a sign flip is exact), in 4 operations instead of 7."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


def _samples(width: int, like: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random inputs of a few row counts (kernels may reduce differently by shape) on `like`'s
    device and dtype, for the load-time equality checks."""
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return [(torch.randn(*shape, width, generator=generator, device=like.device) * 3).to(like.dtype)
            for shape in ((1,), (7,), (300,), (7, 3))]


def _norm_fn(module, samples: list[torch.Tensor]):
    """Where the module is the row kernel's (row_kernels.install: `generate` runs it too), the
    kernel called directly, one call. Else the cheapest callable that equals `module(x)` bit for bit on every sample: torch's own
    `rms_norm` (one operation; equal on CPU in fp32, not in bf16 with trained weights), else its
    unweighted form on the float32 statistics with the weight applied after the cast back, as
    LlamaRMSNorm does in bf16 (4 operations instead of 8: a bf16 decode step runs two norms a
    layer), else `rms_norm` above, else the module itself."""
    if isinstance(module, row_kernels.RowRMSNorm):   # the kernel, called directly (Qwen3's per-head q/k are views)
        rms, weight, eps = row_kernels.load().rms_norm, module.weight, module.variance_epsilon
        return lambda x: rms(x if x.is_contiguous() else x.contiguous(), weight, eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or weight is None:
        return module
    shape = (weight.shape[-1],)
    dtype = samples[0].dtype
    candidates = [lambda x: F.rms_norm(x, shape, weight, eps)]
    if dtype != torch.float32:
        candidates.append(lambda x: weight * F.rms_norm(x.to(torch.float32), shape, None, eps).to(dtype))
    candidates.append(lambda x: rms_norm(x, weight, eps))
    with torch.inference_mode():
        expected = [module(x) for x in samples]
        for fn in candidates:
            if all(torch.equal(fn(x), want) for x, want in zip(samples, expected)):
                return fn
    return module


class _Layer:
    def __init__(self, layer, config, samples: list[torch.Tensor]):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.index = attn.layer_idx
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.qkv, self.o_proj, self.gate_up, self.down = (projection(group) for group in fused_groups(layer))
        self.qk_v = [self.heads + self.kv_heads, self.kv_heads]   # head counts: split points of qkv
        self.q_k = [self.heads, self.kv_heads]
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.norm_modules = (layer.input_layernorm, layer.post_attention_layernorm)
        self.input_norm = _norm_fn(layer.input_layernorm, samples)
        self.post_norm = _norm_fn(layer.post_attention_layernorm, samples)
        self.q_norm = self.k_norm = None
        if getattr(attn, "q_norm", None) is not None:   # Qwen3: per-head norms of q and k
            head_samples = _samples(self.head_dim, samples[0], seed=1)
            self.q_norm, self.k_norm = _norm_fn(attn.q_norm, head_samples), _norm_fn(attn.k_norm, head_samples)
        # Qwen2/Qwen3 set it per layer (None on full-attention layers); Mistral reads its config
        self.window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        self.inter = mlp.gate_proj.out_features
        self.gate_up_sizes = [self.inter, self.inter]
        self.rope_store = None   # set by Decoder where row_kernels' rope_store gives `rotate`'s bits
        with torch.inference_mode():
            same = all(torch.equal(F.silu(x), mlp.act_fn(x)) for x in samples)
            self.act = F.silu if same else mlp.act_fn

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 meta: attention.StepMeta) -> torch.Tensor:
        tokens = h.shape[0]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self.input_norm(h))                                      # [T, (H + 2 KVH) D]
        if self.rope_store is not None and meta.block_tables is None:   # CPU: q out, k and v into the pool
            cache = meta.cache
            q = self.rope_store(qkv, cos, signed_sin, meta.write_rows, cache.keys[self.index],
                                cache.values[self.index], heads, kv_heads)
            k = v = None
        else:
            qk, v = torch.split_with_sizes(qkv.view(tokens, heads + 2 * kv_heads, d), self.qk_v, dim=1)
            if self.q_norm is None:   # rotate q and k in one pass: they are adjacent heads of qkv
                q, k = torch.split_with_sizes(rotate(qk, cos, signed_sin), self.q_k, dim=1)
            else:
                q, k = torch.split_with_sizes(qk, self.q_k, dim=1)
                q, k = rotate(self.q_norm(q), cos, signed_sin), rotate(self.k_norm(k), cos, signed_sin)
        out = attention.attend(meta, self.index, q, k, v, self.scaling, self.window)  # [T, H, D]
        h = h + self.o_proj(out.reshape(tokens, heads * d))
        gate, up = torch.split_with_sizes(self.gate_up(self.post_norm(h)), self.gate_up_sizes, dim=-1)
        return h + self.down(self.act(gate) * up)


def _check_rope(rope, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Refuse a model whose apply_rotary_pos_emb is not the rotation `rotate` computes."""
    generator = torch.Generator(device=cos.device).manual_seed(0)
    tokens = cos.shape[1]
    q = torch.randn(1, heads, tokens, head_dim, generator=generator, device=cos.device).to(cos.dtype)
    with torch.inference_mode():
        expected, _ = rope(q, q, cos, sin)
        ours = rotate(q[0].transpose(0, 1), cos[0, :, None], fold_sign(sin)[0, :, None]).transpose(0, 1)[None]
    if not torch.equal(expected, ours):
        raise UnsupportedModel("the model's rotary embedding is not the rotate-half RoPE the engine computes")


def _rope_store_exact(layer: _Layer, cos_table: torch.Tensor, signed_sin_table: torch.Tensor) -> bool:
    """row_kernels' rope_store gives what `rotate` and the pool writes give, bit for bit, on samples."""
    heads, kv_heads, d = layer.heads, layer.kv_heads, layer.head_dim
    generator = torch.Generator().manual_seed(2)
    tokens = 7
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator) * 3).to(cos_table.dtype)
    positions = torch.randint(0, cos_table.shape[0], (tokens,), generator=generator)
    cos, sin = cos_table.index_select(0, positions), signed_sin_table.index_select(0, positions)
    rows = torch.randperm(2 * tokens, generator=generator)[:tokens]
    keys, values = (torch.zeros(2 * tokens, kv_heads, d, dtype=qkv.dtype) for _ in range(2))
    with torch.inference_mode():
        q = row_kernels.load().rope_store(qkv, cos, sin, rows, keys, values, heads, kv_heads)
        qk, v = qkv.view(tokens, heads + 2 * kv_heads, d).split([heads + kv_heads, kv_heads], dim=1)
        want_q, want_k = rotate(qk, cos, sin).split([heads, kv_heads], dim=1)
    return torch.equal(q, want_q) and torch.equal(keys[rows], want_k) and torch.equal(values[rows], v)


def decode_layers(layers: list[_Layer], model):
    """The extension's `DecodeLayers` over these layers (a step of decode rows through every
    layer in one call: decode_layers.cpp) and the layers' attention window; (None, None) where a
    layer is not on the path that call repeats: the row kernels' norms, RoPE and attention, SiLU
    (F.silu's bits), one window for all layers."""
    if not layers or not row_kernels.installed_attention(model) or len({layer.window for layer in layers}) != 1:
        return None, None
    projections = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in layers]
    fits = all(layer.rope_store is not None and layer.act is F.silu
               and all(isinstance(norm, row_kernels.RowRMSNorm) for norm in layer.norm_modules)
               and all(hasattr(p, "parts") for p in group) for layer, group in zip(layers, projections))
    if not fits:
        return None, None
    stack = row_kernels.load().DecodeLayers()   # loaded: installed_attention says so
    for layer, (qkv, o_proj, gate_up, down) in zip(layers, projections):
        first, second = layer.norm_modules
        stack.add_layer(first.weight, first.variance_epsilon, second.weight, second.variance_epsilon,
                        qkv.parts, o_proj.parts, gate_up.parts, down.parts, layer.heads, layer.kv_heads,
                        layer.head_dim, layer.inter, layer.scaling)
    return stack, layers[0].window


class Decoder:
    """Callable like the engine's old `model(...)` call, returning logits [kept rows, vocab].

    `max_positions` bounds the positions it is called with (the engine's max_seq_len): the
    rotary cos/sin of every position are computed once, with the model's own rotary module,
    and a step looks its positions up (2 operations instead of ~20 per step)."""

    def __init__(self, model, max_positions: int = 4096):
        config = model.config.get_text_config()
        if config.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(f"no direct decoder loop for {config.model_type!r}")
        base = model.model
        self.embed = base.embed_tokens
        self.lm_head = projection([model.lm_head])
        param = self.embed.weight   # the activations' device and dtype (a projection may be 4-bit)
        samples = _samples(config.hidden_size, param, seed=0)
        self.norm = _norm_fn(base.norm, samples)
        with torch.no_grad():
            self.layers = [_Layer(layer, config, samples) for layer in base.layers[: config.num_hidden_layers]]
        first = self.layers[0]
        with torch.inference_mode():
            # [positions, 1, D]: cos and sin with rotate_half's sign folded in (see `rotate`)
            cos, sin = base.rotary_emb(samples[0][None], torch.arange(max_positions, device=param.device)[None])
            self.cos_table = cos[0, :, None]
            self.signed_sin_table = fold_sign(sin[0, :, None])
            # the table holds what the module computes for any batch of positions (it is static RoPE:
            # model_support refuses the kinds whose frequencies depend on the sequence)
            probe = torch.tensor([max_positions - 1, 0, 7, 3, max_positions // 2], device=param.device)
            cos_p, sin_p = base.rotary_emb(samples[0][None], probe[None])
            if not (torch.equal(cos_p[0, :, None], self.cos_table[probe])
                    and torch.equal(fold_sign(sin_p[0, :, None]), self.signed_sin_table[probe])):
                raise UnsupportedModel("the model's rotary embedding depends on more than the position")
        _check_rope(sys.modules[type(first.attn).__module__].apply_rotary_pos_emb, cos[:, :5], sin[:, :5],
                    first.heads, first.head_dim)
        if row_kernels.installed(model) and first.q_norm is None and first.head_dim % 16 == 0 \
                and _rope_store_exact(first, self.cos_table, self.signed_sin_table):
            for layer in self.layers:
                layer.rope_store = row_kernels.load().rope_store
        self.decode_layers, self.decode_window = decode_layers(self.layers, model)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None,
                 meta: attention.StepMeta) -> torch.Tensor:
        """ids, positions: long [T] (the packed step); keep: rows whose logits are wanted (None:
        all)."""
        h = self.hidden(ids, positions, meta)
        return self.logits(self.norm(h if keep is None else h[keep]))

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta: attention.StepMeta) -> torch.Tensor:
        """The last layer's output [T, hidden], before the final norm."""
        h = self.embed(ids)                                    # [T, hidden]
        cos = self.cos_table.index_select(0, positions)        # [T, 1, D]: broadcast over heads
        signed_sin = self.signed_sin_table.index_select(0, positions)
        tokens = ids.shape[0]
        if self.decode_layers is not None and meta.num_decode == tokens and meta.decode_table is not None \
                and meta.block_tables is None:
            cache = meta.cache
            return self.decode_layers.forward(h, cos, signed_sin, meta.write_rows, cache.keys, cache.values,
                                              meta.decode_table, meta.decode_starts(self.decode_window),
                                              meta.decode_lengths, cache.block_size)
        for layer in self.layers:
            h = layer(h, cos, signed_sin, meta)
        return h

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head over final-normed hidden states [rows, hidden] -> [rows, vocab]. Kept out of
        a captured decode graph: run on the real rows only, it skips the padding rows' logits
        (the largest matrix product of a small model's step) and needs no [rows, vocab] output
        per captured batch size."""
        return self.lm_head(normed)

"""The decoder forward pass the engine runs: transformers' own modules and weights, called
directly in one loop, with the q/k/v and the gate/up projections fused.

transformers' `model(...)` wraps every layer, attention and MLP in module calls, decorators and
keyword plumbing, and runs seven projections per layer. At small batches on a CPU that Python
and those extra matmul calls were a third of a decode step; on a GPU they are host time that
every step pays (vLLM and nano-vllm own their model code for the same reason). Here each
accepted family (`model_support.py`: Llama, Mistral, Qwen2, Qwen3) runs as:

    h = embed(ids)
    per layer:  x = input_norm(h); q, k, v = split(x @ Wqkv (+ b)); [Qwen3: q_norm, k_norm]
                q, k = rope(q, k); h += o_proj(paged_attention(q, k, v))
                x = post_norm(h); g, u = split(x @ Wgate_up); h += down(act(g) * u)
    logits = lm_head(norm(h)[rows to keep])

The norms, rotary embedding, activation and `apply_rotary_pos_emb` are the model's own objects
and functions, so the arithmetic is the model's. The fused weights are built once and the
original projections' weights are replaced by views into them (no second copy in memory), so
`model.generate` and this loop read the same numbers.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from worker.engine import attention
from worker.engine.model_support import SUPPORTED_FAMILIES


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) whose row blocks become the linears' weights."""
    weight = torch.cat([lin.weight.detach() for lin in linears], 0)
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases], 0) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("mixed biased and unbiased projections cannot be fused")
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class _Layer:
    def __init__(self, layer, config):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv_weight, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.split = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
        self.o_proj = attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        # Qwen2/Qwen3 set it per layer (None on full-attention layers); Mistral reads its config
        self.window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        self.gate_up_weight, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        self.inter = mlp.gate_proj.weight.shape[0]
        self.act = mlp.act_fn
        self.down = mlp.down_proj


class Decoder:
    """Callable like the engine's old `model(...)` call, returning logits [kept rows, vocab]."""

    def __init__(self, model):
        config = model.config.get_text_config()
        if config.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(f"no direct decoder loop for {config.model_type!r}")
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.rope = sys.modules[type(base.layers[0].self_attn).__module__].apply_rotary_pos_emb
        with torch.no_grad():
            self.layers = [_Layer(layer, config) for layer in base.layers[: config.num_hidden_layers]]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 meta: attention.StepMeta) -> torch.Tensor:
        """ids, positions: long [T] (the packed step); keep: rows whose logits are wanted."""
        tokens = ids.shape[0]
        h = self.embed(ids[None])                              # [1, T, hidden]
        cos, sin = self.rotary(h, positions[None])
        for layer in self.layers:
            x = layer.input_norm(h)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split(layer.split, dim=-1)
            shape = (1, tokens, -1, layer.head_dim)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out, _ = attention.paged_attention(layer.attn, q, k, v.transpose(1, 2), None, scaling=layer.scaling,
                                               sliding_window=layer.window, **{attention.META_KWARG: meta})
            h = h + layer.o_proj(out.reshape(1, tokens, -1))
            x = layer.post_norm(h)
            gate, up = F.linear(x, layer.gate_up_weight).split(layer.inter, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        h = self.norm(h[:, keep])
        return self.lm_head(h)[0]

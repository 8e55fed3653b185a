"""RMSNorm and decode-row attention as one C++ call each on a CPU (row_kernels.cpp).

Why: a decode step of one user is a few rows, and on a CPU the operations around its products
cost more than their arithmetic. On a 2-core AMD EPYC (Zen 3, AVX2) at one thread, a SmolLM2
step spent 114 µs a layer in torch's flash attention for one query row (its fixed setup, plus
two KV gathers of 17 µs) and 47 µs in each of its 61 norms (bf16: ten tensor operations);
the kernels here do each in a few µs (bench/RESULTS.md).

Exactness (the engine's rule: its tokens equal `model.generate`'s on the same model):
`install(model)` swaps the model's own RMSNorm modules for `RowRMSNorm` (the same weight,
LlamaRMSNorm's order of operations, one call), so `generate` and the engine's decoder loop both
run it; and it marks the attention modules, so that the `paged_kv` attention `generate` runs
(attention.register) sends its one-token queries through the same decode kernel the engine's
decode rows use, over the same keys in the same order. Both kernels are batch-invariant: a row's
result depends on its own inputs only. Prompt rows (prefill) still go through torch's SDPA in
both. Installed only on a CPU, where the extension builds (AVX2 and FMA), for norms that match
the module they replace to within rounding (checked on samples; anything else keeps its module).
"""

from __future__ import annotations

import functools
import logging

import torch

from worker.engine import native

log = logging.getLogger(__name__)

NAME = "llm_stream_cpu_kernels"   # one extension with the 8-bit kernels (native.py)
MARK = "_row_attention"   # set on a model's attention modules by `install`


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension (`rms_norm`, `rope_store`, `decode_attention`), or None where it
    cannot run here."""
    return native.load(NAME)


class RowRMSNorm(torch.nn.Module):
    """LlamaRMSNorm (Mistral's, Qwen2's, Qwen3's) as one kernel call: statistics in float32,
    the normalized row rounded to the input's dtype, then times the weight."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or not x.is_contiguous():
            x = x.to(self.weight.dtype).contiguous()
        return load().rms_norm(x, self.weight, self.variance_epsilon)


def attention_fits(head_dim: int, groups: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the decode kernel can run this attention (the same answer for the engine and generate)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and groups <= 8 and load() is not None)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                     starts: torch.Tensor, ends: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q [rows, heads, D] (one query token a row) over pools [pool rows, kv_heads, D]: row r sees
    positions [starts[r], ends[r]), position p at pool row table[r, p // block_size] * block_size
    + p % block_size -> [rows, heads, D]."""
    return load().decode_attention(q, keys, values, table, starts, ends, block_size, scale)


def _norm_close(module: torch.nn.Module, row: RowRMSNorm) -> bool:
    """RowRMSNorm computes what `module` does, to within a rounding of their dtype."""
    weight = row.weight
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, weight.shape[-1], generator=generator) * 3).to(weight.dtype)
    with torch.inference_mode():
        want, got = module(x).float(), row(x).float()
    tolerance = 1e-5 if weight.dtype == torch.float32 else 2 ** -7
    return want.shape == got.shape and torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max())


def install(model) -> bool:
    """Run `model`'s RMSNorms and one-token attention through the kernels (see the module's
    docstring); False where they cannot run here (then nothing changes)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16) or load() is None:
        return False
    swapped = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RowRMSNorm) or not type(child).__name__.endswith("RMSNorm"):
                continue
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            weight = getattr(child, "weight", None)
            if eps is None or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
                kept += 1
                continue
            row = RowRMSNorm(weight, float(eps))
            if _norm_close(child, row):
                setattr(parent, name, row)
                swapped += 1
            else:
                kept += 1
    config = model.config.get_text_config()
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    marked = 0
    if attention_fits(head_dim, heads // kv_heads, param.dtype, param.device):
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
                setattr(module, MARK, True)
                marked += 1
    model._row_kernels = True   # decoder.py: RoPE and the KV writes through `rope_store` (checked there)
    log.info("row kernels: %d norms as one call (%d kept), %d attention layers' decode rows in place",
             swapped, kept, marked)
    return True


def installed(model) -> bool:
    """Whether `install` ran on this model."""
    return getattr(model, "_row_kernels", False)


def installed_attention(model) -> bool:
    """Whether `install` routed this model's one-token attention through the decode kernel."""
    return any(getattr(module, MARK, False) for module in model.modules())


def generate_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
    """transformers' attention call for `generate` with one query token a sequence ([B, H, 1, D]
    over [B, KVH, L, D]), through the decode kernel: what the engine's decode rows compute. None
    where it does not apply (a marked module only; a mask that is not one range of positions a
    sequence), and SDPA runs instead."""
    if not getattr(module, MARK, False) or query.shape[2] != 1:
        return None
    batch, kv_len = key.shape[0], key.shape[2]
    starts, ends = [0] * batch, [kv_len] * batch
    if attention_mask is not None:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        allowed = allowed.expand(batch, -1, -1, -1)
        if allowed.shape[1] != 1 or allowed.shape[2] != 1:
            return None
        for b in range(batch):
            where = allowed[b, 0, 0].nonzero().flatten().tolist()
            if not where or where[-1] - where[0] + 1 != len(where):
                return None
            starts[b], ends[b] = where[0], where[-1] + 1
    kernel = load()
    table = torch.zeros(1, 1, dtype=torch.long)
    out = []
    for b in range(batch):   # positions of sequence b: one "block" of kv_len rows, [L, KVH, D] by strides
        out.append(kernel.decode_attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                                           table, torch.tensor([starts[b]]), torch.tensor([ends[b]]), kv_len, scaling))
    return torch.stack(out)   # [B, 1, H, D]: transformers' attention output layout

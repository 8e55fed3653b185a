"""The attention function the engine plugs into transformers' attention interface.

Each step packs every request's new tokens into ONE sequence [1, T] (a decoding request adds one
token, a prefilling request a chunk of its prompt) with per-token position ids, so the model's
projections, MLPs and RoPE run once for the whole batch. transformers' attention modules hand us
q/k/v of that packed sequence (no cache object is passed, so they do not try to update one); here
we write the new keys/values into each request's slot of the `SlotKVCache` and attend:

* decode tokens: batched SDPA over views `cache[a:b, :, :max_len of a..b]` with a per-row
  length mask, queries placed at their slot's row; the slot range is cut into segments
  (`decode_segments`) so that one long request does not make every row attend over its length;
* prefill chunks: one SDPA per chunk against that slot's view `[:start + chunk]` with a causal
  mask offset by `start`.

Grouped-query attention is handled by folding the query heads that share a KV head into the
query-length axis, so keys/values are never repeated.

A sliding window (Mistral, Qwen2's windowed layers) is part of the mask: transformers passes
each layer's `sliding_window`, and masks are built once per step for each window in use.
Which model families may use this attention is decided in `model_support.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTN_IMPLEMENTATION = "slot_kv"
META_KWARG = "slot_step"


@dataclass
class PrefillChunk:
    slot: int
    start: int             # position of the chunk's first token in the request
    length: int


@dataclass
class StepMeta:
    """Per-step index tensors, built once per step and shared by every layer."""
    cache: "object"                 # SlotKVCache
    write_slots: torch.Tensor       # long [T]: slot of each packed token
    write_pos: torch.Tensor         # long [T]: position of each packed token
    num_decode: int                 # packed tokens [0, num_decode) are decode tokens
    groups: int                     # query heads per KV head
    dtype: torch.dtype
    rows: int = 0                   # decode view covers slots [0, rows)
    max_len: int = 0                # decode view covers positions [0, max_len)
    row_token: torch.Tensor | None = None    # long [rows]: packed token feeding each row (None = identity)
    decode_rows: torch.Tensor | None = None  # long [num_decode]: row of each decode token (None = identity)
    decode_lengths: torch.Tensor | None = None  # long [rows]: context length of each row (query at length-1)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, max_len)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """Additive [rows, 1, 1, max_len]: row r sees positions < its length (and, with a window,
        the last `window` of them)."""
        key = ("decode", window)
        if key not in self._masks:
            span = torch.arange(self.max_len, device=self.write_pos.device)[None, :]
            lengths = self.decode_lengths[:, None]
            allowed = span < lengths
            if window is not None:
                allowed &= span >= lengths - window
            self._masks[key] = additive_mask(allowed, self.dtype).view(self.rows, 1, 1, -1)
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        key = (index, window)
        if key not in self._masks:
            chunk = self.prefills[index]
            self._masks[key] = prefill_mask(chunk.start, chunk.length, self.groups, self.write_pos.device,
                                            self.dtype, window)
        return self._masks[key]


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface signature; returns ([1, T, heads, head_dim], None)."""
    meta: StepMeta | None = kwargs.pop(META_KWARG, None)
    window = kwargs.get("sliding_window")
    if meta is None:  # a plain forward/generate call on the same model: behave like "sdpa"
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = module.layer_idx
    k_cache, v_cache = meta.cache.keys[layer], meta.cache.values[layer]
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    k_cache[meta.write_slots, :, meta.write_pos] = key[0].transpose(0, 1)
    v_cache[meta.write_slots, :, meta.write_pos] = value[0].transpose(0, 1)

    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query[0]  # [H, T, D]
    parts = []
    if meta.num_decode:
        rows = meta.rows
        q_rows = q[:, : meta.num_decode] if meta.row_token is None else q.index_select(1, meta.row_token)
        q_rows = q_rows.transpose(0, 1).reshape(rows, kv_heads, groups, head_dim)
        mask = meta.decode_mask(window)
        outs = [F.scaled_dot_product_attention(
            q_rows[a:b], k_cache[a:b, :, :length], v_cache[a:b, :, :length],
            attn_mask=mask[a:b, :, :, :length], scale=scaling,
        ) for a, b, length in meta.segments]
        out = (outs[0] if len(outs) == 1 else torch.cat(outs, 0)).reshape(rows, heads, head_dim)
        parts.append(out if meta.decode_rows is None else out.index_select(0, meta.decode_rows))
    offset = meta.num_decode
    for index, chunk in enumerate(meta.prefills):
        c, end = chunk.length, chunk.start + chunk.length
        q_chunk = q[:, offset : offset + c].reshape(1, kv_heads, groups * c, head_dim)
        out = F.scaled_dot_product_attention(
            q_chunk, k_cache[chunk.slot : chunk.slot + 1, :, :end], v_cache[chunk.slot : chunk.slot + 1, :, :end],
            attn_mask=meta.prefill_mask(index, window), scale=scaling,
        )  # [1, KVH, G*c, D]
        parts.append(out.view(kv_heads, groups, c, head_dim).permute(2, 0, 1, 3).reshape(c, heads, head_dim))
        offset += c
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    return out.unsqueeze(0), None


def decode_segments(lengths: list[int], min_saving: float = 0.25) -> list[tuple[int, int, int]]:
    """Cut decode rows [0, len(lengths)) into at most two contiguous ranges, each attending over
    its own longest context, when that saves at least `min_saving` of the rows x max_len work
    (e.g. one long request in the highest slot). Contiguous ranges keep the cache views free."""
    rows = len(lengths)
    whole = rows * max(lengths)
    prefix, best, cut = [], whole, 0
    for length in lengths:
        prefix.append(max(length, prefix[-1]) if prefix else length)
    suffix = 0
    for i in range(rows - 1, 0, -1):
        suffix = max(suffix, lengths[i])
        cost = i * prefix[i - 1] + (rows - i) * suffix
        if cost < best:
            best, cut = cost, i
    if cut and best <= whole * (1 - min_saving):
        return [(0, cut, prefix[cut - 1]), (cut, rows, max(lengths[cut:]))]
    return [(0, rows, max(lengths))]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere. CPU SDPA runs about twice as fast with an
    additive float mask as with a boolean one (it takes its fused kernel)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def prefill_mask(start: int, length: int, groups: int, device, dtype: torch.dtype = torch.float32,
                 window: int | None = None) -> torch.Tensor:
    """Causal mask of a chunk at `start`: query i (repeated for each folded head group) sees
    positions <= start + i (and > start + i - window with a sliding window, as transformers'
    `sliding_window_overlay`)."""
    q_pos = torch.arange(start, start + length, device=device)[:, None]
    k_pos = torch.arange(start + length, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return additive_mask(allowed.repeat(groups, 1), dtype)


def register() -> None:
    """Idempotent: make `slot_kv` a valid `attn_implementation`. Its mask function is SDPA's, so
    the model still runs `generate()` correctly outside the engine; engine steps pass a ready
    4D placeholder mask, which transformers hands through without building one."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

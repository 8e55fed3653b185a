"""The engine's attention over its paged KV cache.

Each step packs every request's new tokens into ONE sequence of T tokens (a decoding request adds
one token, a prefilling request a chunk of its prompt) with per-token positions, so the model's
projections, MLPs and RoPE run once for the whole batch. The decoder loop (`decoder.py`) calls
`attend` per layer with q/k/v of that packed sequence as [T, heads, head_dim]; it writes the new
keys/values into their rows of the `PagedKVCache` pool (one `index_copy_` per layer, the rows
precomputed from the block tables) and attends:

* on CUDA, every token (decode rows and prompt chunks alike) goes through the paged kernel
  (`paged_attention.py`): one launch per layer reads each request's blocks in place up to each
  token's own length, from fixed-shape block-table and length tensors (what lets a decode step
  be replayed as a CUDA graph). Elsewhere:
* decode tokens, where the row kernels are installed (`row_kernels.py`: a CPU with AVX2): one
  call per layer reads each row's keys/values in place through its block table, as its own
  range of positions (a sliding window moves the start);
* decode tokens otherwise: rows come sorted by context length and are cut into segments
  (`decode_segments`), so one long request does not make every row attend over its length; a
  segment gathers its rows' blocks into a `[rows, kv_heads, blocks × block_size, head_dim]`
  view (one `index_select` of whole blocks) and runs one batched SDPA with a per-row length mask;
* prefill chunks: one SDPA per chunk against that request's gathered blocks, with a causal mask
  offset by the chunk's start.

The gather copies what attention reads once more; that is cheap next to a CPU's arithmetic.
Grouped-query attention is handled by folding the query heads that share a KV head
into the query-length axis, so keys/values are never repeated.

A sliding window (Mistral, Qwen2's windowed layers) is part of the mask, built once per step for
each window in use. The engine also registers `paged_kv` as a transformers attention
implementation, so `model.generate` still runs on the engine's model: SDPA, except one-token
queries of a model whose decode rows the engine runs through the row kernel, which go through it
too (the same arithmetic on both sides).
Which model families may use this attention is decided in `model_support.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from worker.engine import row_kernels
from worker.engine.paged_attention import paged_attention

ATTN_IMPLEMENTATION = "paged_kv"


@dataclass
class PrefillChunk:
    start: int             # position of the chunk's first token in the request
    length: int
    blocks: torch.Tensor   # long [n]: the request's blocks covering positions [0, start + length)


@dataclass
class DecodeSegment:
    start: int             # decode rows [start, end) ...
    end: int
    blocks: torch.Tensor   # long [(end - start) * n]: each row's first n blocks (padded), row-major
    length: int            # ... attend over positions [0, length) = n blocks


@dataclass
class StepMeta:
    """Per-step index tensors, built once per step and shared by every layer."""
    cache: "object"                 # PagedKVCache
    write_rows: torch.Tensor        # long [T]: pool row of each packed token
    write_pos: torch.Tensor         # long [T]: position of each packed token
    num_decode: int                 # packed tokens [0, num_decode) are decode tokens
    groups: int                     # query heads per KV head
    dtype: torch.dtype
    decode_lengths: torch.Tensor | None = None  # long [num_decode]: context length of each row (query at length-1)
    # The paged kernel's inputs (`paged_attention`, CUDA); when set, every token of the step
    # attends through it, and `segments` / `prefills` are not used:
    block_tables: torch.Tensor | None = None   # int32 [requests, max_blocks]
    table_rows: torch.Tensor | None = None     # long [T]: each token's request (row of block_tables)
    token_lengths: torch.Tensor | None = None  # long [T]: each token attends to positions [0, length)
    segments: list[DecodeSegment] = field(default_factory=list)
    # The row kernel's inputs (CPU, `row_kernels`); when set, the decode rows attend through it
    # and `segments` is empty:
    decode_table: torch.Tensor | None = None   # long [num_decode, blocks]: each row's blocks (padded)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, index: int, window: int | None) -> torch.Tensor:
        """Additive [rows, 1, 1, length] for segment `index`: row r sees positions < its length
        (and, with a window, the last `window` of them)."""
        key = ("decode", index, window)
        if key not in self._masks:
            seg = self.segments[index]
            span = torch.arange(seg.length, device=self.write_pos.device)[None, :]
            lengths = self.decode_lengths[seg.start : seg.end, None]
            allowed = span < lengths
            if window is not None:
                allowed &= span >= lengths - window
            self._masks[key] = additive_mask(allowed, self.dtype).view(seg.end - seg.start, 1, 1, -1)
        return self._masks[key]

    def decode_starts(self, window: int | None) -> torch.Tensor:
        """long [num_decode]: the first position each decode row sees (0, or its window's start)."""
        key = ("starts", window)
        if key not in self._masks:
            lengths = self.decode_lengths
            self._masks[key] = torch.zeros_like(lengths) if window is None else (lengths - window).clamp_(min=0)
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        key = (index, window)
        if key not in self._masks:
            chunk = self.prefills[index]
            span = chunk.blocks.numel() * self.cache.block_size
            self._masks[key] = prefill_mask(chunk.start, chunk.length, self.groups, self.write_pos.device,
                                            self.dtype, window, span)
        return self._masks[key]


def gather_blocks(pool_blocks: torch.Tensor, blocks: torch.Tensor, rows: int, kv_heads: int, head_dim: int,
                  out: torch.Tensor) -> torch.Tensor:
    """[rows, kv_heads, n * block_size, head_dim] view of `blocks` (rows × n, row-major) of a pool
    seen block by block ([blocks, block_size * kv_heads * head_dim], `PagedKVCache.key_blocks`),
    copied into `out` (a reused workspace: a fresh multi-MB tensor per layer costs more in page
    faults than the copy itself)."""
    picked = torch.index_select(pool_blocks, 0, blocks, out=out[: blocks.numel()])
    return picked.view(rows, -1, kv_heads, head_dim).transpose(1, 2)


def attend(meta: StepMeta, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scaling: float,
           window: int | None) -> torch.Tensor:
    """One layer's attention for the packed step: q [T, heads, D], k/v [T, kv_heads, D] (views
    of the fused projection are fine) -> [T, heads, D]. Writes k/v into the layer's pool rows
    first, so each token also attends to itself (k = v = None: the caller has written them,
    row_kernels' `rope_store`)."""
    cache = meta.cache
    if k is not None:
        cache.keys[layer].index_copy_(0, meta.write_rows, k)
        cache.values[layer].index_copy_(0, meta.write_rows, v)
    if meta.block_tables is not None:
        return paged_attention(q, cache.keys[layer], cache.values[layer], meta.block_tables, meta.table_rows,
                               meta.token_lengths, scaling, window, cache.block_size)
    k_blocks, v_blocks = cache.key_blocks[layer], cache.value_blocks[layer]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.keys[layer].shape[1]
    groups = heads // kv_heads
    parts = []
    if meta.num_decode and meta.decode_table is not None:
        nd = meta.num_decode
        parts.append(row_kernels.decode_attention(q if nd == q.shape[0] else q[:nd], cache.keys[layer],
                                                  cache.values[layer], meta.decode_table, meta.decode_starts(window),
                                                  meta.decode_lengths, cache.block_size, scaling))
    elif meta.num_decode:
        nd = meta.num_decode
        q_rows = (q if nd == q.shape[0] else q[:nd]).reshape(nd, kv_heads, groups, head_dim)
        for index, seg in enumerate(meta.segments):
            rows = seg.end - seg.start
            parts.append(F.scaled_dot_product_attention(
                q_rows if rows == nd else q_rows[seg.start : seg.end],
                gather_blocks(k_blocks, seg.blocks, rows, kv_heads, head_dim, cache.gathered_keys),
                gather_blocks(v_blocks, seg.blocks, rows, kv_heads, head_dim, cache.gathered_values),
                attn_mask=meta.decode_mask(index, window), scale=scaling,
            ).reshape(rows, heads, head_dim))
    offset = meta.num_decode
    for index, chunk in enumerate(meta.prefills):
        c = chunk.length
        # fold the query heads sharing a KV head into the query axis: [1, KVH, G * c, D]
        q_chunk = q[offset : offset + c].view(c, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            q_chunk.reshape(1, kv_heads, groups * c, head_dim),
            gather_blocks(k_blocks, chunk.blocks, 1, kv_heads, head_dim, cache.gathered_keys),
            gather_blocks(v_blocks, chunk.blocks, 1, kv_heads, head_dim, cache.gathered_values),
            attn_mask=meta.prefill_mask(index, window), scale=scaling,
        )
        parts.append(out.view(kv_heads, groups, c, head_dim).permute(2, 0, 1, 3).reshape(c, heads, head_dim))
        offset += c
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def decode_segments(lengths: list[int], min_saving: float = 0.25) -> list[tuple[int, int, int]]:
    """Cut decode rows [0, len(lengths)) into at most two contiguous ranges, each attending over
    its own longest context, when that saves at least `min_saving` of the rows x max_len work
    (e.g. one long request among short ones: the scheduler sorts rows by length)."""
    rows = len(lengths)
    whole = rows * max(lengths)
    if rows < 2:
        return [(0, rows, whole)]
    prefix = list(accumulate(lengths, max))                    # longest of rows [0, i]
    suffix = list(accumulate(reversed(lengths), max))[::-1]    # longest of rows [i, rows)
    # cutting before row i costs i * prefix[i - 1] + (rows - i) * suffix[i]; on a tie the last cut wins
    costs = [i * prefix[i - 1] + (rows - i) * suffix[i] for i in range(1, rows)]
    best = min(costs)
    if best <= whole * (1 - min_saving) and best < whole:
        cut = rows - 1 - costs[::-1].index(best)
        return [(0, cut, prefix[cut - 1]), (cut, rows, suffix[cut])]
    return [(0, rows, prefix[-1])]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere. CPU SDPA runs about twice as fast with an
    additive float mask as with a boolean one (it takes its fused kernel)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def prefill_mask(start: int, length: int, groups: int, device, dtype: torch.dtype = torch.float32,
                 window: int | None = None, span: int | None = None) -> torch.Tensor:
    """Causal mask of a chunk at `start` over `span` (>= start + length) key positions: query i
    (repeated for each folded head group) sees positions <= start + i (and > start + i - window
    with a sliding window, as transformers' `sliding_window_overlay`)."""
    q_pos = torch.arange(start, start + length, device=device)[:, None]
    k_pos = torch.arange(span or start + length, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return additive_mask(allowed.repeat(groups, 1), dtype)


def generate_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """`paged_kv` for transformers' own forward (`generate`): one-token queries of a model whose
    decode rows the engine runs through the row kernel go through it too, all else through SDPA."""
    if scaling is not None and not kwargs.get("output_attentions") and not dropout:
        out = row_kernels.generate_decode_attention(module, query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> None:
    """Idempotent: make `paged_kv` a valid `attn_implementation`: transformers' SDPA attention
    (with `generate_attention`'s decode rows) and mask, so a plain forward or `generate()` on the
    engine's model still works (the engine's steps do not go through transformers: they call
    `attend` from the decoder loop)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, generate_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

"""Attention that reads the paged KV pool in place, for every token of a step (a Triton kernel,
CUDA only).

The portable path (`attention.attend`) gathers each request's blocks into a contiguous workspace
and runs SDPA with a mask: per layer that is a few operations for each decode segment and each
prompt chunk, copies what attention reads once more, and its shapes change every step, so it
cannot be replayed as a CUDA graph. This kernel follows vLLM's PagedAttention instead, and, as
vLLM v1's unified Triton attention does, treats decode and prefill alike: every query token of
the packed step is one row, attending to positions [0, its length) of its request (its length
is its position + 1: causal within a prompt chunk for free, since the chunk's keys were written
to the pool before attention runs). One program per (token, KV head) walks that request's block
table up to that length, so work is proportional to the tokens each row really sees, and every
input is a fixed-shape tensor (block tables [requests, max_blocks], a table row per token,
lengths per token) that a captured graph can be fed by copying into it. One launch per layer
covers the whole step, however many requests and prompt chunks it holds.

The query heads that share a KV head (grouped-query attention) are one program's tile, padded
to 16 rows for `tl.dot`; softmax runs online in float32 over tiles of `TILE` positions (each
position's block looked up from the table), so the kernel keeps no [rows, length] scores. A
sliding window starts the walk at the window's first tile and masks the rest, as
`attention.decode_mask` and `attention.prefill_mask` do.

A prompt chunk's tokens each read their request's keys separately (no reuse across the queries of
a chunk, unlike a flash-attention tile); those reads mostly hit L2 for a small model's prompt,
and a query-tiled variant is the next step if long prompts make prefill attention the cost.

Numerics: float32 accumulation (bf16/fp16 products; float32 in float32, not tf32), as a flash
kernel does; SDPA's math on the same inputs differs in the last bits, so on CUDA the engine
equals `generate` in the tokens it picks (tests: fp32 tiny models per family), not bit for bit.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device) -> bool:
    """Whether attention on `device` can use the kernel (CUDA with Triton; or Triton's CPU
    interpreter, TRITON_INTERPRET=1, which tests use to check the kernel without a GPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, table_rows_ptr, lengths_ptr, out_ptr,
                                scale_log2, window,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_table, stride_ot, stride_oh,
                                GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                                HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lengths_ptr + row)
        table = table_ptr + tl.load(table_rows_ptr + row).to(tl.int64) * stride_table
        g = tl.arange(0, GROUPS_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, TILE)
        g_ok = g < GROUPS
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUPS + g
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([GROUPS_PAD], -1.0e30, tl.float32)
        l = tl.zeros([GROUPS_PAD], tl.float32)
        acc = tl.zeros([GROUPS_PAD, DIM_PAD], tl.float32)
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(length - window, 0)
        start = (first // TILE) * TILE
        for tile_start in range(start, length, TILE):
            pos = tile_start + t
            valid = pos < length
            if HAS_WINDOW:
                valid = valid & (pos >= first)
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
            token = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_off = token[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # [GROUPS_PAD, TILE], log2
            scores = tl.where(valid[None, :], scores, -1.0e30)
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
                    table_rows: torch.Tensor, lengths: torch.Tensor, scale: float, window: int | None,
                    block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, D] (token and head strides free, D contiguous); key/value pools
    [pool tokens, kv_heads, D]; block_tables int32 [requests, max_blocks] (a request's position p
    lives in pool row table[p // block_size] * block_size + p % block_size); table_rows [T]: the
    table of each query token's request; lengths [T]: token t attends to positions [0, lengths[t])
    of its request (the last `window` of them with a window). Returns [T, heads, D] in q's dtype."""
    rows, heads, head_dim = q.shape
    kv_heads = key_pool.shape[1]
    groups = heads // kv_heads
    if out is None:
        out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    assert q.stride(2) == 1 and key_pool.stride(2) == 1 and key_pool.stride() == value_pool.stride()
    assert block_tables.stride(1) == 1 and out.stride(2) == 1
    dim_pad = triton.next_power_of_2(head_dim)
    _paged_attention_kernel[(rows, kv_heads)](
        q, key_pool, value_pool, block_tables, table_rows, lengths, out,
        scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUPS=groups, GROUPS_PAD=max(16, triton.next_power_of_2(groups)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=64 if dim_pad <= 128 else 32, HAS_WINDOW=window is not None,
        # float32 stays float32 (Triton's default for a float32 dot is tf32, ~1e-3 off)
        PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out

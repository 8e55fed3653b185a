"""A paged KV cache: one pool of fixed-size blocks per layer, handed to requests as their
tokens are written (vLLM's PagedAttention layout, nano-vllm's block manager).

Each layer keeps a key and a value pool of `num_blocks × block_size` token rows
(`[tokens, kv_heads, head_dim]`, token-major so a block is one contiguous run of memory). A
request owns a block table, the list of its blocks: position p lives in row
`blocks[p // block_size] * block_size + p % block_size` of every layer's pool. Memory is
therefore allocated once, at start-up, for `num_blocks` blocks, and used in proportion to the
tokens requests really hold (no request owns `max_seq_len` rows it may never fill), which lets
the scheduler admit optimistically and preempt when the pool runs out.

Which block is free, held or cached for a prefix is the `BlockPool`'s business (`pool`,
block_pool.py), reached by the scheduler only through the `KVCacheManager`
(kv_cache_manager.py); this module is the memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.engine.block_pool import BlockPool

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig


def model_kv_shape(model_config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers decoder config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV memory one token takes in every layer (a key and a value row)."""
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def free_device_memory(device: torch.device) -> int:
    """Bytes a new allocation on `device` can take: the driver's free memory plus what torch's
    caching allocator holds but does not use (an engine built after another one was dropped)."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def kv_blocks(config: "EngineConfig", layers: int, kv_heads: int, head_dim: int) -> int:
    """KV blocks to allocate. On CUDA the pool must also fit the GPU: by default it is
    `config.num_blocks` capped by `kv_memory_fraction` of the free memory (the rest is left for
    activations, CUDA graphs and the sampler); an explicit `kv_cache_tokens` that does not fit is
    an error at start-up rather than an out-of-memory later."""
    blocks = config.num_blocks
    device = torch.device(config.device)
    if device.type != "cuda":
        return blocks
    block_bytes = bytes_per_token(layers, kv_heads, head_dim, config.dtype) * config.kv_block_size
    fits = int(free_device_memory(device) * config.kv_memory_fraction) // block_bytes - 1   # - the scratch block
    if config.kv_cache_tokens and blocks > fits:
        raise ValueError(f"KV_CACHE_TOKENS={config.kv_cache_tokens} needs {blocks * block_bytes / 2**30:.1f} GiB; "
                         f"{config.kv_memory_fraction:.0%} of the free GPU memory holds {fits * config.kv_block_size} tokens")
    if fits < 1:
        raise ValueError("no GPU memory left for the KV cache")
    return min(blocks, fits)


class PagedKVCache:
    def __init__(self, *, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        # One block more than requests can take: the scratch block, where the padding rows of a
        # replayed CUDA graph write and read (`scratch_block`); it is never handed out.
        shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
        # zeros, not empty: rows no request wrote are read (masked) as padding, and must be finite
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        # the same memory seen block by block, [blocks, block_size * kv_heads * head_dim]: what
        # attention gathers whole blocks from (made once, not a view per layer per step)
        self.key_blocks = [pool.view(num_blocks + 1, -1) for pool in self.keys]
        self.value_blocks = [pool.view(num_blocks + 1, -1) for pool in self.values]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        # Workspaces attention gathers one segment's blocks into (one layer at a time); they
        # grow to the largest gather seen, at most the pool of one layer.
        self.gathered_keys = torch.empty(0, block_size * kv_heads * head_dim, dtype=dtype, device=device)
        self.gathered_values = torch.empty(0, block_size * kv_heads * head_dim, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks, prefix_caching)

    @property
    def num_free(self) -> int:
        """Blocks a request may take (free, or cached for a prefix nobody holds)."""
        return self.pool.num_free

    @property
    def tokens_total(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tokens_used(self) -> int:
        """Token rows held by requests (whole blocks)."""
        return self.pool.num_used * self.block_size

    @property
    def tokens_cached(self) -> int:
        """Token rows of blocks nobody holds that keep a cached prefix (free for new tokens too)."""
        return self.pool.num_cached * self.block_size

    def reserve_gather(self, blocks: int) -> None:
        """Make the gather workspaces hold at least `blocks` blocks (called once per step)."""
        if self.gathered_keys.shape[0] < blocks:
            width, dtype, device = self.gathered_keys.shape[1], self.gathered_keys.dtype, self.gathered_keys.device
            self.gathered_keys = torch.empty(blocks, width, dtype=dtype, device=device)
            self.gathered_values = torch.empty(blocks, width, dtype=dtype, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

"""A slot-based KV cache: one preallocated [slots, kv_heads, max_seq_len, head_dim] tensor per
layer for keys and one for values. A request owns one slot for its lifetime, its tokens live at
their own positions in it, so requests of different lengths share a batched forward pass
without padding or copying (attention reads a *view* of the first used slots). Free slots are
handed out lowest first, which keeps the used rows compact and that view small."""

from __future__ import annotations

import heapq

import torch


def model_kv_shape(model_config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers decoder config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


class SlotKVCache:
    def __init__(self, *, layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: str):
        shape = (slots, kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len
        self._free = list(range(slots))
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free slot; the caller checks `num_free` first."""
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        """Return a slot. Its stale contents are never read: attention only looks at positions
        below each request's current length, and a new owner overwrites from position 0."""
        heapq.heappush(self._free, slot)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
